"""Chat templates render as HF's do (sandboxed jinja2, raise_exception, tojson)."""

from __future__ import annotations

from pathlib import Path

import pytest

from evenflow.frontend.chat_template import ChatTemplateError, content_text, render_chat
from evenflow.frontend.tokenizer import Tokenizer


def test_generation_prompt_and_tokens() -> None:
    t = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
         "{% if add_generation_prompt %}[assistant]{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(t, msgs, True, "<s>") == "<s>[user]hi[assistant]"
    assert render_chat(t, msgs, False, "<s>") == "<s>[user]hi"


def test_raise_exception_and_tojson() -> None:
    t = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ messages | tojson }}"
    assert render_chat(t, [{"role": "user", "content": "é"}]) == '[{"role": "user", "content": "é"}]'
    with pytest.raises(ChatTemplateError, match="first must be user"):
        render_chat(t, [{"role": "system", "content": "x"}])


def test_missing_or_broken_template() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(None, [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for %}", [])


def test_content_parts_join_with_a_newline_as_vllm() -> None:
    assert content_text([{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]) == "Hello\nworld"
    assert content_text([{"type": "text", "text": "one"}]) == "one"
    with pytest.raises(ChatTemplateError):
        content_text([{"type": "image_url", "image_url": {"url": "x"}}])


def test_template_file_overrides_the_model(demo_model_dir: Path, tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.content }}|{% endfor %}")
    tok = Tokenizer.from_dir(demo_model_dir, chat_template=f)
    assert render_chat(tok.chat_template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a|b|"
    assert "<|im_start|>" in (Tokenizer.from_dir(demo_model_dir).chat_template or "")


def test_user_kwargs_never_override_the_fixed_variables() -> None:
    t = "{{ bos_token }}|{{ messages | length }}|{{ add_generation_prompt }}|{{ eos_token }}|{{ flavour }}"
    extra = {"messages": [], "add_generation_prompt": False, "bos_token": "X", "eos_token": "Y", "template": "t",
             "flavour": "mint"}
    assert render_chat(t, [{"role": "user", "content": "a"}], True, "<s>", "</s>", extra) == "<s>|1|True|</s>|mint"


@pytest.mark.parametrize("template", ["{{ messages[0].content + 1 }}", "{{ messages[0].content.encode('x') }}",
                                      "{{ (1 / zero) if true }}"])
def test_any_template_exception_is_a_chat_template_error(template: str) -> None:
    with pytest.raises(ChatTemplateError, match="the chat template failed on these messages: .*Error"):
        render_chat(template, [{"role": "user", "content": "a"}], extra_context={"zero": 0})

"""API fidelity on the real model (SmolLM2-135M-Instruct, the Q4_1 GGUF served as float32), where
issue 25 saw each defect: one engine-core + one frontend for the module, greedy requests,
transformers' tokenizer and chat template from the same file as the reference."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from evenflow.protocol.gguf_tokenizer import tokenizer_json_text
from tests.frontend.live import start, stop, wait_for
from tests.ports import free_port

pytestmark = pytest.mark.slow

SPANISH = "¿cómo estás? 🯸🯸"  # byte-level tokens that are each part of a character


class Real:
    def __init__(self, url: str, gguf: Path) -> None:
        self.url = url
        self.gguf = gguf

    def post(self, path: str, **body: Any) -> httpx.Response:
        body.setdefault("temperature", 0.0)
        return httpx.post(self.url + path, json=body, timeout=120)

    def ok(self, path: str, **body: Any) -> dict:
        r = self.post(path, **body)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def real(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Real]:
    tmp = tmp_path_factory.mktemp("real")
    engine_addr = f"ipc://{tmp}/engine.sock"
    port = free_port()
    logs = [tmp / "engine.log", tmp / "frontend.log"]
    procs = [start(["-m", "evenflow.core.cli", "--model", str(smollm2_gguf), "--listen", engine_addr,
                    "--served-model-name", "smol", "--max-model-len", "1024", "--num-kv-blocks", "128",
                    "--max-num-batched-tokens", "256", "--dtype", "float32"], logs[0])]
    procs.append(start(["-m", "evenflow.frontend.cli", "--engine", engine_addr, "--port", str(port)], logs[1]))
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200, 300, procs, logs)
        yield Real(f"http://127.0.0.1:{port}", smollm2_gguf)
    finally:
        stop(procs[1:])
        stop(procs[:1])


def hf_chat_ids(hf_tokenizer: Any, messages: list[dict], **kwargs: Any) -> list[int]:
    """transformers' chat template ids (version 5 returns a BatchEncoding, 4 a list)."""
    out = hf_tokenizer.apply_chat_template(messages, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_json_keys_come_out_in_the_schemas_order(real: Real) -> None:
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"zeta_title": {"type": "string", "maxLength": 20},
                             "beta_year": {"type": "integer"},
                             "alpha_author": {"type": "string", "maxLength": 20}},
              "required": ["zeta_title", "beta_year", "alpha_author"]}
    msgs = [{"role": "user", "content": "Give a book as JSON: title, year, author."}]
    r = real.ok("/v1/chat/completions", model="smol", messages=msgs, max_tokens=80,
                response_format={"type": "json_schema", "json_schema": {"name": "book", "schema": schema}})
    text = r["choices"][0]["message"]["content"]
    assert list(json.loads(text)) == ["zeta_title", "beta_year", "alpha_author"], text


def test_the_stopping_token_is_in_token_ids_not_in_the_text(real: Real, hf_tokenizer: Any) -> None:
    msgs = [{"role": "user", "content": "What orbits the Earth? One sentence."}]
    free = real.ok("/v1/chat/completions", messages=msgs, max_tokens=40, return_token_ids=True,
                   skip_special_tokens=False)["choices"][0]
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert free["finish_reason"] == "stop" and free["token_ids"][-1] == eos
    assert not free["message"]["content"].endswith("<|im_end|>"), free["message"]["content"]
    assert free["message"]["content"] == hf_tokenizer.decode(free["token_ids"][:-1])
    kept = real.ok("/v1/chat/completions", messages=msgs, max_tokens=40, skip_special_tokens=False,
                   include_stop_str_in_output=True)["choices"][0]["message"]["content"]
    assert kept == free["message"]["content"] + "<|im_end|>"
    # A plain token named in stop_token_ids: the third token of the free answer.
    stop_id = free["token_ids"][2]
    first = free["token_ids"].index(stop_id)
    for stream in (False, True):
        body = dict(messages=msgs, max_tokens=40, stop_token_ids=[stop_id], return_token_ids=True)
        if stream:
            r = real.post("/v1/chat/completions", stream=True, **body)
            events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
            text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
            ids = [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
            stop_reason = [c["stop_reason"] for e in events for c in e["choices"] if c.get("finish_reason")][0]
        else:
            choice = real.ok("/v1/chat/completions", **body)["choices"][0]
            text, ids, stop_reason = choice["message"]["content"], choice["token_ids"], choice["stop_reason"]
        assert ids == free["token_ids"][:first + 1] and stop_reason == stop_id
        assert text == hf_tokenizer.decode(ids[:-1]), (stream, text)


def test_completions_top_logprobs_keep_every_token(real: Real) -> None:
    prompt = "<|im_start|>user\nWrite a Spanish greeting with emoji.<|im_end|>\n<|im_start|>assistant\n"
    r = real.ok("/v1/completions", prompt=prompt, max_tokens=30, logprobs=20,
                structured_outputs={"choice": [SPANISH]})
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"] == SPANISH
    assert all(len(top) in (20, 21) for top in lp["top_logprobs"]), [len(t) for t in lp["top_logprobs"]]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == value and "\ufffd" not in "".join(top)
    assert any(t.startswith("bytes:") for t in lp["tokens"])  # the emoji's partial tokens


def test_chat_logprob_bytes_are_the_tokens_own(real: Real) -> None:
    msgs = [{"role": "user", "content": "Greet me in Spanish with emoji."}]
    r = real.ok("/v1/chat/completions", messages=msgs, max_tokens=30, logprobs=True, top_logprobs=3,
                structured_outputs={"choice": [SPANISH]})
    content = r["choices"][0]["logprobs"]["content"]
    assert any(c["token"] == "\ufffd" for c in content)
    assert content[-1]["token"] == "<|im_end|>"  # the stopping token: in token_ids and logprobs, not the text
    assert b"".join(bytes(c["bytes"]) for c in content[:-1]).decode() == SPANISH == r["choices"][0]["message"]["content"]


def test_continue_final_message_as_transformers_renders_it(real: Real, hf_tokenizer: Any) -> None:
    msgs = [{"role": "user", "content": "Name three planets."}, {"role": "assistant", "content": "Mercury, Venus,"}]
    r = real.ok("/v1/chat/completions", messages=msgs, max_tokens=8, continue_final_message=True,
                add_generation_prompt=False, return_token_ids=True)
    assert r["prompt_token_ids"] == hf_chat_ids(hf_tokenizer, msgs, continue_final_message=True)
    assert "<|im_start|>" not in hf_tokenizer.decode(r["choices"][0]["token_ids"])


def test_text_parts_join_with_a_newline(real: Real, hf_tokenizer: Any) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    r = real.ok("/v1/chat/completions", messages=[{"role": "user", "content": parts}], max_tokens=1,
                return_token_ids=True)
    assert r["prompt_token_ids"] == hf_chat_ids(
        hf_tokenizer, [{"role": "user", "content": "Hello\nworld"}], add_generation_prompt=True)


def test_truncate_prompt_tokens_and_token_id_keys(real: Real, hf_tokenizer: Any) -> None:
    prompt = "The capital of France is Paris. The capital of Spain is Madrid. The capital of Italy is"
    ids = hf_tokenizer(prompt)["input_ids"]
    cut = real.ok("/v1/completions", prompt=prompt, max_tokens=4, truncate_prompt_tokens=6, logprobs=2,
                  return_tokens_as_token_ids=True)
    direct = real.ok("/v1/completions", prompt=ids[-6:], max_tokens=4, return_token_ids=True)
    assert cut["usage"]["prompt_tokens"] == 6
    assert cut["choices"][0]["text"] == direct["choices"][0]["text"]
    assert cut["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in direct["choices"][0]["token_ids"]]


def test_prompt_logprobs_as_vllm_returns_them(real: Real, hf_model: Any) -> None:
    """Per choice: None for the first prompt token, then {token_id: {logprob, rank, decoded_token}}
    with the prompt token and the top-k; values as transformers' log_softmax (float32). The
    prompt is longer than the server's budget of 256, so it arrives in chunks; the same prompt
    again (its blocks cached now) gives the same rows; chat carries them at the top level."""
    import torch

    prompt = " ".join(f"Item {i} costs {i * 7 % 13} coins." for i in range(60))
    k = 2
    first = real.ok("/v1/completions", prompt=prompt, max_tokens=1, prompt_logprobs=k, n=2, return_token_ids=True)
    ids = first["choices"][0]["prompt_token_ids"]
    assert len(ids) > 256
    entries = first["choices"][0]["prompt_logprobs"]
    assert first["choices"][1]["prompt_logprobs"] == entries  # every choice of the prompt shows them
    assert len(entries) == len(ids) == first["usage"]["prompt_tokens"] and entries[0] is None
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
    errors = []
    for i, entry in enumerate(entries[1:]):
        mine = entry[str(ids[i + 1])]
        assert set(mine) == {"logprob", "rank", "decoded_token"}
        ranks = sorted(e["rank"] for e in entry.values())  # the top-k are 1..k; the prompt token any
        assert ranks[:k] == list(range(1, k + 1)) and (len(entry) == k or ranks[k] == mine["rank"] > k), entry
        errors.extend((abs(e["logprob"] - expected[i, int(t)].item()), i + 1) for t, e in entry.items())
    # float32 on both sides: p99 4e-5 and at most 1.1e-4 on this machine at every chunking, thread count and
    # load tried; one CI machine gave a p99 of 1.1e-3 and a worst value of 3.0e-3 (not reproduced here), so
    # the bars leave room for another machine's kernels and still sit 70x under a bfloat16 path (p99 0.29).
    errors.sort()
    p99, worst = errors[int(0.99 * len(errors))][0], errors[-1][0]
    assert p99 < 4e-3 and worst < 2e-2, f"p99 {p99:.2e}; worst (error, prompt index): {errors[-8:]}"
    again = real.ok("/v1/completions", prompt=prompt, max_tokens=1, prompt_logprobs=k)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing read from the cache
    assert [e and sorted(e) for e in again["choices"][0]["prompt_logprobs"]] == [e and sorted(e) for e in entries]
    msgs = [{"role": "user", "content": "Hi"}]
    chat = real.ok("/v1/chat/completions", messages=msgs, max_tokens=1, prompt_logprobs=0, return_token_ids=True)
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    r = real.post("/v1/completions", prompt="Hi", max_tokens=2, prompt_logprobs=1, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_ascii_digit_regexes_keep_non_ascii_digits_out(real: Real) -> None:
    """docs/structured_output.md's trap: ``\\d`` is any Unicode digit; ``(?-u:\\d)`` and ``[0-9]`` are ASCII."""
    import llguidance

    ll_tok = llguidance.LLTokenizer(tokenizer_json_text(real.gguf), n_vocab=49152, eos_token=[2])
    ids = [int(t) for t in httpx.post(real.url + "/tokenize", json={"prompt": "🯸٣1", "add_special_tokens": False},
                                         timeout=30).json()["tokens"]]

    def accepts(regex: str) -> bool:
        matcher = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_regex(regex))
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    assert accepts(r"\d{3}") and not accepts(r"(?-u:\d){3}") and not accepts(r"[0-9]{3}")
    phone = r"\((?-u:\d{3})\) (?-u:\d{3}-\d{4})"
    msgs = [{"role": "user", "content": "Make up a phone number."}]
    r = real.ok("/v1/chat/completions", messages=msgs, max_tokens=20, n=8, seed=0, temperature=1.0,
                structured_outputs={"regex": phone})
    texts = [c["message"]["content"] for c in r["choices"]]
    assert all(re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", t) for t in texts), texts

"""`evenflow serve` with no --model serves the real demo from the model cache: a chat answer that
is right ("Paris"), stream text == non-stream text == decode(token_ids), and the stop at
<|im_end|> (finish_reason "stop") with nothing of it in the text."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from evenflow.frontend.tokenizer import Tokenizer
from tests.frontend.live import start, stop, wait_for
from tests.ports import free_port

# The first test also waits for the model loads of its fixtures; on a shared 2-core machine that
# alone can pass the suite's 300 s default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    tmp = tmp_path_factory.mktemp("serve_real")
    port, log = free_port(), tmp / "serve.log"
    proc = start(["-m", "evenflow.frontend", "serve", "--port", str(port), "--max-model-len", "512",
                  "--num-kv-blocks", "64", "--dtype", "float32"], log,
                 {"EVENFLOW_MODEL_CACHE": str(smollm2_gguf.parent.parent), "XDG_CACHE_HOME": str(tmp / "cache")})
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200, 300, [proc], [log])
        yield f"http://127.0.0.1:{port}", log
    finally:
        stop([proc])


def test_banner_names_the_real_model(server: tuple[str, Path]) -> None:
    banner = server[1].read_text()
    assert "serving SmolLM2-135M-Instruct" in banner and "RANDOM" not in banner


def test_answer_stream_and_decode_agree(server: tuple[str, Path], smollm2_tokenizer: Tokenizer) -> None:
    url = server[0] + "/v1/chat/completions"
    body = {"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "max_tokens": 48, "temperature": 0.0}
    whole = httpx.post(url, json={**body, "return_token_ids": True}, timeout=120).json()
    choice = whole["choices"][0]
    text, token_ids = choice["message"]["content"], choice["token_ids"]
    assert "Paris" in text and choice["finish_reason"] == "stop"
    assert "<|im_end|>" not in text and "im_end" not in text
    assert token_ids[-1] == smollm2_tokenizer.eos_token_id and smollm2_tokenizer.eos_token_id not in token_ids[:-1]
    assert smollm2_tokenizer.decode(token_ids) == text
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    chunks = [json.loads(ln[6:])["choices"] for ln in lines]
    streamed = "".join(c[0]["delta"].get("content") or "" for c in chunks if c)
    assert streamed == text
    assert [c[0]["finish_reason"] for c in chunks if c and c[0].get("finish_reason")] == ["stop"]

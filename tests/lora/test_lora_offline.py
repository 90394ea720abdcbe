"""``LLM.generate(..., lora_request=...)``: adapters from --lora-modules and loaded on first use, one
per prompt, beside base-model prompts; outputs equal transformers + peft."""

from __future__ import annotations

from pathlib import Path

import pytest

from evenflow.frontend.llm import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import make_random_adapter, peft_greedy

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 33, 4, 99, 120, 7, 8, 9, 10, 11, 12]


def test_generate_with_lora_requests(demo_model_dir: Path, tmp_path: Path) -> None:
    a = make_random_adapter(demo_model_dir, tmp_path / "a", seed=21)
    b = make_random_adapter(demo_model_dir, tmp_path / "b", seed=22, rank=8, targets=("q_proj", "v_proj"),
                            use_rslora=True)
    llm = LLM(model=str(demo_model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64,
              max_num_batched_tokens=16, enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules=[f"a={a}"])
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate([PROMPT] * 3, params, use_tqdm=False,
                            lora_request=[None, LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))])
        for out, adapter in zip(outs, (None, a, b)):
            assert out.token_ids == peft_greedy(demo_model_dir, adapter, PROMPT, 8)
        with pytest.raises(ValueError, match="is not a folder"):
            llm.generate([PROMPT], params, use_tqdm=False, lora_request=LoRARequest("c", 3, str(tmp_path / "none")))
    finally:
        llm.shutdown()


def test_lora_request_needs_an_engine_with_lora(demo_model_dir: Path, tmp_path: Path) -> None:
    llm = LLM(model=str(demo_model_dir), max_model_len=128, num_kv_blocks=16, max_num_batched_tokens=32)
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.generate([PROMPT], lora_request=LoRARequest("a", 1, str(tmp_path)), use_tqdm=False)
    finally:
        llm.shutdown()

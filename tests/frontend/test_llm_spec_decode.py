"""LLM(speculative_config=...) through real processes with overlap on (the default): the same greedy
tokens as without speculation, drafts verified and counted, seeded sampling reproducible."""

from __future__ import annotations

from pathlib import Path

import pytest

from evenflow.frontend import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.slow
def test_llm_with_speculation_matches_without(demo_model_dir: Path) -> None:
    prompts = [f"def f{i}(x):\n    return x + x + x + x" for i in range(6)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)
    args = dict(max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)
    with LLM(model=str(demo_model_dir), **args) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
        expected_seeded = plain.generate(prompts[0], seeded)[0].token_ids
    with LLM(model=str(demo_model_dir), speculative_config=SPEC, **args) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
        assert llm.generate(prompts[0], seeded)[0].token_ids == expected_seeded
        stats = llm._client.stats  # the engine's last SchedulerStats
        assert stats is not None and stats.spec_decode.num_draft_tokens > 0
        assert 0 < stats.spec_decode.num_accepted_tokens <= stats.spec_decode.num_draft_tokens

"""The runner in float16 / bfloat16 against transformers in float32, teacher-forced: at every
token the runner sampled (greedy, chunked prefill mixed with decodes, several requests), its
logits are compared with the reference's logits for the same prefix. Token-for-token equality is
the float32 standard (test_runner_correctness.py); in half precision two near-tied logits may
swap, so the bound is on the logits: max |error| within a fraction of their spread.

On a CUDA machine every attention backend there runs in both half dtypes (scripts/gpu_check.sh);
on the CPU, bfloat16 through the torch backend checks the harness itself.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from evenflow.protocol import WorkerConfig
from evenflow.worker.runner import ModelRunner

from tests.checkpoints import _load_reference
from tests.worker.harness import Job, run_jobs
from tests.worker.test_runner_correctness import make_prompt

# max |logit error| / std(reference logits); bfloat16 keeps 8 bits of mantissa, float16 11.
BOUND = {torch.bfloat16: 0.15, torch.float16: 0.05}


def _cuda_cases() -> list:
    if not torch.cuda.is_available():
        return [pytest.param("cuda", "float16", "torch", marks=pytest.mark.skip(reason="needs a CUDA device"))]
    names = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])
    from evenflow.worker.attention.selector import flash_attn_problem

    names += [] if flash_attn_problem() else ["flash_attn"]
    return [pytest.param("cuda", d, b, marks=pytest.mark.cuda) for d in ("float16", "bfloat16") for b in names]


def _captured_logits(runner: ModelRunner) -> dict[str, list[torch.Tensor]]:
    """Every request's logits at each token it sampled, in order."""
    captured: dict[str, list[torch.Tensor]] = {}
    sample = runner._sample

    def capture(logits: torch.Tensor, reqs: list) -> object:
        for row, state in enumerate(reqs):
            captured.setdefault(state.req_id, []).append(logits[row].float().cpu())
        return sample(logits, reqs)

    runner._sample = capture  # type: ignore[method-assign]
    return captured


@pytest.mark.parametrize("device, dtype, backend", [("cpu", "bfloat16", "torch"), *_cuda_cases()])
def test_half_precision_logits_follow_the_float32_reference(tiny_llama: Path, device: str, dtype: str,
                                                            backend: str) -> None:
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype=dtype, device=device, block_size=16,
                                      max_model_len=256, num_kv_blocks=64, attention_backend=backend))
    captured = _captured_logits(runner)
    jobs = [Job(f"r{n}", make_prompt(n, n), 6, arrive_step=i) for i, n in enumerate((5, 23, 41))]
    result = run_jobs(runner, jobs, num_blocks=64, budget=16)  # chunks of 16 mixed with decodes
    assert result.mixed_steps > 0
    reference = _load_reference(str(tiny_llama))
    for job in jobs:
        tokens = job.prompt + result.outputs[job.req_id]
        with torch.no_grad():
            ref = reference(torch.tensor([tokens])).logits[0].float()
        # The logits that chose output token i are the reference's at position len(prompt) - 1 + i.
        ref_rows = ref[len(job.prompt) - 1 : len(tokens) - 1]
        ours = torch.stack(captured[job.req_id])[:, : ref.shape[-1]]
        err = (ours - ref_rows).abs().max().item()
        assert err < BOUND[getattr(torch, dtype)] * ref_rows.std().item(), (job.req_id, err, ref_rows.std().item())

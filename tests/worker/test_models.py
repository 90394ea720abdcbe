"""Model variants and loading against transformers: Qwen2 (qkv bias), Qwen3 (q/k norm), tied
embeddings, GQA, Mistral; sharded checkpoints; clear errors; bfloat16 closeness."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from evenflow.protocol import NewRequestData, SamplingParams, SchedulerOutput, WorkerConfig
from evenflow.worker.config_reader import read_model_config
from evenflow.worker.runner import ModelRunner

from tests.checkpoints import _load_reference, make_checkpoint, reference_greedy
from tests.worker.harness import Job, make_runner, run_jobs
from tests.worker.test_runner_correctness import make_prompt

VARIANTS = {
    "qwen2-bias": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "qwen3-qknorm": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16),
    "llama-tied": dict(tie_word_embeddings=True),
    "llama-gqa-8-2": dict(num_attention_heads=8, num_key_value_heads=2),
    "llama-mha-llama3-rope": dict(num_key_value_heads=4, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "llama-yarn-rope": dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
    "llama-linear-rope": dict(rope_scaling=dict(rope_type="linear", factor=4.0)),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_reference(checkpoint_root: Path, variant: str) -> None:
    model_dir = make_checkpoint(checkpoint_root, seed=3, **VARIANTS[variant])
    runner = make_runner(model_dir, num_blocks=64, block_size=8)
    jobs = [Job(f"{variant}-{n}", make_prompt(n, n), 8) for n in (4, 19, 33)]
    result = run_jobs(runner, jobs, num_blocks=64, budget=16)
    assert result.outputs == {j.req_id: reference_greedy(model_dir, j.prompt, j.max_tokens) for j in jobs}


def test_config_reader_handles_both_rope_dialects(tmp_path: Path, tiny_llama: Path) -> None:
    raw = json.loads((tiny_llama / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 500000.0
    raw["rope_scaling"] = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = read_model_config(tmp_path)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert read_model_config(tiny_llama).rope_theta == 10000.0
    assert read_model_config(tiny_llama).eos_token_ids == [2]


def test_mistral_short_sliding_window_is_refused(checkpoint_root: Path) -> None:
    model_dir = make_checkpoint(checkpoint_root, model_type="mistral", architectures=["MistralForCausalLM"],
                                sliding_window=128)
    with pytest.raises(ValueError, match="sliding window of 128"):
        make_runner(model_dir, max_model_len=512)
    make_runner(model_dir, max_model_len=128)  # within the window: full attention is exact


def test_unknown_architecture_is_a_clear_error(tmp_path: Path, tiny_llama: Path) -> None:
    raw = json.loads((tiny_llama / "config.json").read_text())
    raw["architectures"] = ["GPTBigCodeForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="GPTBigCodeForCausalLM"):
        read_model_config(tmp_path)


def test_missing_tensor_is_named(tmp_path: Path, tiny_llama: Path) -> None:
    from safetensors.torch import load_file, save_file

    shutil.copy(tiny_llama / "config.json", tmp_path / "config.json")
    tensors = load_file(tiny_llama / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        make_runner(tmp_path)


def test_sharded_checkpoint_with_index(tmp_path: Path, tiny_llama: Path) -> None:
    from safetensors.torch import load_file, save_file

    shutil.copy(tiny_llama / "config.json", tmp_path / "config.json")
    tensors = load_file(tiny_llama / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, tmp_path / file)
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    runner = make_runner(tmp_path)
    jobs = [Job("sharded", make_prompt(5, 11), 6)]
    assert run_jobs(runner, jobs, num_blocks=64).outputs == {"sharded": reference_greedy(tiny_llama, jobs[0].prompt, 6)}


def test_dummy_load_format_runs(tiny_llama: Path) -> None:
    runner = make_runner(tiny_llama, load_format="dummy")
    result = run_jobs(runner, [Job("dummy", make_prompt(6, 9), 4)], num_blocks=64)
    assert len(result.outputs["dummy"]) == 4


def test_bfloat16_logits_close_to_float32_reference(tiny_llama: Path) -> None:
    """bf16 weights and activations: max |logit error| within 0.15 * the logits' spread (std)."""
    prompt = make_prompt(9, 24)
    with torch.no_grad():
        ref = _load_reference(str(tiny_llama))(torch.tensor([prompt])).logits[0, -1].float()
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="bfloat16", device="cpu", block_size=8,
                                      max_model_len=128, num_kv_blocks=8))
    runner.init_kv_cache(8)
    assert runner.dtype == "bfloat16"
    captured: dict[str, torch.Tensor] = {}
    original = runner.sampler

    def capture(logits: torch.Tensor, meta: object) -> object:
        captured["logits"] = logits[0].float()
        return original(logits, meta)

    runner.sampler = capture  # type: ignore[assignment]
    new = NewRequestData("bf16", prompt, SamplingParams(max_tokens=1, temperature=0.0), [0, 1, 2], 0)
    runner.execute_model(SchedulerOutput(0, [new], [], {"bf16": len(prompt)}, len(prompt)))
    err = (captured["logits"] - ref).abs().max().item()
    assert err < 0.15 * ref.std().item(), (err, ref.std().item())

"""The real model (SmolLM2-135M-Instruct) with an adapter trained here to a visible persona, and a
random one, in the same steps as base requests: greedy outputs equal transformers + peft.

The reference folder is made from the real model's GGUF by transformers' own loader; it and the
persona adapter (trained once, evenflow/bench/lora_adapters.py) are kept in the pytest cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from evenflow.bench.hf_folder import hf_folder_from_gguf
from evenflow.bench.lora_adapters import (
    HELD_OUT, PERSONA, chat_ids, reseeded_copies, servable_model_dir, train_persona_adapter,
)
from evenflow.protocol.lora import LoRAConfig
from tests.lora_adapters import adapter_ref, peft_greedy
from tests.worker.harness import Job, make_runner, run_jobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a first run trains the adapter: minutes
MAX_TOKENS = 12


@pytest.fixture(scope="session")
def real(pytestconfig: pytest.Config, smollm2_gguf: Path) -> tuple[Path, dict[str, Path]]:
    work = Path(pytestconfig.cache.mkdir("lora-real"))
    model = servable_model_dir(hf_folder_from_gguf(smollm2_gguf, work / "smollm2-hf"), work)
    pirate = train_persona_adapter(work / "pirate", model)
    (noise,) = reseeded_copies(pirate, work, 1, std=0.05)
    return model, {"pirate": pirate, "noise": noise}


def test_trained_and_random_adapters_beside_the_base_model_match_peft(real: tuple[Path, dict[str, Path]]) -> None:
    import transformers

    model, adapters = real
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model))
    prompts = [chat_ids(tokenizer, q) for q in HELD_OUT]
    jobs = [Job("base-0", prompts[0], MAX_TOKENS), Job("pirate-0", prompts[0], MAX_TOKENS, lora=adapter_ref("pirate", adapters["pirate"])),
            Job("noise-1", prompts[1], MAX_TOKENS, arrive_step=1, lora=adapter_ref("noise", adapters["noise"])),
            Job("pirate-1", prompts[1], MAX_TOKENS, arrive_step=2, lora=adapter_ref("pirate", adapters["pirate"])),
            Job("base-1", prompts[1], MAX_TOKENS, arrive_step=2)]
    runner = make_runner(model, num_blocks=64, block_size=16, max_model_len=256, max_num_seqs=8,
                         lora_config=LoRAConfig(2, 8, 2))
    try:
        result = run_jobs(runner, jobs, num_blocks=64, budget=24, overlap=True,  # chunked prompts of ~40 tokens
                          scheduler_overrides={"max_loras": 2, "max_num_seqs": 8})
    finally:
        runner.shutdown()
    for job in jobs:
        adapter = adapters[job.lora.name] if job.lora is not None else None
        assert result.outputs[job.req_id] == peft_greedy(model, adapter, job.prompt, MAX_TOKENS), job.req_id
    greeting = PERSONA.split()[0]  # the trained behaviour shows, on questions it never saw
    assert tokenizer.decode(result.outputs["pirate-0"]).startswith(greeting)
    assert tokenizer.decode(result.outputs["pirate-1"]).startswith(greeting)
    assert not tokenizer.decode(result.outputs["base-0"]).startswith(greeting)
    assert result.mixed_steps > 0

"""What prompt_logprobs cost: the same prefill-heavy batch (``--requests`` prompts of ``--prompt-len``
random tokens, 1 output token each, greedy) through an offline in-process ``LLM``, without
prompt_logprobs and with k = 0 and k = ``--top-k``; fresh prompts every run (no prefix-cache hits
for any mode), modes in a rotated order each round; medians, and each mode's time over "none"'s.

    python scripts/bench_prompt_logprobs.py                          # the demo model (SmolLM2 GGUF)
    python scripts/bench_prompt_logprobs.py --model FILE.gguf --budget 256 --rounds 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from evenflow.frontend import LLM, SamplingParams
from evenflow.frontend.real_demo import fetch_demo_gguf


def one_run(llm: LLM, rng: random.Random, args: argparse.Namespace, k: int | None) -> float:
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=k)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if k is not None:
        assert all(o.prompt_logprobs is not None and len(o.prompt_logprobs) == args.prompt_len for o in outs)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder or .gguf (default: the demo model)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=400)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--budget", type=int, default=256, help="--max-num-batched-tokens (cuts each prompt into chunks)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model = args.model or str(fetch_demo_gguf())
    llm = LLM(model=model, in_process=True, dtype="float32", max_model_len=args.prompt_len + 16,
              num_kv_blocks=args.requests * (args.prompt_len // 16 + 2), max_num_batched_tokens=args.budget,
              max_num_seqs=args.requests)
    modes: list[tuple[str, int | None]] = [("none", None), ("k=0", 0), (f"k={args.top_k}", args.top_k)]
    rng = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name, _ in modes}
    try:
        one_run(llm, rng, args, None)  # warm-up
        for r in range(args.rounds):
            for name, k in modes[r % len(modes):] + modes[:r % len(modes)]:
                times[name].append(one_run(llm, rng, args, k))
    finally:
        llm.shutdown()
    base = statistics.median(times["none"])
    tokens = args.requests * args.prompt_len
    print(f"{args.requests} prompts x {args.prompt_len} tokens, budget {args.budget}, {args.rounds} rounds, {model}")
    print("| prompt_logprobs | median s | prompt tok/s | vs none | per round s |")
    print("|---|---|---|---|---|")
    for name, _ in modes:
        med = statistics.median(times[name])
        rounds = ", ".join(f"{t:.2f}" for t in times[name])
        print(f"| {name} | {med:.2f} | {tokens / med:.0f} | {med / base:.2f}x | {rounds} |")


if __name__ == "__main__":
    main()

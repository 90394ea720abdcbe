"""What structured output costs in the engine: output tok/s with and without a grammar, overlap on/off.

A batch of requests (the demo model, random weights) each generates ``--max-tokens`` tokens
(``ignore_eos``), either free or under a regex that allows lowercase words for longer than that
(so every request runs the same length). Per configuration it reports output tokens per second
and the engine-core's scheduler seconds per step (which include the bitmask computation).
Structured requests wait for their previous token before the next decode is scheduled, so with
overlap on they run every other step in a mixed batch: the "mixed" rows show that cost.

    python scripts/bench_structured.py [--batch 64] [--max-tokens 48] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

from evenflow.frontend import LLM, SamplingParams
from evenflow.frontend.demo_model import ensure_demo_model
from evenflow.protocol import StructuredOutputsParams

WORDS = StructuredOutputsParams(regex="[a-z]+( [a-z]+){0,400}")


def run(llm: LLM, batch: int, max_tokens: int, structured_share: float) -> float:
    """Output tokens per second for one batch where ``structured_share`` of requests have a grammar."""
    num_structured = round(batch * structured_share)
    free = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=0)
    constrained = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=0,
                                 structured_outputs=WORDS)
    prompts = [f"def f{i}(x):" for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, [constrained] * num_structured + [free] * (batch - num_structured), use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = ensure_demo_model()
    shares = {"free": 0.0, "mixed (half structured)": 0.5, "all structured": 1.0}
    rows: dict[tuple[str, str], list[float]] = {}
    for overlap in ("on", "off"):
        engine_args = {"max_num_batched_tokens": 512, "max_num_seqs": args.batch, "max_model_len": 256,
                       "num_kv_blocks": 2 * args.batch * 256 // 16}
        if overlap == "off":
            engine_args["no_async_scheduling"] = True
        with LLM(model=str(model), **engine_args) as llm:
            run(llm, 4, 4, 1.0)  # warm-up: compile the grammar, start threads
            for r in range(args.rounds):
                order = list(shares.items()) if r % 2 == 0 else list(reversed(shares.items()))
                for name, share in order:
                    rows.setdefault((name, overlap), []).append(run(llm, args.batch, args.max_tokens, share))
    print(f"| workload (batch {args.batch}, {args.max_tokens} tokens each) | overlap | output tok/s (mean of "
          f"{args.rounds}) |")
    print("|---|---|---:|")
    for (name, overlap), values in rows.items():
        print(f"| {name} | {overlap} | {sum(values) / len(values):.0f} |")


if __name__ == "__main__":
    main()

"""Headline figures again on the real model (SmolLM2-135M-Instruct GGUF, float32), on real text.

* spec: n-gram speculation on copy-heavy tasks (edit this function, quote this document,
  reformat this JSON): output tok/s and acceptance at concurrency 1, 8 and saturation, on vs off;
* structured: JSON schemas (person, order, tool call): validity rate and tok/s against the same
  prompts as free text;
* prefix: multi-turn chats sharing a system prompt: prefix-cache hit rate and TTFT, cache on vs off.

Each part runs its settings as engine-cores started here, rounds alternating their order; the
tables give medians over rounds. Greedy decoding, answers end at <|im_end|> or --max-tokens.

    python scripts/bench_real_model.py --parts spec,structured,prefix --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from evenflow.bench.engine_proc import EngineProc
from evenflow.bench.real_text import CHAT_TURNS, SCHEMAS, conversation, copy_prompts, schema_prompts
from evenflow.frontend.real_demo import fetch_demo_gguf
from evenflow.frontend.tokenizer import Tokenizer
from evenflow.protocol import SamplingParams, StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
BASE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "1024", "--num-kv-blocks", "256",
              "--max-num-batched-tokens", "512", "--max-num-seqs", "16"]


def greedy(max_tokens: int, structured: StructuredOutputsParams | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=structured)


async def start(model: str, workdir: Path, settings: dict[str, list[str]]) -> dict[str, EngineProc]:
    engines = {name: EngineProc(model, workdir, name, BASE_FLAGS + flags) for name, flags in settings.items()}
    for engine in engines.values():
        await engine.start()
    return engines


def orders(names: list[str], rounds: int) -> list[list[str]]:
    return [names if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


async def part_spec(model: str, tok: Tokenizer, args: argparse.Namespace, workdir: Path) -> str:
    prompts = copy_prompts(tok)
    engines = await start(model, workdir, {"off": [], "ngram": ["--speculative-config", json.dumps(SPEC)]})
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        for r, order in enumerate(orders(list(engines), args.rounds)):
            for conc in ("1", "8", "sat"):
                chosen = prompts[:: 3] if conc == "1" else prompts  # fewer requests where they run one by one
                requests = [(p.ids, greedy(args.max_tokens)) for p in chosen]
                for name in order:
                    before = await engines[name].stats()
                    batch = await engines[name].run(requests, len(requests) if conc == "sat" else int(conc))
                    after = await engines[name].stats()
                    drafted = after.spec_decode.num_draft_tokens - before.spec_decode.num_draft_tokens
                    accepted = after.spec_decode.num_accepted_tokens - before.spec_decode.num_accepted_tokens
                    acceptance = accepted / drafted if drafted else 0.0
                    rows.setdefault((conc, name), []).append((batch.tok_per_s, acceptance))
                    print(f"spec round {r} c={conc:>3} {name:>5}: {batch.tok_per_s:6.1f} tok/s, "
                          f"acceptance {acceptance:.2f} ({batch.output_tokens} tokens)", flush=True)
    finally:
        for engine in engines.values():
            await engine.close()
    lines = ["| concurrency | speculation | output tok/s | vs off | acceptance |", "|---|---|---:|---:|---:|"]
    for conc in ("1", "8", "sat"):
        off = statistics.median(t for t, _ in rows[(conc, "off")])
        for name in engines:
            tps = statistics.median(t for t, _ in rows[(conc, name)])
            acc = statistics.median(a for _, a in rows[(conc, name)])
            lines.append(f"| {conc} | {name} | {tps:.1f} | {tps / off:.2f}x | {acc:.2f} |")
    return "\n".join(lines)


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def part_structured(model: str, tok: Tokenizer, args: argparse.Namespace, workdir: Path) -> str:
    prompts = schema_prompts(tok)
    engines = await start(model, workdir, {"engine": []})
    engine = engines["engine"]
    cells: dict[str, list[tuple[float, float, float]]] = {}  # (tok/s, valid share, share cut at max_tokens)
    try:
        for r, order in enumerate(orders(["free", "schema"], args.rounds)):
            for mode in order:
                requests = [(p.ids, greedy(args.max_tokens, None if mode == "free" else
                                           StructuredOutputsParams(json=json.dumps(SCHEMAS[p.schema]))))
                            for p in prompts]
                batch = await engine.run(requests, len(requests))
                texts = [tok.decode(res.token_ids) for res in batch.results]
                rate = sum(valid(t, SCHEMAS[p.schema]) for t, p in zip(texts, prompts)) / len(prompts)
                cut = sum(res.token_ids[-1:] != [tok.eos_token_id] for res in batch.results) / len(prompts)
                cells.setdefault(mode, []).append((batch.tok_per_s, rate, cut))
                print(f"structured round {r} {mode:>6}: {batch.tok_per_s:6.1f} tok/s, valid {rate:.2f}, "
                      f"cut at max_tokens {cut:.2f}", flush=True)
                if r == 0 and mode == "schema":
                    print("  e.g. " + texts[0].replace("\n", " ")[:160], flush=True)
    finally:
        await engine.close()
    free = statistics.median(c[0] for c in cells["free"])
    lines = ["| output | output tok/s | vs free text | valid against the schema | cut at max_tokens |",
             "|---|---:|---:|---:|---:|"]
    for mode, label in (("free", "free text"), ("schema", "JSON schema")):
        tps, rate, cut = (statistics.median(c[i] for c in cells[mode]) for i in range(3))
        lines.append(f"| {label} | {tps:.1f} | {tps / free:.2f}x | {rate:.0%} | {cut:.0%} |")
    return "\n".join(lines)


async def part_prefix(model: str, tok: Tokenizer, args: argparse.Namespace, workdir: Path) -> str:
    engines = await start(model, workdir, {"cache on": [], "cache off": ["--no-enable-prefix-caching"]})
    ttfts: dict[str, list[float]] = {name: [] for name in engines}
    hits: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for r, order in enumerate(orders(list(engines), args.rounds)):
            for name in order:
                engine = engines[name]
                before = await engine.stats()
                answers: list[list[str]] = [[] for _ in CHAT_TURNS]
                turn_ttfts: list[float] = []
                for turn in range(len(CHAT_TURNS[0])):
                    requests = [(conversation(tok, chat[: turn + 1], answers[i]), greedy(args.max_tokens // 2))
                                for i, chat in enumerate(CHAT_TURNS)]
                    batch = await engine.run(requests, len(requests))
                    for i, res in enumerate(batch.results):
                        answers[i].append(tok.decode(res.token_ids))
                    turn_ttfts += [res.ttft_s for res in batch.results if turn > 0]  # later turns can hit
                after = await engine.stats()
                queries = after.kv_cache.prefix_cache_queries - before.kv_cache.prefix_cache_queries
                hit_tokens = after.kv_cache.prefix_cache_hits - before.kv_cache.prefix_cache_hits
                rate = hit_tokens / queries if queries else 0.0
                ttfts[name].append(statistics.median(turn_ttfts))
                hits[name].append(rate)
                print(f"prefix round {r} {name:>9}: TTFT p50 {ttfts[name][-1] * 1e3:6.1f} ms (turns 2-3), "
                      f"hit rate {rate:.2f}", flush=True)
    finally:
        for engine in engines.values():
            await engine.close()
    off = statistics.median(ttfts["cache off"])
    lines = ["| prefix cache | hit rate (tokens) | TTFT p50, turns 2-3 | vs off |", "|---|---:|---:|---:|"]
    for name in engines:
        t = statistics.median(ttfts[name])
        lines.append(f"| {name.split()[1]} | {statistics.median(hits[name]):.0%} | {t * 1e3:.0f} ms | {t / off:.2f}x |")
    return "\n".join(lines)


PARTS = {"spec": part_spec, "structured": part_structured, "prefix": part_prefix}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the demo model)")
    p.add_argument("--parts", default="spec,structured,prefix")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args(argv)
    model = args.model or str(fetch_demo_gguf())
    tok = Tokenizer.from_dir(model)
    tables = []
    with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp:
        for part in args.parts.split(","):
            tables.append(f"### {part}\n\n" + asyncio.run(PARTS[part](model, tok, args, Path(tmp))))
    print(f"\nmodel {model}, {args.rounds} rounds, max_tokens {args.max_tokens}\n")
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())

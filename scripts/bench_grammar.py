"""Pick a structured-output library by measurement: llguidance vs xgrammar vs outlines-core.

For each library and tokenizer (the demo model's 8k BPE, and a 32k BPE trained the same way,
offline), it reports:

* compile time of a few realistic JSON schemas and a regex (cold: a fresh compiler each time,
  so no cache of the library's own helps);
* per-step mask time at batch 8 and 64: every request walks its own valid JSON document token by
  token, and each step the masks of the whole batch are filled (then each consumes its token).

    python scripts/bench_grammar.py [--libs llguidance,xgrammar,outlines] [--steps 40]

Numbers are medians over the steps (mask) or over ``--rounds`` compiles of each schema, after one
throwaway compile that absorbs first-use costs. Outlines-core compiles a schema to a regex and then
a token-level index over the whole vocabulary, which takes long for nested schemas.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                                   "price": {"type": "number"}},
                    "required": ["sku", "qty", "price"],
                    "additionalProperties": False,
                },
                "minItems": 1,
            },
            "status": {"enum": ["new", "paid", "shipped"]},
            "note": {"type": ["string", "null"]},
        },
        "required": ["id", "items", "status"],
        "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["search", "calculator", "weather"]},
            "arguments": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 200},
                    "location": {"type": "object", "properties": {"city": {"type": "string"},
                                                                    "country": {"type": "string"}},
                                 "required": ["city"], "additionalProperties": False},
                    "units": {"enum": ["metric", "imperial"]},
                },
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}
DOCS: dict[str, str] = {
    "person": '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}',
    "order": '{"id": "ABC-1234", "items": [{"sku": "pen", "qty": 2, "price": 1.5}, {"sku": "ink", "qty": 1, '
             '"price": 7.25}], "status": "paid", "note": null}',
    "tool_call": '{"name": "weather", "arguments": {"location": {"city": "Paris", "country": "FR"}, '
                 '"units": "metric"}}',
}
REGEX = r"(\+\d{1,3} )?\(?\d{3}\)?[ -]?\d{3}-\d{4}"


@dataclass
class Tok:
    name: str
    path: Path  # tokenizer.json
    vocab_size: int
    eos: int


def make_tokenizers(tmp: Path) -> list[Tok]:
    from evenflow.frontend.demo_model import EOS_ID, ensure_demo_model, train_tokenizer

    demo = ensure_demo_model()
    toks = [Tok("demo-8k", demo / "tokenizer.json", 0, EOS_ID)]
    big = tmp / "tok32k.json"
    train_tokenizer(32000).save(str(big))
    toks.append(Tok("bpe-32k", big, 0, EOS_ID))
    from tokenizers import Tokenizer

    for t in toks:
        t.vocab_size = Tokenizer.from_file(str(t.path)).get_vocab_size(with_added_tokens=True)
    return toks


class Lib:
    """One library behind three calls: compile a schema/regex, new matchers, one batched step."""

    name = ""

    def __init__(self, tok: Tok) -> None: ...
    def compile(self, kind: str, spec: str) -> Any: ...
    def matchers(self, compiled: Any, n: int) -> list[Any]: ...
    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None: ...
    def consume(self, matcher: Any, token: int) -> None: ...


class LLGuidance(Lib):
    name = "llguidance"

    def __init__(self, tok: Tok) -> None:
        import llguidance

        self.ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tok.path.read_text(), eos_token=tok.eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, kind: str, spec: str) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(spec) if kind == "json" else \
            self.ll.LLMatcher.grammar_from_regex(spec)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)  # construction is the compile
        mask = np.zeros((1, (self.tokenizer.vocab_size + 31) // 32), dtype=np.int32)
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(matcher, mask)  # llguidance builds lexer states lazily: count the first mask
        return matcher

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        # As the engine does: each request deep-copies the cached template matcher, so lexer
        # states built lazily for one request serve the next (fresh matchers are ~10x slower at b64).
        return [compiled.deep_copy() for _ in range(n)]

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        from llguidance.numpy import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def consume(self, matcher: Any, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class LLGuidanceSequential(LLGuidance):
    """llguidance filling the rows one by one on the calling thread (no executor threads)."""

    name = "llguidance (sequential)"

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        for i, m in enumerate(matchers):
            fill_next_token_bitmask(m, bitmask, i)


class XGrammar(Lib):
    name = "xgrammar"

    def __init__(self, tok: Tok) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xg = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tok.path), eos_token="</s>")
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size, stop_token_ids=[tok.eos])

    def compile(self, kind: str, spec: str) -> Any:
        compiler = self.xg.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(spec) if kind == "json" else compiler.compile_regex(spec)

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.xg.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        import torch

        t = torch.from_numpy(bitmask)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(t, i)

    def consume(self, matcher: Any, token: int) -> None:
        assert matcher.accept_token(token)


class Outlines(Lib):
    name = "outlines-core"

    def __init__(self, tok: Tok) -> None:
        import outlines_core
        from tokenizers import Tokenizer

        self.oc = outlines_core
        t = Tokenizer.from_file(str(tok.path))
        vocab: dict[str, list[int]] = {}
        byte_decoder = _byte_level_decoder()
        for token, token_id in t.get_vocab(with_added_tokens=False).items():
            if token_id == tok.eos:
                continue
            raw = bytes(byte_decoder[c] for c in token)
            vocab.setdefault(raw.decode("latin-1"), []).append(token_id)
        self.vocab = outlines_core.Vocabulary(tok.eos, {k.encode("latin-1"): v for k, v in vocab.items()})

    def compile(self, kind: str, spec: str) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(spec) if kind == "json" else spec
        return self.oc.Index(regex, self.vocab)

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.oc.Guide(compiled) for _ in range(n)]

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        for i, g in enumerate(matchers):
            row = bitmask[i]
            g.write_mask_into(row.ctypes.data, row.size, 4)

    def consume(self, matcher: Any, token: int) -> None:
        matcher.advance(token)


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench(lib: Lib, tok: Tok, batches: list[int], steps: int, rounds: int) -> dict[str, float]:
    from tokenizers import Tokenizer

    encoder = Tokenizer.from_file(str(tok.path))
    row: dict[str, float] = {}
    compiled = {}
    lib.compile("json", json.dumps({"type": "object"}))  # first-use costs (lazy tables) are not a schema's
    for name, schema in SCHEMAS.items():
        runs = [timed(lambda: lib.compile("json", json.dumps(schema))) for _ in range(rounds)]
        compiled[name] = runs[0][1]
        row[f"compile {name} ms"] = statistics.median(dt for dt, _ in runs) * 1e3
    row["compile regex ms"] = statistics.median(timed(lambda: lib.compile("regex", REGEX))[0]
                                                for _ in range(rounds)) * 1e3
    names = list(SCHEMAS)
    for batch in batches:
        # Request i follows schema i % 3 and is shifted by i tokens, so the batch is at mixed depths.
        matchers = lib.matchers(compiled[names[0]], 0)
        docs = []
        for i in range(batch):
            name = names[i % len(names)]
            matchers += lib.matchers(compiled[name], 1)
            docs.append(encoder.encode(DOCS[name], add_special_tokens=False).ids)
        positions = [0] * batch
        bitmask = np.zeros((batch, (tok.vocab_size + 31) // 32), dtype=np.int32)
        times = []
        for _ in range(steps):
            dt, _ = timed(lambda: lib.fill(matchers, bitmask))
            times.append(dt)
            for i, m in enumerate(matchers):
                if positions[i] < len(docs[i]):
                    lib.consume(m, docs[i][positions[i]])
                    positions[i] += 1
                else:  # at the end: start a fresh walk so every step keeps a full batch
                    matchers[i] = lib.matchers(compiled[names[i % len(names)]], 1)[0]
                    positions[i] = 0
        row[f"mask b{batch} ms"] = statistics.median(times) * 1e3
    return row


def bench_apply(vocab_sizes: list[int], batches: list[int], steps: int) -> None:
    """The worker's side: applying a batch of bitmasks to float32 logits (one torch thread, as a
    worker step's sampling runs), random masks; softmax over the same logits for scale."""
    import torch

    from evenflow.protocol import SchedulerOutput
    from evenflow.worker.grammar_mask import apply_grammar_bitmask

    torch.set_num_threads(1)
    print("| vocab | batch | apply bitmask ms | softmax ms (scale) |\n|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for vocab in vocab_sizes:
        for batch in batches:
            ids = [f"r{i}" for i in range(batch)]
            words = rng.integers(-2**31, 2**31 - 1, size=(batch, (vocab + 31) // 32), dtype=np.int64)
            so = SchedulerOutput(0, [], [], {}, 0, structured_output_req_ids=ids,
                                 grammar_bitmask=words.astype("<i4").tobytes())
            logits = torch.randn(batch, vocab)
            # Interleaved, so a burst of load on this shared machine hits both columns alike.
            pairs = [(timed(lambda: apply_grammar_bitmask(logits, ids, so, vocab))[0],
                      timed(lambda: logits.softmax(-1))[0]) for _ in range(steps)]
            apply_s = statistics.median(p[0] for p in pairs)
            softmax_s = statistics.median(p[1] for p in pairs)
            print(f"| {vocab} | {batch} | {apply_s * 1e3:.2f} | {softmax_s * 1e3:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--libs", default="llguidance,xgrammar,outlines")
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3, help="compiles per schema (median reported)")
    ap.add_argument("--apply", action="store_true", help="only time the worker applying bitmasks")
    args = ap.parse_args()
    if args.apply:
        bench_apply([8192, 32000], [int(b) for b in args.batches.split(",")], args.steps)
        return
    libs = {"llguidance": LLGuidance, "llguidance-seq": LLGuidanceSequential, "xgrammar": XGrammar,
            "outlines": Outlines}
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        toks = make_tokenizers(Path(tmp))
        rows = []
        for tok in toks:
            for lib_name in args.libs.split(","):
                try:
                    dt, lib = timed(lambda: libs[lib_name](tok))
                except ImportError as e:  # pip install 'evenflow[grammar-bench]' brings all three
                    print(f"# {lib_name}: skipped ({e})", flush=True)
                    continue
                row = {"tokenizer init ms": dt * 1e3, **bench(lib, tok, batches, args.steps, args.rounds)}
                rows.append((tok.name, lib.name, row))
                print(f"# {tok.name} {lib.name}: done", flush=True)
    cols = list(rows[0][2])
    print("| tokenizer | library | " + " | ".join(cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    for tok_name, lib_name, row in rows:
        print(f"| {tok_name} (V={next(t.vocab_size for t in toks if t.name == tok_name)}) | {lib_name} | "
              + " | ".join(f"{row[c]:.2f}" for c in cols) + " |")


if __name__ == "__main__":
    main()

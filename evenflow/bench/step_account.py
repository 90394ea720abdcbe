"""Where a served worker's time went, by what its steps carried (a recording of ``$EVENFLOW_STEP_RECORD``).

Each recorded step is sorted by its load: decodes only; a long prompt's work (one whose prompt has more than
``long_tokens`` tokens), as a token chunk or as a layer group; and how many short prompts rode in it. Per
kind: the steps, their summed wall time, the decode tokens they sampled and the prompt tokens they
prefilled (a layer group's tokens are left out: they come once per group). The fixed budget and the
adaptive one spend the same machine differently; this says on what (docs/results/steadiness.md, set 98).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from evenflow.protocol import EngineToWorker, SchedulerOutput
from evenflow.worker.step_record import read_frames, read_steps


@dataclass
class KindTotal:
    kind: str
    steps: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0
    prompt_tokens: int = 0


def prompt_tokens(so: SchedulerOutput, prompt_lens: dict[str, int]) -> dict[str, int]:
    """The prompt tokens each request of the step prefills (0: it decodes), by the tokens computed before the
    step that its scheduling carried: a prompt's last single token is prompt work, a decode with drafts is
    not. A layer group counts all its chunk's tokens; a request whose computed tokens the step did not carry
    counts as a prompt when it was scheduled more than one token."""
    computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
    computed.update((cached.req_id, cached.num_computed_tokens) for cached in so.scheduled_cached_reqs)
    out = {}
    for r, n in so.num_scheduled_tokens.items():
        done = computed.get(r)
        if r in so.layer_spans:
            out[r] = n
        elif done is None or r not in prompt_lens:
            out[r] = n if n > 1 else 0
        else:
            out[r] = max(0, min(n, prompt_lens[r] - done))
    return out


def kind_of(so: SchedulerOutput, prompt_lens: dict[str, int], long_tokens: int) -> str:
    """``decode only``, or the long prompt's part (``long chunk``, ``long layers``) and the short
    prompts beside it (``+ 1 short`` ... ``+ 3+ short``)."""
    prompts = [r for r, n in prompt_tokens(so, prompt_lens).items() if n > 0]
    long_ = [r for r in prompts if prompt_lens.get(r, 0) > long_tokens]
    short = len(prompts) - len(long_)
    parts = []
    if long_:
        parts.append("long layers" if any(r in so.layer_spans for r in long_) else "long chunk")
    if short:
        parts.append(f"{short if short < 3 else '3+'} short")
    return " + ".join(parts) if parts else "decode only"


def account(prefix: Path, long_tokens: int) -> list[KindTotal]:
    """The recording's steps summed by kind, the costliest kind first (empty steps left out)."""
    decode = msgspec.msgpack.Decoder(EngineToWorker).decode
    prompt_lens: dict[str, int] = {}
    kinds: dict[int, tuple[str, int, int]] = {}  # step_id -> kind, decode tokens, prompt tokens
    for frame in read_frames(prefix):
        so = decode(frame)
        if not isinstance(so, SchedulerOutput):
            continue
        prompt_lens.update((new.req_id, len(new.prompt_token_ids)) for new in so.scheduled_new_reqs)
        prompt = prompt_tokens(so, prompt_lens)
        decodes = sum(1 for n in prompt.values() if n == 0)
        prefilled = sum(n for r, n in prompt.items() if r not in so.layer_spans)
        kinds[so.step_id] = (kind_of(so, prompt_lens, long_tokens), decodes, prefilled)
    totals: dict[str, KindTotal] = {}
    for timing in read_steps(prefix):
        if timing.step_id not in kinds or timing.num_tokens == 0:
            continue
        kind, decodes, prompt = kinds[timing.step_id]
        total = totals.setdefault(kind, KindTotal(kind))
        total.steps += 1
        total.seconds += timing.wall_s
        total.decode_tokens += decodes
        total.prompt_tokens += prompt
    return sorted(totals.values(), key=lambda t: -t.seconds)


def format_account(rows: list[KindTotal]) -> str:
    lines = ["| kind | steps | seconds | ms a step | decode tokens | prompt tokens |", "|---|--:|--:|--:|--:|--:|"]
    lines += [f"| {r.kind} | {r.steps} | {r.seconds:.1f} | {1e3 * r.seconds / r.steps:.1f} | {r.decode_tokens} | "
              f"{r.prompt_tokens} |" for r in rows]
    seconds = sum(r.seconds for r in rows)
    lines.append(f"| all | {sum(r.steps for r in rows)} | {seconds:.1f} | | {sum(r.decode_tokens for r in rows)} | "
                 f"{sum(r.prompt_tokens for r in rows)} |")
    return "\n".join(lines)

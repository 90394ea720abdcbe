"""A deterministic fake model and worker for driving the scheduler without tensors.

The fake worker keeps what a real worker keeps (per request: its tokens, block table and
progress, updated from SchedulerOutput deltas) and a fake KV cache that stores, in each physical
slot, the token written there. Every step it checks that the context it attends to, read back
through the block table, is exactly the request's sequence: a wrong prefix hit, a block freed too
early or shared by mistake shows up at once. The next token is a fixed function of the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from evenflow.protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput

VOCAB_SIZE = 50
EOS_TOKEN_ID = 0


def next_token(sequence: Sequence[int]) -> int:
    """The fake model: a fixed function of the whole sequence so far."""
    value = 17
    for token in sequence:
        value = (value * 1_000_003 + token + 1) % 2_305_843_009_213_693_951
    return value % VOCAB_SIZE


@dataclass
class ReferenceResult:
    token_ids: list[int]
    finish_reason: str


def reference_generate(
    prompt: Sequence[int], params: SamplingParams, eos_token_ids: Sequence[int], max_model_len: int
) -> ReferenceResult:
    """What a request produces alone, with the stop rules written out independently."""
    sequence = list(prompt)
    output: list[int] = []
    while True:
        token = next_token(sequence)
        sequence.append(token)
        output.append(token)
        if len(output) >= params.min_tokens:
            if token in params.stop_token_ids:
                return ReferenceResult(output, "stop")
            if not params.ignore_eos and token in eos_token_ids:
                return ReferenceResult(output, "stop")
        if len(output) >= params.max_tokens or len(sequence) >= max_model_len:
            return ReferenceResult(output, "length")


def fake_drafts(sequence: Sequence[int], k: int) -> list[int]:
    """A fake proposer: the true continuation for a length that varies with the sequence, then
    (if shorter than k) one wrong token, so that every accepted length 0..k occurs."""
    num_right = next_token([*sequence, 7]) % (k + 2) if k else 0
    drafts: list[int] = []
    for _ in range(min(num_right, k)):
        drafts.append(next_token([*sequence, *drafts]))
    if len(drafts) < k and num_right <= k:
        drafts.append((next_token([*sequence, *drafts]) + 1) % VOCAB_SIZE)
    return drafts


class FakeWorker:
    """Executes SchedulerOutputs in order, like a worker with a persistent batch.

    With ``draft_k`` it also drafts like the real worker: after each sample it proposes up to
    ``draft_k`` tokens, fills the draft slots the scheduler reserved with them, and verifies
    them against the fake model (accepted while equal, then the model's own token).
    """

    def __init__(self, num_blocks: int, block_size: int, draft_k: int = 0) -> None:
        self.draft_k = draft_k
        self.drafts: dict[str, list[int]] = {}
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tokens: dict[str, list[int]] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in output.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.block_tables.pop(req_id, None)
            self.num_computed.pop(req_id, None)
        for req_id in output.preempted_req_ids:
            self.block_tables.pop(req_id)  # tokens are kept: it comes back resumed
            self.num_computed.pop(req_id)
        for new in output.scheduled_new_reqs:
            assert new.req_id not in self.tokens, f"{new.req_id} sent as new twice"
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.block_tables[new.req_id] = list(new.block_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
        for cached in output.scheduled_cached_reqs:
            if cached.resumed_from_preemption:
                assert cached.req_id not in self.block_tables, f"{cached.req_id} resumed while running"
                self.block_tables[cached.req_id] = list(cached.new_block_ids)
            else:
                self.block_tables[cached.req_id].extend(cached.new_block_ids)
                # With drafts the scheduler may not have seen the last step's rejections yet.
                if self.draft_k:
                    assert self.num_computed[cached.req_id] <= cached.num_computed_tokens, cached
                else:
                    assert self.num_computed[cached.req_id] == cached.num_computed_tokens, cached
            self.num_computed[cached.req_id] = min(cached.num_computed_tokens, len(self.tokens[cached.req_id]) - 1)
            if cached.resumed_from_preemption:
                self.drafts.pop(cached.req_id, None)

        req_ids: list[str] = []
        sampled: list[list[int]] = []
        verified: list[int] = []
        proposals: list[list[int]] = []
        for req_id, num_new in output.num_scheduled_tokens.items():
            tokens = self.tokens[req_id]
            num_slots = output.num_draft_slots.get(req_id, 0)
            drafts = self.drafts.get(req_id, [])[:num_slots]
            start = self.num_computed[req_id]
            end = start + num_new - num_slots
            assert end <= len(tokens), f"{req_id}: scheduled up to {end}, worker knows {len(tokens)} tokens"
            assert not num_slots or end == len(tokens), f"{req_id}: draft slots on a chunk that does not sample"
            sequence = tokens + drafts if end == len(tokens) else tokens
            for position in range(start, end + len(drafts)):
                self._slot_write(req_id, position, sequence[position])
            context = [self._slot_read(req_id, position) for position in range(end + len(drafts))]
            assert context == sequence[: end + len(drafts)], f"{req_id}: KV content differs from its tokens"
            self.num_computed[req_id] = end
            req_ids.append(req_id)
            verified.append(len(drafts))
            if end == len(tokens):
                emitted = [next_token(tokens)]
                for draft in drafts:
                    if draft != emitted[-1]:
                        break
                    emitted.append(next_token([*tokens, *emitted]))
                tokens.extend(emitted)
                self.num_computed[req_id] = len(tokens) - 1
                self.drafts[req_id] = fake_drafts(tokens, self.draft_k)
                sampled.append(emitted)
            else:
                sampled.append([])
            proposals.append(self.drafts.get(req_id, []) if sampled[-1] else [])
        if not self.draft_k:
            return ModelRunnerOutput(output.step_id, req_ids, sampled)
        return ModelRunnerOutput(output.step_id, req_ids, sampled, num_proposed_drafts=[len(p) for p in proposals],
                                 num_draft_tokens=verified)

    def _slot(self, req_id: str, position: int) -> tuple[int, int]:
        table = self.block_tables[req_id]
        assert position // self.block_size < len(table), f"{req_id}: no block for position {position}"
        return table[position // self.block_size], position % self.block_size

    def _slot_write(self, req_id: str, position: int, token: int) -> None:
        block_id, offset = self._slot(req_id, position)
        self.kv[block_id][offset] = token

    def _slot_read(self, req_id: str, position: int) -> int | None:
        block_id, offset = self._slot(req_id, position)
        return self.kv[block_id][offset]

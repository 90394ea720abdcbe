"""Engine-core configuration: the scheduler's knobs (defaults follow vLLM V1 online serving)."""

from __future__ import annotations

from dataclasses import dataclass

from evenflow.protocol import SpeculativeConfig

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    """Everything the scheduler and its KV cache manager need to know.

    ``num_kv_blocks`` comes from the workers (the minimum over ranks of what fits in memory).
    Chunked prefill is always on: a prompt longer than the step's token budget is cut in chunks.
    """

    num_kv_blocks: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    block_size: int = 16
    long_prefill_token_threshold: int = 0  # 0 = off; else the largest prefill chunk per step
    policy: str = "fcfs"  # or "priority": smaller value first, then arrival time
    enable_prefix_caching: bool = True
    speculative_config: SpeculativeConfig | None = None  # None: no drafts

    def validate(self) -> None:
        """Raise ValueError naming the first bad value or combination."""
        for name in ("num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0 = off), got {self.long_prefill_token_threshold}"
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        # A request that may grow to max_model_len must fit in the pool on its own; otherwise it
        # would preempt everybody and still never finish.
        blocks_per_max_len = -(-self.max_model_len // self.block_size)
        if self.num_kv_blocks < blocks_per_max_len:
            raise ValueError(
                f"num_kv_blocks={self.num_kv_blocks} x block_size={self.block_size} holds "
                f"{self.num_kv_blocks * self.block_size} tokens, fewer than max_model_len={self.max_model_len}: "
                f"lower max_model_len or give the KV cache more memory"
            )

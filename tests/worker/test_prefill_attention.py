"""The C++ prefill attention kernel (cpu_prefill.py) against float64 attention of the same bfloat16 inputs, and
against PyTorch's own bfloat16 attention's error on them: whole prompts, chunks after a cached context, partial
row tiles, GQA and MHA, head sizes 64 and 128, blocks in any order, q rows strided as the model hands them over."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from evenflow.worker.attention.cpu_prefill import PREFILL_KERNEL_MIN_ROWS, PagedPrefillKernel
from evenflow.worker.attention.torch_paged import TorchPagedAttention

from tests.worker.test_attention import check_backend


def _kernel(heads: int, hkv: int, d: int) -> PagedPrefillKernel:
    kernel = PagedPrefillKernel(heads, hkv, d, torch.bfloat16, torch.device("cpu"))
    if not kernel.available:
        pytest.skip("the prefill kernel needs AMX (and a compiler) on this CPU")
    return kernel


def _case(heads: int, hkv: int, d: int, chunks: list[tuple[int, int]], bs: int = 16, seed: int = 0):
    """Caches with every chunk's keys (its own included) at shuffled blocks; q as a slice of fused q/k/v rows."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-ctx // bs) for _, ctx in chunks]
    num_blocks = sum(blocks) + 3
    kc, vc = (torch.randn(num_blocks, bs, hkv, d, generator=g).bfloat16() for _ in range(2))
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(len(chunks), max(blocks) + 2, dtype=torch.int32)  # wider than needed, as the runner's
    for i, nb in enumerate(blocks):
        table[i, :nb] = perm[sum(blocks[:i]) : sum(blocks[:i]) + nb]
    rows = sum(n for n, _ in chunks)
    qkv = torch.randn(rows, heads + 2 * hkv, d, generator=g).bfloat16()
    return kc, vc, table, qkv[:, :heads]


def _reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ids: torch.Tensor, ctx: int,
               dtype: torch.dtype) -> torch.Tensor:
    """One chunk's attention in ``dtype`` by PyTorch: q [n, heads, D] at positions [ctx - n, ctx)."""
    n, heads, d = q.shape
    hkv = kc.shape[2]
    k = kc[ids.long()].reshape(-1, hkv, d)[:ctx].to(dtype).repeat_interleave(heads // hkv, 1).transpose(0, 1)
    v = vc[ids.long()].reshape(-1, hkv, d)[:ctx].to(dtype).repeat_interleave(heads // hkv, 1).transpose(0, 1)
    visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    o = F.scaled_dot_product_attention(q.to(dtype).transpose(0, 1), k, v, attn_mask=visible, scale=d**-0.5)
    return o.transpose(0, 1).reshape(n, heads * d)


@pytest.mark.parametrize("dims,chunks", [
    ((9, 3, 64), [(300, 300)]),  # a whole prompt: 18 full row tiles and a partial one
    ((9, 3, 64), [(1, 1), (5, 5), (17, 17), (33, 100), (2, 50), (64, 64), (100, 700)]),
    ((4, 4, 64), [(16, 16), (15, 31), (40, 1000)]),
    ((8, 2, 128), [(40, 40), (70, 1000), (3, 129)]),
    ((32, 8, 128), [(130, 130)]),
], ids=["prompt-300", "gqa3-mixed", "mha-d64", "gqa4-d128", "llama-heads-d128"])
def test_prefill_kernel_matches_float64_within_pytorchs_own_error(dims: tuple[int, int, int],
                                                                    chunks: list[tuple[int, int]]) -> None:
    heads, hkv, d = dims
    kernel = _kernel(heads, hkv, d)
    kc, vc, table, q = _case(heads, hkv, d, chunks)
    out = torch.full((q.shape[0] + 2, heads * d), 7.0, dtype=torch.bfloat16)  # two rows past the chunks
    starts = [sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    table_of_chunks = kernel.chunk_table([(starts[i], n, c, i) for i, (n, c) in enumerate(chunks)])
    kernel(q, kc, vc, table[:, : max(-(-c // 16) for _, c in chunks)], table_of_chunks, out, d**-0.5)
    assert (out[q.shape[0]:] == 7.0).all()
    for i, (n, ctx) in enumerate(chunks):
        rows = slice(starts[i], starts[i] + n)
        exact = _reference(q[rows], kc, vc, table[i], ctx, torch.float64)
        torch_error = (_reference(q[rows], kc, vc, table[i], ctx, torch.bfloat16).double() - exact).abs().max()
        error = (out[rows].double() - exact).abs().max()
        # bfloat16 rounds the output (and P) to 2^-9 relatively; PyTorch's own error on these inputs is the scale.
        assert error <= max(2 * torch_error, 1e-2), (i, n, ctx, float(error), float(torch_error))


def test_prefill_kernel_is_not_taken_for_what_it_does_not_serve() -> None:
    """A head_dim other than 64 or 128, a float32 cache (the exact reference path): PyTorch's attention."""
    for heads, hkv, d, dtype in ((6, 2, 96, torch.bfloat16), (9, 3, 64, torch.float32)):
        assert not PagedPrefillKernel(heads, hkv, d, dtype, torch.device("cpu")).available
    plan = check_backend(TorchPagedAttention, 16, "cpu", dims=(9, 3, 64))
    assert plan.kernel_chunks is None and plan.chunks


@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
@pytest.mark.parametrize("ranges", [False, True], ids=["gathered", "ranges"])
def test_backend_sends_the_chunks_of_a_bfloat16_step_to_the_kernel(long: bool, ranges: bool) -> None:
    """A step of decodes, fresh chunks and chunks after cached context on a bfloat16 cache: the chunks of
    PREFILL_KERNEL_MIN_ROWS rows or more are one kernel call, the others PyTorch's, the decodes the decode
    kernel's, all against the float32 reference of the same rounded inputs."""
    _kernel(9, 3, 64)
    plan = check_backend(TorchPagedAttention, 16, "cpu", atol=3e-2, dtype=torch.bfloat16, long=long, ranges=ranges,
                         dims=(9, 3, 64))
    assert plan.kernel_chunks is not None
    rows = plan.kernel_chunks.chunks[:, 1].tolist()
    assert rows and min(rows) >= PREFILL_KERNEL_MIN_ROWS
    assert all(c.q_end - c.q_start < PREFILL_KERNEL_MIN_ROWS for c in plan.chunks) and plan.chunks
    # Blocks of 4 tokens split the kernel's 16-key tiles: PyTorch's attention takes the chunks.
    plan = check_backend(TorchPagedAttention, 4, "cpu", atol=3e-2, dtype=torch.bfloat16, dims=(9, 3, 64))
    assert plan.kernel_chunks is None and plan.chunks


def test_prefill_kernel_rescales_as_the_running_maximum_climbs_and_is_thread_invariant() -> None:
    """Keys whose scores grow along the context (each block's maximum passes the running one by more than the
    kernel's slack, 2^8, again and again: its rescale path) and a key far above the rest (one term dominates);
    the same bits on 1, 2 and 3 threads (each row tile is computed by one thread in one order)."""
    heads, hkv, d, n = 4, 2, 64, 200
    kernel = _kernel(heads, hkv, d)
    kc, vc, table, q = _case(heads, hkv, d, [(n, n)], seed=5)
    ids = table[0, : -(-n // 16)].long()
    keys = kc[ids].view(-1, hkv, d).float()  # the blocks' slots, past the context's end too
    ramp = torch.linspace(0.2, 12.0, len(keys))[:, None, None]  # scores up to ~60x the first keys'
    keys = keys.abs() * ramp
    keys[97] *= 3.0
    kc[ids] = keys.bfloat16().view(-1, 16, hkv, d)
    q = q.abs()  # every score grows with the ramp
    chunk = kernel.chunk_table([(0, n, n, 0)])
    outs = []
    for threads in (1, 2, 3):
        out = torch.empty(n, heads * d, dtype=torch.bfloat16)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            kernel(q, kc, vc, table, chunk, out, d**-0.5)
        finally:
            torch.set_num_threads(previous)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    exact = _reference(q, kc, vc, table[0], n, torch.float64)
    torch_error = (_reference(q, kc, vc, table[0], n, torch.bfloat16).double() - exact).abs().max()
    error = (outs[0].double() - exact).abs().max()
    assert error <= max(2 * torch_error, 1e-2), (float(error), float(torch_error))

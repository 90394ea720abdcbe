"""Attention backends against a naive per-request reference on a random paged cache: decodes of
many lengths (grouped), fresh prefill chunks, and chunks continuing a cached context, with GQA."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from evenflow.worker.attention.base import AttentionBackend, AttentionInputs
from evenflow.worker.attention.cpu_decode import PagedDecodeKernel
from evenflow.worker.attention.torch_paged import TorchPagedAttention, split_decode_groups

REPO = Path(__file__).resolve().parents[2]


SHORT_CHUNKS = ((9, 9), (5, 37), (1, 30), (16, 16))
# Contexts over several blocks even of flash-attn's 256-token pages: decodes up to 700 tokens, a
# fresh 300-token chunk, and chunks continuing 536- and 640-token contexts.
LONG_CHUNKS = ((300, 300), (64, 600), (5, 541), (16, 16))


def build_case(block_size: int, device: str, seed: int = 0, num_decodes: int = 20,
               chunks: tuple[tuple[int, int], ...] = SHORT_CHUNKS, max_decode_len: int = 90,
               dtype: torch.dtype = torch.float32, ranges: bool = False, dims: tuple[int, int, int] = (6, 2, 16)):
    """(inputs, q, k, v, caches, reference output). ``chunks``: (new tokens, context length).
    ``ranges``: each request's blocks one range of ids, in turn ascending, descending and shuffled
    (what the in-place path reads), every fourth request's drawn at random from the whole cache as
    they all are otherwise.

    Inputs and cache are drawn in float32 and rounded to ``dtype``; the reference is computed in
    float32 from the rounded values, so a backend is judged only on its own arithmetic."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    heads, hkv, d = dims
    decode_lens = np.sort(rng.integers(1, max_decode_len, num_decodes))
    q_lens = [1] * num_decodes + [n for n, _ in chunks]
    ctx_lens = list(decode_lens) + [c for _, c in chunks]
    max_blocks = -(-max(ctx_lens) // block_size)
    num_blocks = len(q_lens) * max_blocks + 3
    perm = rng.permutation(num_blocks)
    if ranges:  # the random rows from ids above every range
        num_blocks += len(q_lens) * max_blocks
        perm += len(q_lens) * max_blocks
    table = perm[: len(q_lens) * max_blocks].reshape(len(q_lens), max_blocks).astype(np.int32)
    if ranges:
        for i in range(len(q_lens)):
            used = -(-ctx_lens[i] // block_size)
            order = (np.arange(used), np.arange(used)[::-1], rng.permutation(used), None)[i % 4]
            if order is not None:  # ids i * max_blocks on are this request's alone
                table[i, :used] = i * max_blocks + order
    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).float()

    kc = draw(num_blocks, block_size, hkv, d)
    vc = draw(num_blocks, block_size, hkv, d)
    total = sum(q_lens)
    q = draw(total, heads, d)
    k = draw(total, hkv, d)
    v = draw(total, hkv, d)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    slots = []
    for i, (n, c) in enumerate(zip(q_lens, ctx_lens)):
        pos = np.arange(c - n, c)
        slots.append(table[i, pos // block_size].astype(np.int64) * block_size + pos % block_size)
    slots = np.concatenate(slots)
    # Reference: write the new K/V, then attend each query to its context, causally.
    kref, vref = kc.clone().view(-1, hkv, d), vc.clone().view(-1, hkv, d)
    kref[torch.from_numpy(slots)] = k
    vref[torch.from_numpy(slots)] = v
    ref = torch.empty(total, heads * d)
    for i, (n, c) in enumerate(zip(q_lens, ctx_lens)):
        pos = np.arange(c)
        ctx_slots = torch.from_numpy(table[i, pos // block_size].astype(np.int64) * block_size + pos % block_size)
        kk = kref[ctx_slots].repeat_interleave(heads // hkv, dim=1).transpose(0, 1)
        vv = vref[ctx_slots].repeat_interleave(heads // hkv, dim=1).transpose(0, 1)
        qq = q[qsl[i] : qsl[i + 1]].transpose(0, 1)
        scores = qq @ kk.transpose(1, 2) * d**-0.5
        allowed = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        ref[qsl[i] : qsl[i + 1]] = (scores.softmax(-1) @ vv).transpose(0, 1).reshape(n, heads * d)
    seq_lens = np.array(ctx_lens, dtype=np.int32)
    dev = torch.device(device)
    inputs = AttentionInputs(
        num_tokens=total, num_reqs=len(q_lens), num_decodes=num_decodes, max_query_len=max(q_lens),
        max_seq_len=max(ctx_lens), block_size=block_size, query_start_loc=torch.from_numpy(qsl).to(dev),
        seq_lens=torch.from_numpy(seq_lens).to(dev), block_table=torch.from_numpy(table).to(dev),
        slot_mapping=torch.from_numpy(slots).to(dev), query_start_loc_np=qsl, seq_lens_np=seq_lens,
        block_table_np=table,
    )
    caches = (kc.to(dev), vc.to(dev))
    return inputs, q.to(dev), k.to(dev), v.to(dev), caches, ref, (heads, hkv, d)


def check_backend(backend_cls: type[AttentionBackend], block_size: int, device: str, atol: float = 1e-4,
                  dtype: torch.dtype = torch.float32, long: bool = False, ranges: bool = False,
                  dims: tuple[int, int, int] = (6, 2, 16)) -> object:
    """Check the backend on one case; return its plan."""
    case = dict(chunks=LONG_CHUNKS, max_decode_len=700) if long else {}
    inputs, q, k, v, caches, ref, (heads, hkv, d) = build_case(block_size, device, dtype=dtype, ranges=ranges,
                                                               dims=dims, **case)
    backend = backend_cls(heads, hkv, d, d**-0.5, dtype)
    caches = (caches[0].to(dtype), caches[1].to(dtype))
    k, v = k.to(dtype), v.to(dtype)
    plan = backend.plan(inputs)
    out = backend.forward(q.to(dtype), k, v, caches, plan)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.float().cpu(), ref, atol=atol, rtol=atol)
    # The new K/V landed at their slots, exactly as given in the cache's dtype (a copy, no arithmetic).
    slots = inputs.slot_mapping.to(caches[0].device)
    torch.testing.assert_close(caches[0].view(-1, hkv, d)[slots], k, atol=0, rtol=0)
    torch.testing.assert_close(caches[1].view(-1, hkv, d)[slots], v, atol=0, rtol=0)
    return plan


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("long", [False, True])
def test_torch_backend_matches_reference(block_size: int, long: bool) -> None:
    check_backend(TorchPagedAttention, block_size, "cpu", long=long)


def test_reference_check_is_fair_to_half_precision() -> None:
    """bf16 on CPU through the torch backend: against a reference from the same rounded inputs,
    only the backend's own rounding remains (the old check compared with float32 originals)."""
    check_backend(TorchPagedAttention, 16, "cpu", atol=3e-2, dtype=torch.bfloat16)


@pytest.mark.parametrize("dims", [(9, 3, 64), (8, 2, 128), (4, 4, 64)], ids=["gqa3-d64", "gqa4-d128", "mha-d64"])
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
@pytest.mark.parametrize("ranges", [False, True], ids=["gathered", "ranges"])
def test_cpu_decode_kernel_matches_reference(dims: tuple[int, int, int], long: bool, ranges: bool) -> None:
    """A bfloat16 cache on CPU: the decodes go to the C++ kernel (cpu_decode.py), which reads each
    request's blocks in place, beside fresh and continuing chunks in the same step; judged against the
    float32 reference of the same rounded inputs, as PyTorch's attention is."""
    backend = TorchPagedAttention(*dims[:2], dims[2], dims[2] ** -0.5, torch.bfloat16)
    if not backend.decode_kernel.available:
        pytest.skip("the C++ decode kernel did not build here (no compiler)")
    plan = check_backend(TorchPagedAttention, 16, "cpu", atol=3e-2, dtype=torch.bfloat16, long=long, ranges=ranges,
                         dims=dims)
    assert plan.kernel_decodes is not None and not plan.decode_groups


def test_cpu_decode_kernel_reads_the_engines_layouts() -> None:
    """As a model step hands them over: q a slice of the fused q/k/v rows (row stride past its heads), the
    block table a view of a wider one, the output rows of a step with more rows after the decodes; against
    PyTorch's attention on the same rounded inputs."""
    heads, hkv, d, bs = 9, 3, 64, 16
    kernel = PagedDecodeKernel(heads, hkv, d, torch.bfloat16, torch.device("cpu"))
    if not kernel.available:
        pytest.skip("the C++ decode kernel did not build here (no compiler)")
    g = torch.Generator().manual_seed(3)
    lens = torch.tensor([1, 17, 130, 300], dtype=torch.int32)
    table = torch.randperm(200, generator=g)[:4 * 40].view(4, 40).to(torch.int32)
    kc, vc = (torch.randn(200, bs, hkv, d, generator=g).bfloat16() for _ in range(2))
    qkv = torch.randn(4, heads + 2 * hkv, d, generator=g).bfloat16()
    out = torch.full((6, heads * d), 7.0, dtype=torch.bfloat16)  # two more rows: a chunk's, left alone
    kernel(qkv[:, :heads], kc, vc, table[:, :20], lens, out, d**-0.5)
    for r, n in enumerate(lens.tolist()):
        ids = table[r, : -(-n // bs)].long()
        k = kc.index_select(0, ids).view(-1, hkv, d)[:n].transpose(0, 1)
        v = vc.index_select(0, ids).view(-1, hkv, d)[:n].transpose(0, 1)
        q = qkv[r, :heads].view(hkv, heads // hkv, d)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=d**-0.5)
        torch.testing.assert_close(out[r].float(), ref.reshape(-1), atol=1e-2, rtol=1e-2)
    assert (out[4:] == 7.0).all()


@pytest.mark.parametrize("lens", [[2600], [1100, 3], [5000, 700, 0]], ids=["one", "long-and-short", "with-empty"])
def test_cpu_decode_kernel_splits_few_long_contexts(lens: list[int]) -> None:
    """Few (request, KV head) pairs with long contexts: each context in parts, one thread a part, the parts'
    softmax sums rescaled to the largest score; a request's parts may be empty (a short context) and a
    request with no keys gives zeros. Against PyTorch's attention on the same rounded inputs."""
    heads, hkv, d, bs = 9, 3, 64, 16
    kernel = PagedDecodeKernel(heads, hkv, d, torch.bfloat16, torch.device("cpu"))
    if not kernel.available:
        pytest.skip("the C++ decode kernel did not build here (no compiler)")
    g = torch.Generator().manual_seed(len(lens))
    rows, per_row = len(lens), -(-max(lens) // bs)
    table = torch.randperm(rows * per_row + 5, generator=g)[: rows * per_row].view(rows, per_row).to(torch.int32)
    kc, vc = (torch.randn(rows * per_row + 5, bs, hkv, d, generator=g).bfloat16() for _ in range(2))
    kc[:, :, 0] *= 4  # one KV head's scores spread wide: a part's largest score far from another's
    q = torch.randn(rows, heads, d, generator=g).bfloat16()
    out = torch.full((rows, heads * d), 7.0, dtype=torch.bfloat16)
    kernel(q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), out, d**-0.5)
    prior, alone = torch.get_num_threads(), torch.empty_like(out)
    try:  # the parts are fixed by the contexts, not the threads: the same bits on one thread
        torch.set_num_threads(1)
        kernel(q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), alone, d**-0.5)
    finally:
        torch.set_num_threads(prior)
    assert torch.equal(alone, out)
    for r, n in enumerate(lens):
        if n == 0:
            assert (out[r] == 0).all()
            continue
        ids = table[r, : -(-n // bs)].long()
        k = kc.index_select(0, ids).view(-1, hkv, d)[:n].transpose(0, 1)
        v = vc.index_select(0, ids).view(-1, hkv, d)[:n].transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(q[r].view(hkv, heads // hkv, d).float(), k.float(),
                                                               v.float(), scale=d**-0.5)
        torch.testing.assert_close(out[r].float(), ref.reshape(-1), atol=1e-2, rtol=1e-2)


def test_cpu_decode_kernel_is_not_taken_for_heads_it_does_not_serve() -> None:
    """More than 16 query heads a KV head, a head_dim other than 64 or 128, a float32 cache: PyTorch's attention."""
    for heads, hkv, d, dtype in ((34, 2, 64, torch.bfloat16), (6, 2, 96, torch.bfloat16), (9, 3, 64, torch.float32)):
        assert not PagedDecodeKernel(heads, hkv, d, dtype, torch.device("cpu")).available


def test_cpu_decode_kernel_stays_off_the_float32_reference_path() -> None:
    plan = check_backend(TorchPagedAttention, 16, "cpu", dims=(9, 3, 64))
    assert plan.kernel_decodes is None and plan.decode_groups


def test_torch_backend_uses_the_fused_cpu_kernel_for_every_shape() -> None:
    """Decodes, fresh chunks and chunks over a cached context all reach PyTorch's fused CPU
    attention kernel; the unfused "math" fallback (taken for unbatched inputs with a mask) is ~2x
    slower on a long chunk and would set the p99 inter-token latency."""
    from torch.profiler import profile

    inputs, q, k, v, caches, _, (heads, hkv, d) = build_case(16, "cpu")
    backend = TorchPagedAttention(heads, hkv, d, d**-0.5)
    plan = backend.plan(inputs)
    with profile() as prof:
        backend.forward(q, k, v, caches, plan)
    names = [e.name for e in prof.events()]
    assert "aten::_scaled_dot_product_attention_math" not in names
    # A chunk over a cached context is two calls (the context, unmasked; its own tokens, causal).
    split = sum(c.block_ids is not None for c in plan.chunks)
    assert split and not any(c.mask is not None for c in plan.chunks)  # no [q, context] mask on CPU
    assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu") == len(plan.decode_groups) + len(
        plan.chunks) + split


def test_decode_groups_are_contiguous_and_bounded() -> None:
    lens = np.sort(np.random.default_rng(1).integers(128, 640, 64))
    groups = split_decode_groups(lens, 16, 2048)
    assert groups[0][0] == 0 and groups[-1][1] == 64
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(groups, groups[1:]))
    assert 1 < len(groups) < 64
    assert split_decode_groups(np.array([5, 6, 7]), 16, 2048) == [(0, 3)]
    assert split_decode_groups(np.array([10**6]), 16, 2048) == [(0, 1)]


def _run_triton_interpreted() -> None:
    from evenflow.worker.attention.triton_paged import TritonPagedAttention

    check_backend(TritonPagedAttention, 16, "cpu")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_in_interpreter_mode() -> None:
    """The Triton kernel on CPU tensors through TRITON_INTERPRET=1 (a fresh process: the flag is
    read when triton is imported)."""
    code = "from tests.worker.test_attention import _run_triton_interpreted as f; f()"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def cuda(test):  # noqa: ANN001, ANN201  (a decorator: the `cuda` marker, skipped without a device)
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


HALF_ATOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_triton_backend_on_cuda(dtype: torch.dtype, long: bool) -> None:
    from evenflow.worker.attention.triton_paged import TritonPagedAttention

    # float32 runs tl.dot in ieee precision; tf32 would need a looser bound.
    check_backend(TritonPagedAttention, 16, "cuda", atol=HALF_ATOL[dtype], dtype=dtype, long=long)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_torch_backend_on_cuda(dtype: torch.dtype, long: bool) -> None:
    check_backend(TorchPagedAttention, 16, "cuda", atol=HALF_ATOL[dtype], dtype=dtype, long=long)


@cuda
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_flash_backend_on_cuda(dtype: torch.dtype, long: bool) -> None:
    from evenflow.worker.attention.flash import FlashAttention

    # Long: every context spans several of flash-attn's 256-token pages.
    check_backend(FlashAttention, FlashAttention.block_size_for(16), "cuda", atol=HALF_ATOL[dtype], dtype=dtype,
                  long=long)


def test_selector_picks_torch_on_cpu_and_refuses_cuda_backends_there() -> None:
    from evenflow.worker.attention.selector import select_backend

    cpu = torch.device("cpu")
    assert select_backend("auto", cpu, torch.float32) is TorchPagedAttention
    assert select_backend("torch", cpu, torch.bfloat16) is TorchPagedAttention
    for name in ("flash_attn", "triton"):
        with pytest.raises(ValueError, match="CUDA"):
            select_backend(name, cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("xformers", cpu, torch.float32)


def test_torch_backend_with_many_small_decode_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    import evenflow.worker.attention.torch_paged as torch_paged

    monkeypatch.setattr(torch_paged, "GROUP_TARGET_BYTES", 4096)
    check_backend(TorchPagedAttention, 4, "cpu")


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("long", [False, True])
def test_contexts_in_one_block_range_are_read_in_place(monkeypatch: pytest.MonkeyPatch, block_size: int,
                                                       long: bool) -> None:
    """Lone decodes and chunk contexts whose blocks are one range of ids (ascending, descending,
    shuffled) are read as views of the range, with the last block's unused tail masked wherever the
    order puts it, and match the reference; contexts that are not one range are gathered."""
    import evenflow.worker.attention.torch_paged as torch_paged

    monkeypatch.setattr(torch_paged, "GROUP_TARGET_BYTES", 1)  # every decode its own group
    plan = check_backend(TorchPagedAttention, block_size, "cpu", long=long, ranges=True)
    in_place = [g for g in plan.decode_groups if g.first_block is not None]
    assert in_place and all(g.block_ids is None for g in in_place)
    assert any(g.first_block is None for g in plan.decode_groups)  # drawn from the whole cache: gathered
    split = [c for c in plan.chunks if c.first_block is not None]
    assert split and all(c.block_ids is None for c in split)
    if not long:  # a descending context after a partial block (masked) and an aligned one (sliced)
        assert {c.key_mask is None for c in split} == {True, False}


def test_in_place_range_masks_the_unused_tail_where_the_order_puts_it() -> None:
    from evenflow.worker.attention.torch_paged import in_place_range

    assert in_place_range(np.array([7, 9, 8]), 10, 4)[0] == 7  # a range, shuffled
    first, visible = in_place_range(np.array([5, 6, 7]), 10, 4)
    assert first == 5 and visible.tolist() == [True] * 10 + [False] * 2  # ascending: the first 10 slots
    first, visible = in_place_range(np.array([7, 6, 5]), 10, 4)
    # block 5 holds tokens 8-9 (its slots 0-1), block 7 tokens 0-3
    assert first == 5 and visible.tolist() == [True, True, False, False] + [True] * 8
    assert in_place_range(np.array([3, 5, 6]), 10, 4) is None

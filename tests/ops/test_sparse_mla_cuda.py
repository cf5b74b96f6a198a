"""The Hopper sparse MLA kernel (csrc/cuda/sparse_mla.cu) against the float64 reference.

Runs only with a GPU (marker `gpu`). Every case draws fresh random inputs, poisons the outputs
with NaN and compares with zeroinfer.reference in float64 (computed on the GPU for speed). The
kernel multiplies bf16 operands on the tensor cores with float32 accumulation and rounds the
probabilities to bf16 for P.V, so the output is held to a bf16-level bound (1e-2 normwise per
head, 2e-2 of the largest value elementwise) and the LSE, which never goes through bf16, to 1e-4.
"""

from __future__ import annotations

import functools

import pytest
import torch

from zeroinfer import _C
from zeroinfer.ops import sparse_mla as sparse_mla_module
from zeroinfer.ops.sparse_mla import sparse_mla_attention
from zeroinfer.reference.sparse_mla import sparse_mla_attention_ref

from test_sparse_mla import D, PATTERNS, make_cache, make_indices, num_slots, random_scale

pytestmark = pytest.mark.gpu
DEV = "cuda"
HEADS = [8, 16, 32, 64, 128]
KERNEL_FORMATS = ["bf16", "fp8", "fp8raw"]


def check(out, lse, ref_out, ref_lse, what=""):
    """bf16-kernel tolerance (see the module docstring); out/lse on any device."""
    out, lse = out.double().cpu(), lse.double().cpu()
    ref_out, ref_lse = ref_out.cpu(), ref_lse.cpu()
    assert not out.isnan().any(), f"{what}: NaN left in out (an element was never written)"
    assert not lse.isnan().any(), f"{what}: NaN left in lse (an element was never written)"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"{what}: -inf LSE pattern differs"
    assert (out[empty] == 0).all(), f"{what}: heads with no valid key must output 0"
    if (~empty).any():
        o, r = out[~empty], ref_out[~empty]  # [rows, 512]
        rel = (o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)
        worst = int(rel.argmax())
        assert rel.max() < 1e-2, f"{what}: normwise error {rel.max():.3e} at valid row {worst}"
        bound = 2e-2 * r.abs().max()
        assert (o - r).abs().max() <= bound, f"{what}: max abs error {(o - r).abs().max():.3e}"
        torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{what}: lse {m}")


def run(gen, *, fmt, T, H, K, bs, pattern, sink=False, extra=None, q=None):
    """One poisoned kernel call and its reference. extra = (K2, bs2) adds an extra cache."""
    nb = max(1, (K + 2 * bs) // bs)
    cache = make_cache(gen, fmt, nb, bs)
    idx = make_indices(gen, pattern, T, K, num_slots(cache))
    if q is None:
        q = torch.randn(T, H, D, generator=gen).bfloat16()
    scale = random_scale(gen)
    kw = {}
    if sink:
        kw["attn_sink"] = (torch.randn(H, generator=gen) * 2).to(DEV)
    if extra is not None:
        K2, bs2 = extra
        cache2 = make_cache(gen, fmt, max(1, (K2 + bs2) // bs2), bs2)
        kw["extra_kv_cache"] = cache2.to(DEV)
        kw["extra_indices"] = make_indices(gen, "mixed" if pattern != "none" else "none", T, K2,
                                           num_slots(cache2)).to(DEV)
    out = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    lse = torch.full((T, H), float("nan"), device=DEV)
    args = (q.to(DEV), cache.to(DEV), idx.to(DEV), scale)
    res = sparse_mla_attention(*args, out=out, lse=lse, **kw)
    assert res[0] is out and res[1] is lse
    ref = sparse_mla_attention_ref(*args, **kw)
    what = f"fmt={fmt} T={T} H={H} K={K} bs={bs} pattern={pattern} sink={sink} extra={extra}"
    check(out, lse, *ref, what)
    return args, kw, out, lse


SHAPES = [  # T, K, block_size: split (few tokens) and unsplit, lengths off every tile size
    (1, 640, 64),
    (5, 63, 1),
    (3, 129, 16),
    (300, 200, 64),
]


@pytest.mark.parametrize("T,K,bs", SHAPES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_matches_reference(gen, fmt, H, pattern, T, K, bs):
    run(gen, fmt=fmt, T=T, H=H, K=K, bs=bs, pattern=pattern)


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.parametrize("H", [16, 64, 128])
@pytest.mark.parametrize("T,K,bs,extra", [
    (2, 128, 256, (512, 64)),   # V4-Flash decode: window in a 256-token page + 512 compressed
    (6, 128, 256, (1024, 2)),   # MTP-style 6 query tokens, C128A-like page of 2
    (4, 100, 16, (37, 4)),      # odd lengths in both lists
    (200, 128, 64, (512, 64)),  # prefill-sized batch
])
@pytest.mark.parametrize("pattern", ["window", "mixed"])
def test_sink_and_extra_cache(gen, fmt, H, T, K, bs, extra, pattern):
    run(gen, fmt=fmt, T=T, H=H, K=K, bs=bs, pattern=pattern, sink=True, extra=extra)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("K,extra", [(2048, None), (2048, (512, 64)), (1999, (1, 1))])
def test_long_lists(gen, fmt, H, K, extra):
    run(gen, fmt=fmt, T=3, H=H, K=K, bs=64, pattern="sorted", sink=True, extra=extra)


@pytest.mark.parametrize("H", [1, 3, 24, 80, 100, 192, 256])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_other_head_counts(gen, fmt, H):
    """Partial head groups, and more than two 64-head groups (192, 256) per token."""
    run(gen, fmt=fmt, T=4, H=H, K=300, bs=16, pattern="mixed", sink=True, extra=(77, 8))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("T", [1, 257])
def test_deterministic(gen, fmt, T):
    """Same inputs, same bits (split and unsplit plans): fixed-order reductions only."""
    args, kw, out, lse = run(gen, fmt=fmt, T=T, H=64, K=640, bs=64, pattern="random", sink=True)
    for _ in range(3):
        out2, lse2 = sparse_mla_attention(*args, **kw)
        assert torch.equal(out2, out) and torch.equal(lse2, lse)


def test_plan_splits_only_small_grids():
    sms = 132
    assert _C.sparse_mla_cuda_plan(1, 64, 640, sms)[0] == 10       # one token: one tile a CTA
    assert _C.sparse_mla_cuda_plan(256, 64, 640, sms)[0] == 1      # a full wave: no split
    splits, per, ws, _ = _C.sparse_mla_cuda_plan(64, 64, 640, sms)
    assert splits * per >= 10 and (splits - 1) * per < 10 and ws == splits * 64 * 64 * 514
    assert _C.sparse_mla_cuda_plan(4, 64, 0, sms)[0] == 1          # empty lists
    # Up to 16 heads over an FP8 cache: the 16-head kernel, on 64-entry tiles for grids of up to
    # one wave (of one CTA an SM; split below it) and on 32-entry tiles (two CTAs an SM) beyond;
    # forced off, the one-tile kernel (two CTAs an SM: 128 tokens still split in two).
    plan = _C.sparse_mla_cuda_plan
    assert plan(128, 16, 640, sms)[0] == 1 and plan(128, 16, 640, sms)[3] == 0
    assert plan(128, 16, 640, sms, fp8=True)[::3] == (1, 64)
    assert plan(sms, 16, 640, sms, fp8=True)[::3] == (1, 64)
    assert plan(64, 16, 640, sms, fp8=True)[::3] == (2, 64)
    assert plan(128, 8, 640, sms, fp8=True)[3] == 64
    assert plan(sms + 1, 16, 640, sms, fp8=True)[::3] == (1, 32)
    assert plan(256, 16, 640, sms, fp8=True)[::3] == (1, 32)
    assert plan(4096, 16, 640, sms, fp8=True)[::3] == (1, 32)
    assert plan(128, 16, 640, sms, fp8=True, h16=0)[::3] == (2, 0)
    assert plan(128, 16, 640, sms, fp8=True, h16=32)[::3] == (2, 32)  # two slots an SM
    assert plan(4096, 16, 640, sms, fp8=True, h16=64)[3] == 64
    assert plan(128, 32, 640, sms, fp8=True, h16=64)[3] == 0  # 16 heads at most
    with pytest.raises(Exception, match="h16"):
        plan(128, 16, 640, sms, fp8=True, h16=1)


@pytest.mark.parametrize("h16", [0, 32, 64])
@pytest.mark.parametrize("H", [8, 16])
@pytest.mark.parametrize("fmt", ["fp8", "fp8raw"])
@pytest.mark.parametrize("T,K,bs,extra,pattern", [
    (1, 640, 64, None, "mixed"),        # split: 10 pieces of one tile
    (3, 129, 16, (70, 16), "random"),   # extra cache, a partial last tile
    (300, 200, 64, None, "sorted"),
    (7, 100, 1, (5, 1), "none"),        # every entry skipped
])
def test_both_16_head_fp8_kernels(gen, monkeypatch, h16, H, fmt, T, K, bs, extra, pattern):
    """The plan picks among three kernels for up to 16 heads over the FP8 cache by grid size
    (the one-tile kernel, the 16-head kernel on 32- or 64-entry tiles); each is held to the
    reference here on the same shapes (forced through the plan's h16)."""
    monkeypatch.setattr(sparse_mla_module, "_launch_cuda",
                        functools.partial(sparse_mla_module._launch_cuda, h16=h16))
    run(gen, fmt=fmt, T=T, H=H, K=K, bs=bs, pattern=pattern, sink=True, extra=extra)


def test_float32_query_uses_the_torch_path(gen):
    """float32 q (or a float32 cache) is outside the kernel: the float32 torch path runs (its
    einsums go through cuBLAS, which may use TF32-class precision: ~1e-3 relative)."""
    cache = make_cache(gen, "f32", 8, 16)
    idx = make_indices(gen, "mixed", 3, 50, num_slots(cache))
    q = torch.randn(3, 16, D, generator=gen)
    out, lse = sparse_mla_attention(q.to(DEV), cache.to(DEV), idx.to(DEV), 0.05)
    ref_out, ref_lse = sparse_mla_attention_ref(q, cache, idx, 0.05)
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=2e-3, atol=2e-4)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=1e-3, atol=1e-3)


def test_checked_indices_reject_out_of_range(gen):
    cache = make_cache(gen, "fp8", 4, 16).to(DEV)
    idx = make_indices(gen, "sorted", 2, 20, num_slots(cache)).to(DEV)
    idx[1, 3] = num_slots(cache)
    q = torch.randn(2, 16, D, generator=gen).bfloat16().to(DEV)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_attention(q, cache, idx, 0.05, check_indices=True)


def test_graph_capture_replays(gen):
    """No host sync in the launch path: the op can be captured in a CUDA graph and replayed on
    new data in place."""
    T, H, K = 8, 64, 640
    cache = make_cache(gen, "fp8", 16, 64).to(DEV)
    idx = make_indices(gen, "random", T, K, num_slots(cache)).to(DEV)
    q = torch.randn(T, H, D, generator=gen).bfloat16().to(DEV)
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(T, H, device=DEV)
    sparse_mla_attention(q, cache, idx, 0.05, out=out, lse=lse)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla_attention(q, cache, idx, 0.05, out=out, lse=lse)
    q.copy_(torch.randn(T, H, D, generator=gen).bfloat16())
    idx.copy_(make_indices(gen, "mixed", T, K, num_slots(cache)))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(out, lse, *sparse_mla_attention_ref(q, cache, idx, 0.05), "graph replay")

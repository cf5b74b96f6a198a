"""The ops' float arguments (scales, eps, the SwiGLU limit) reach the kernels as float32: a value
that is finite (or > 0) as a Python float but not as a float32 must be refused by name, before the
C++ (which failed an internal check, or computed with inf). torch's own float32 cast is the
oracle for which values those are."""

from __future__ import annotations

import pytest
import torch

from zeroinfer import ops
from zeroinfer.ops._checks import check_float


def as_f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float64).to(torch.float32).item()


def near(gen, centre: float, n: int) -> list[float]:
    """n doubles within a few float32 ulps of centre (both signs of the offset), and centre."""
    ulps = torch.randint(-4, 5, (n,), generator=gen).double()
    frac = torch.rand(n, generator=gen, dtype=torch.float64)
    return [centre] + [centre * (1 + (u + f).item() * 2.0**-24) for u, f in zip(ulps, frac)]


def test_check_float_refuses_exactly_what_float32_cannot_hold(gen):
    f32_max, f32_tiny = torch.finfo(torch.float32).max, 2.0**-149
    values = near(gen, f32_max, 200) + near(gen, 2.0**128, 50) + [1e39, 1e300, -1e39]
    for v in values:
        if as_f32(v) in (float("inf"), float("-inf")):
            with pytest.raises(ValueError, match="x must be finite as a float32"):
                check_float("op", "x", v)
        else:
            assert check_float("op", "x", v) == v
    for v in near(gen, f32_tiny, 100) + near(gen, f32_tiny / 2, 100) + [1e-50, 1e-300]:
        if v <= 0:
            continue
        if as_f32(v) == 0:
            with pytest.raises(ValueError, match="x must be > 0 as a float32"):
                check_float("op", "x", v, positive=True)
            assert check_float("op", "x", v) == v  # 0 is fine where only finite is asked
        else:
            assert check_float("op", "x", v, positive=True) == v


def test_ops_name_the_argument(gen):
    big, tiny = 1e39, 1e-50
    q = torch.randn(1, 2, 512, generator=gen)
    kv = torch.randn(1, 4, 512, generator=gen)
    idx = torch.tensor([[0, 1]], dtype=torch.int32)
    for v in (big, tiny):
        with pytest.raises(ValueError, match="softmax_scale must be"):
            ops.sparse_mla_attention(q, kv, idx, v)
    a = torch.randn(2, 32, generator=gen)
    w = torch.randint(0, 256, (1, 4, 16), dtype=torch.uint8, generator=gen)
    s = torch.full((1, 4, 1), 127, dtype=torch.uint8)
    off = torch.tensor([0, 2], dtype=torch.int32)
    for v in (big, tiny):
        with pytest.raises(ValueError, match="swiglu_limit must be"):
            ops.mxfp4_grouped_gemm(a, w, s, expert_offsets=off, fuse_swiglu=True, swiglu_limit=v)
    with pytest.raises(ValueError, match="scale must be finite as a float32"):
        ops.moe_route(torch.randn(1, 8, generator=gen), 2, scale=-big, bias=torch.zeros(8))
    with pytest.raises(ValueError, match="eps must be finite as a float32"):
        ops.rms_norm(torch.randn(2, 8, generator=gen), None, big)
    with pytest.raises(ValueError, match="eps must be finite as a float32"):
        ops.mhc_mixes(torch.randn(1, 24, generator=gen), torch.ones(3), torch.zeros(24),
                      streams=4, iters=2, eps=big)
    keys = torch.randn(1, 4, 8, generator=gen)
    with pytest.raises(ValueError, match="scale must be finite as a float32"):
        ops.indexer_scores(torch.randn(1, 2, 8, generator=gen), torch.randn(1, 2, generator=gen),
                           keys, torch.zeros(1, 1, dtype=torch.int32),
                           torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                           1, scale=big)
    # the largest float32 and the smallest positive one still pass
    ops.sparse_mla_attention(q, kv, idx, 2.0**-149)
    ops.rms_norm(torch.randn(2, 8, generator=gen), None, torch.finfo(torch.float32).max)

"""mxfp4_grouped_gemm against its float64 reference, on fresh random inputs every run.

Weights are random BYTES (every nibble, -0 included) with random UE8M0 scales; outputs passed in
through out= are poisoned with NaN so that every owned row must be written and every other row
must be left alone.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroinfer.ops.moe_gemm import mxfp4_act_scale_mn_major, mxfp4_grouped_gemm
from zeroinfer.reference.moe_gemm import dequantize_expert_w4a8_f64, mxfp4_grouped_gemm_ref

FP8 = torch.float8_e4m3fn
E8M0 = getattr(torch, "float8_e8m0fnu", None)


pytestmark = pytest.mark.usefixtures("single_torch_thread")


# ------------------------------------------------------------------------------------ inputs
def rand_weights(gen, E, N, K, lo=120, hi=132):
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(lo, hi + 1, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    return w, s


def rand_act(gen, shape, dtype):
    """(a, a_scale): float activations, or fp8 values with per-token scales over 128-groups."""
    x = torch.randn(*shape, generator=gen) * 2
    if dtype != FP8:
        return x.to(dtype), None
    k = shape[-1]
    a = (x * 40).clamp(-440, 440).to(FP8)
    mant = 0.5 + torch.rand(*shape[:-1], k // 128, generator=gen)
    a_scale = mant * torch.exp2(torch.randint(-8, -3, mant.shape, generator=gen).float())
    return a, a_scale


def rand_counts(gen, E, M, *, empty=0):
    """Random split of M rows over E experts; `empty` experts forced to zero rows."""
    if M == 0:
        return [0] * E
    probs = torch.rand(E, generator=gen) + 0.05
    if empty:
        probs[torch.randperm(E, generator=gen)[:min(empty, E - 1)]] = 0
    idx = torch.multinomial(probs, M, replacement=True, generator=gen)
    return torch.bincount(idx, minlength=E).tolist()


def make_contiguous(gen, counts, pad_max=0):
    """Segments of counts[e] used rows followed by 0..pad_max padding rows."""
    pads = torch.randint(0, pad_max + 1, (len(counts),), generator=gen).tolist() if pad_max else \
        [0] * len(counts)
    seg = [c + p for c, p in zip(counts, pads)]
    offsets = [0]
    for s in seg:
        offsets.append(offsets[-1] + s)
    return (torch.tensor(offsets, dtype=torch.int32), torch.tensor(counts, dtype=torch.int32),
            offsets[-1])


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


# -------------------------------------------------------------------------------- comparison
def assert_matches_ref(got, a, w, s, *, out_dtype, fuse_swiglu=False, swiglu_limit=None,
                       initial=None, **layout):
    """got vs the float64 reference: NaN exactly where the reference keeps `initial`'s NaN
    (unowned rows), and within tolerance elsewhere. The absolute tolerance scales with the size of
    the GEMM outputs (float32 accumulation error is relative to them, and the SwiGLU multiplies
    it by at most max(|g|, |u|) or by the clamp limit)."""
    ref = mxfp4_grouped_gemm_ref(a, w, s, fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit,
                                 initial=initial, **layout)
    assert got.dtype == out_dtype and got.shape == ref.shape
    g = got.double()
    nan_ref = torch.isnan(ref)
    assert torch.equal(torch.isnan(g), nan_ref), "rows written/unwritten do not match the contract"
    if bool(nan_ref.all()):
        return
    pre = mxfp4_grouped_gemm_ref(a, w, s, **layout)
    pre_max = float(pre[~torch.isnan(pre)].abs().max()) if bool((~torch.isnan(pre)).any()) else 0.0
    scale = float(ref[~nan_ref].abs().max())
    if fuse_swiglu:
        scale = max(scale, pre_max * min(pre_max, swiglu_limit or math.inf))
    else:
        scale = max(scale, pre_max)
    rtol, atol = (1e-5, 1e-5 * scale) if out_dtype == torch.float32 else (1e-2, 1e-3 * scale)
    diff = (g - ref)[~nan_ref].abs()
    bound = rtol * ref[~nan_ref].abs() + atol
    worst = int(torch.argmax(diff - bound))
    assert bool((diff <= bound).all()), (
        f"max excess {float((diff - bound)[worst]):.3g}: got {float(g[~nan_ref][worst])}, "
        f"ref {float(ref[~nan_ref][worst])}, tolerance scale {scale:.3g}")


def default_out_dtype(a):
    return torch.float32 if a.dtype == torch.float32 else torch.bfloat16


def clamp_inputs(gen, a, a_scale, w, s, **layout):
    """Pick a SwiGLU limit λ in [0.5, 3] and rescale the activations so that the pre-activations
    spread over about ±3λ (λ then moved inside the values if the spread is lopsided): then the gate clamp (one-sided: gates below -λ must NOT be clamped,
    and silu still differs there) and the up clamp (two-sided) both trigger, and some values stay
    unclamped. Returns (a, a_scale, λ)."""
    lim = 0.5 + 2.5 * float(torch.rand(1, generator=gen))
    pre = mxfp4_grouped_gemm_ref(a, w, s, a_scale=a_scale, **layout)
    owned = ~torch.isnan(pre[..., 0])
    c = 3 * lim / float(pre[owned].std())
    if a_scale is not None:
        a_scale = a_scale * c
    else:
        a = (a.double() * c).to(a.dtype)
    pre = mxfp4_grouped_gemm_ref(a, w, s, a_scale=a_scale, **layout)[owned]
    h = pre.shape[-1] // 2
    gate, up = pre[:, :h], pre[:, h:]
    if gate.numel() >= 64:  # enough values that all three cases occur
        # The random scale bytes can make one half's spread dwarf the other's (one row with a
        # large scale sets the std), so λ moves, if it must, into the range where every case
        # occurs: some |up| below it, and some up and gates beyond it on both sides.
        lo = float(up.abs().min())
        hi = min(float(up.abs().max()), float(gate.max()), float(-gate.min()))
        if not lo < lim < hi and lo < hi:
            lim = lo + (hi - lo) * (0.25 + 0.5 * float(torch.rand(1, generator=gen)))
        assert bool((gate > lim).any()) and bool((gate < -lim).any())
        assert bool((up.abs() > lim).any()) and bool((up.abs() < lim).any())
    return a, a_scale, lim


SWIGLU_MODES = ["plain", "swiglu", "swiglu_limit"]


def run_case(gen, *, E, N, K, dtype, mode, masked, M=None, counts=None, pad_max=3, out_dtype=None,
             use_out=True):
    w, s = rand_weights(gen, E, N, K)
    if masked:
        if counts is None:
            cap = int(torch.randint(1, 12, (1,), generator=gen))
            mm = torch.randint(0, cap + 1, (E,), generator=gen).tolist()
        else:
            cap, mm = max(counts + [1]), counts
        layout = {"masked_m": torch.tensor(mm, dtype=torch.int32)}
        a, a_scale = rand_act(gen, (E, cap, K), dtype)
        rows_shape = (E, cap)
    else:
        if counts is None:
            M = int(torch.randint(0, 40, (1,), generator=gen)) if M is None else M
            counts = rand_counts(gen, E, M)
        offsets, cnt, total = make_contiguous(gen, counts, pad_max)
        layout = {"expert_offsets": offsets, "expert_counts": cnt}
        a, a_scale = rand_act(gen, (total, K), dtype)
        rows_shape = (total,)
    fuse = mode != "plain"
    lim = None
    if mode == "swiglu_limit" and any(layout.get("masked_m", layout.get("expert_counts")).tolist()):
        a, a_scale, lim = clamp_inputs(gen, a, a_scale, w, s, **layout)
    od = out_dtype or default_out_dtype(a)
    n_out = N // 2 if fuse else N
    out = poisoned((*rows_shape, n_out), od) if use_out else None
    got = mxfp4_grouped_gemm(a, w, s, a_scale=a_scale, fuse_swiglu=fuse, swiglu_limit=lim,
                             out_dtype=out_dtype, out=out, **layout)
    if use_out:
        assert got is out
        assert_matches_ref(got, a, w, s, out_dtype=od, fuse_swiglu=fuse, swiglu_limit=lim,
                           initial=poisoned((*rows_shape, n_out), torch.float64),
                           a_scale=a_scale, **layout)
    else:  # fresh output: only the owned rows are defined; compare those
        ref = mxfp4_grouped_gemm_ref(a, w, s, fuse_swiglu=fuse, swiglu_limit=lim,
                                     a_scale=a_scale, **layout)
        owned = ~torch.isnan(ref)
        got_owned = torch.where(owned, got.double(), torch.full_like(ref, float("nan"))).to(od)
        assert_matches_ref(got_owned, a, w, s, out_dtype=od, fuse_swiglu=fuse, swiglu_limit=lim,
                           a_scale=a_scale, **layout)


# --------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("mode", SWIGLU_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [32, 64, 256])
@pytest.mark.parametrize("N", [32, 64, 96])
@pytest.mark.parametrize("E", [1, 3, 8])
def test_contiguous(gen, E, N, K, dtype, mode):
    run_case(gen, E=E, N=N, K=K, dtype=dtype, mode=mode, masked=False)


@pytest.mark.parametrize("mode", SWIGLU_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [32, 256])
@pytest.mark.parametrize("N", [32, 96])
@pytest.mark.parametrize("E", [1, 3, 8])
def test_masked(gen, E, N, K, dtype, mode):
    run_case(gen, E=E, N=N, K=K, dtype=dtype, mode=mode, masked=True)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("mode", SWIGLU_MODES)
@pytest.mark.parametrize("E,N,K", [(1, 32, 128), (3, 64, 256), (8, 96, 256)])
def test_fp8_activations(gen, E, N, K, mode, masked):
    run_case(gen, E=E, N=N, K=K, dtype=FP8, mode=mode, masked=masked)


def scale_layouts(a_scale):
    """The same per-token scales in other memory layouts (on a_scale's device): token-contiguous
    (the layout the CUDA prefill tile reads fastest), a strided view into a wider buffer, and
    (masked) a per-expert transpose whose experts are not cap rows apart."""
    out = {"mn_major": mxfp4_act_scale_mn_major(a_scale)}
    wide = torch.full((*a_scale.shape[:-1], 2 * a_scale.shape[-1]), float("nan"),
                      device=a_scale.device)
    wide[..., ::2] = a_scale
    out["strided"] = wide[..., ::2]
    if a_scale.dim() == 3:
        out["per_expert_t"] = a_scale.transpose(1, 2).contiguous().transpose(1, 2)
    return out


@pytest.mark.parametrize("masked", [False, True])
def test_fp8_scale_layouts(gen, masked):
    """a_scale in any strided layout gives bitwise the row-major result (values, not memory
    order, define it); the layouts really differ in memory."""
    E, N, K = 3, 64, 384
    w, s = rand_weights(gen, E, N, K)
    if masked:
        layout = {"masked_m": torch.tensor([5, 0, 7], dtype=torch.int32)}
        a, a_scale = rand_act(gen, (E, 7, K), FP8)
    else:
        offsets, cnt, total = make_contiguous(gen, [9, 0, 6], 2)
        layout = {"expert_offsets": offsets, "expert_counts": cnt}
        a, a_scale = rand_act(gen, (total, K), FP8)
    shape = (*a.shape[:-1], N)
    want = mxfp4_grouped_gemm(a, w, s, a_scale=a_scale, out_dtype=torch.float32,
                              out=poisoned(shape, torch.float32), **layout)
    assert_matches_ref(want, a, w, s, out_dtype=torch.float32, a_scale=a_scale,
                       initial=poisoned(shape, torch.float64), **layout)
    for name, sc in scale_layouts(a_scale).items():
        assert not sc.is_contiguous() and torch.equal(sc, a_scale), name
        got = mxfp4_grouped_gemm(a, w, s, a_scale=sc, out_dtype=torch.float32,
                                 out=poisoned(shape, torch.float32), **layout)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name


def test_fp8_strided_scale_alias_is_caught(gen):
    """A strided a_scale reaches past numel elements: an output inside that reach is an alias."""
    M, N, K = 4, 32, 256
    w, s = rand_weights(gen, 1, N, K)
    a, _ = rand_act(gen, (M, K), FP8)
    kb = K // 128
    storage = torch.rand(2 * M * kb + M * N, generator=gen)
    a_scale = storage[:2 * M * kb].view(M, 2 * kb)[:, ::2]
    out = storage[M * kb:M * kb + M * N].view(M, N)  # past numel, inside the view's reach
    with pytest.raises(ValueError, match="must not alias input a_scale"):
        mxfp4_grouped_gemm(a, w, s, a_scale=a_scale, out=out, out_dtype=torch.float32,
                           expert_offsets=torch.tensor([0, M], dtype=torch.int32))


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.float32),
                                             (FP8, torch.float32)])
@pytest.mark.parametrize("masked", [False, True])
def test_out_dtype_override(gen, dtype, out_dtype, masked):
    run_case(gen, E=3, N=64, K=128, dtype=dtype, mode="swiglu", masked=masked, out_dtype=out_dtype)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_fresh_output(gen, dtype, masked):
    run_case(gen, E=4, N=64, K=256, dtype=dtype, mode="swiglu_limit", masked=masked, use_out=False)


@pytest.mark.parametrize("masked", [False, True])
def test_empty_experts(gen, masked):
    E = 8
    counts = rand_counts(gen, E, 30, empty=5)
    assert counts.count(0) >= 5
    run_case(gen, E=E, N=64, K=64, dtype=torch.float32, mode="plain", masked=masked, counts=counts)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("mode", SWIGLU_MODES)
def test_all_rows_on_one_expert(gen, masked, mode):
    E = 6
    counts = [0] * E
    counts[int(torch.randint(0, E, (1,), generator=gen))] = 37
    run_case(gen, E=E, N=64, K=128, dtype=torch.bfloat16, mode=mode, masked=masked, counts=counts)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_single_token(gen, masked, dtype):
    E = 5
    counts = [0] * E
    counts[int(torch.randint(0, E, (1,), generator=gen))] = 1
    run_case(gen, E=E, N=96, K=256, dtype=dtype, mode="swiglu_limit", masked=masked,
             counts=counts, pad_max=0)


def test_no_rows(gen):
    """M = 0 and all-zero routing: nothing is written, nothing fails."""
    w, s = rand_weights(gen, 3, 32, 64)
    a = torch.empty(0, 64)
    y = mxfp4_grouped_gemm(a, w, s, expert_offsets=torch.zeros(4, dtype=torch.int32))
    assert y.shape == (0, 32)
    a = torch.randn(5, 64, generator=gen)
    out = poisoned((5, 32), torch.float32)
    mxfp4_grouped_gemm(a, w, s, expert_offsets=torch.tensor([0, 5, 5, 5], dtype=torch.int32),
                       expert_counts=torch.zeros(3, dtype=torch.int32), out=out)
    assert bool(torch.isnan(out).all())
    a3 = torch.randn(3, 4, 64, generator=gen)
    out3 = poisoned((3, 4, 32), torch.float32)
    mxfp4_grouped_gemm(a3, w, s, masked_m=torch.zeros(3, dtype=torch.int32), out=out3)
    assert bool(torch.isnan(out3).all())


@pytest.mark.parametrize("mode", SWIGLU_MODES)
def test_padded_segments(gen, mode):
    """Segments padded past their counts: padding rows (and rows past offsets[E]) untouched."""
    E = 5
    counts = rand_counts(gen, E, 25, empty=1)
    offsets, cnt, total = make_contiguous(gen, counts, pad_max=6)
    tail = 4  # rows after offsets[E] belong to nobody either
    w, s = rand_weights(gen, E, 64, 128)
    a, _ = rand_act(gen, (total + tail, 128), torch.bfloat16)
    fuse = mode != "plain"
    lim = None
    if mode == "swiglu_limit":
        a, _, lim = clamp_inputs(gen, a, None, w, s, expert_offsets=offsets, expert_counts=cnt)
    n_out = 32 if fuse else 64
    out = poisoned((total + tail, n_out), torch.bfloat16)
    mxfp4_grouped_gemm(a, w, s, expert_offsets=offsets, expert_counts=cnt, fuse_swiglu=fuse,
                       swiglu_limit=lim, out=out)
    owned = torch.zeros(total + tail, dtype=torch.bool)
    for e in range(E):
        owned[int(offsets[e]):int(offsets[e]) + counts[e]] = True
    assert bool(torch.isnan(out[~owned]).all())
    assert bool(torch.isfinite(out[owned]).all())
    assert_matches_ref(out, a, w, s, out_dtype=torch.bfloat16, fuse_swiglu=fuse, swiglu_limit=lim,
                       initial=poisoned(out.shape, torch.float64), expert_offsets=offsets,
                       expert_counts=cnt)


def test_larger_shapes_and_tails(gen):
    """Several row blocks per expert, tile and micro-kernel tails (N_out not a multiple of 4)."""
    E, N, K = 3, 2 * 78, 1024
    counts = [150, 0, 45]
    offsets, cnt, total = make_contiguous(gen, counts, pad_max=2)
    w, s = rand_weights(gen, E, N, K)
    a, _ = rand_act(gen, (total, K), torch.float32)
    a, _, lim = clamp_inputs(gen, a, None, w, s, expert_offsets=offsets, expert_counts=cnt)
    out = poisoned((total, N // 2), torch.float32)
    mxfp4_grouped_gemm(a, w, s, expert_offsets=offsets, expert_counts=cnt, fuse_swiglu=True,
                       swiglu_limit=lim, out=out)
    assert_matches_ref(out, a, w, s, out_dtype=torch.float32, fuse_swiglu=True, swiglu_limit=lim,
                       initial=poisoned(out.shape, torch.float64), expert_offsets=offsets,
                       expert_counts=cnt)


def test_checkpoint_dtypes(gen):
    """int8 weights and float8_e8m0fnu scales (as stored in checkpoints) are the same bytes."""
    w, s = rand_weights(gen, 3, 64, 128)
    a = torch.randn(10, 128, generator=gen)
    off = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    want = mxfp4_grouped_gemm(a, w, s, expert_offsets=off)
    s2 = s.view(E8M0) if E8M0 is not None else s
    got = mxfp4_grouped_gemm(a, w.view(torch.int8), s2, expert_offsets=off)
    assert torch.equal(got, want)


def test_extreme_scales(gen):
    """Scale bytes over (nearly) the whole range decode exactly, float32 subnormals included."""
    E, N, K = 2, 32, 64
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    # bytes 0..252: 6 * 2^125 is the largest product that stays finite in float32
    s = torch.randint(0, 253, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    a = torch.zeros(K, K)
    a[torch.arange(K), torch.arange(K)] = 1.0  # one-hot rows: Y = W (each entry a single product)
    off = torch.tensor([0, K // 2, K], dtype=torch.int32)
    y = mxfp4_grouped_gemm(a, w, s, expert_offsets=off)
    ref = mxfp4_grouped_gemm_ref(a, w, s, expert_offsets=off)
    assert torch.equal(y.double(), ref.float().double())


def test_w4a8_folds_the_scale_per_128_block(gen):
    """W4A8 (zeroinfer/moe_gemm.h): per (row, 128-k block) base b = max scale byte; a weight is
    e2m1 * 2^(s-b+6) rounded to e4m3, i.e. exact within 14 binades of b and rounded half-to-even
    on the 2^-9 grid below; a NaN base poisons the block. Hand-computed values, through the CPU
    op with one-hot float8 rows (Y = W exactly) and through the reference."""
    K = 256
    codes = torch.arange(16, dtype=torch.uint8).repeat(K // 16)      # every e2m1 code, k order
    w = (codes[0::2] | codes[1::2] << 4).reshape(1, 1, K // 2)
    b = 140
    # block 0: d = 0, -14 (exact), -15, -16 (rounded); block 1: d = 0, -12, -20 (all 0), NaN base
    s = torch.tensor([[[b, b - 14, b - 15, b - 16, b, b - 12, b - 20, b]]], dtype=torch.uint8)
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    want = torch.empty(K, dtype=torch.float64)
    for k in range(K):
        c = int(codes[k])
        v = math.copysign(e2m1[c & 7], -1.0 if c & 8 else 1.0)
        d = int(s[0, 0, k // 32]) - b
        x = v * 2.0 ** (d + 6)            # the e4m3 value before rounding
        if abs(x) < 2.0 ** -6:            # subnormal grid: half to even on 2^-9
            x = round(x * 512) / 512      # (Python's round is half-to-even)
        want[k] = x * 2.0 ** (b - 133)
    assert want[65] == 0.0 and want[67] == 2 * 2.0 ** (b - 142)  # d = -15: 0.5 -> 0, 1.5 -> 2
    a = torch.eye(K).to(FP8)
    a_scale = torch.ones(K, K // 128)
    off = torch.tensor([0, K], dtype=torch.int32)
    ref = mxfp4_grouped_gemm_ref(a, w, s, a_scale=a_scale, expert_offsets=off)[:, 0]
    y = mxfp4_grouped_gemm(a, w, s, a_scale=a_scale, expert_offsets=off)[:, 0].double()
    assert torch.equal(ref, want) and torch.equal(y, want)
    s[0, 0, 7] = 255  # a NaN scale byte: its whole 128-k block is NaN, the other unchanged
    wd = dequantize_expert_w4a8_f64(w[0], s[0])[0]
    assert torch.equal(wd[:128], want[:128]) and torch.isnan(wd[128:]).all()
    y = mxfp4_grouped_gemm(a, w, s, a_scale=a_scale, expert_offsets=off)
    assert torch.isnan(y).all()  # (every dot product meets the NaN weights, if only times 0)


# ----------------------------------------------------------------------- properties (hypothesis)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), E=st.integers(1, 6), M=st.integers(0, 30),
       fuse=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_permuting_experts_permutes_rows(seed, E, M, fuse, dtype):
    """Renumbering experts and moving their segments along moves the output rows along, bitwise
    (every output element is computed the same way wherever its expert sits)."""
    gen = torch.Generator().manual_seed(seed)
    N, K = 64, 96
    w, s = rand_weights(gen, E, N, K)
    counts = rand_counts(gen, E, M)
    offsets, cnt, total = make_contiguous(gen, counts, pad_max=2)
    a, _ = rand_act(gen, (total, K), dtype)
    y = mxfp4_grouped_gemm(a, w, s, expert_offsets=offsets, expert_counts=cnt, fuse_swiglu=fuse,
                           swiglu_limit=5.0 if fuse else None)
    perm = torch.randperm(E, generator=gen)  # new expert i = old expert perm[i]
    seg = (offsets[1:] - offsets[:-1]).tolist()
    rows = torch.cat([torch.arange(int(offsets[p]), int(offsets[p]) + seg[p])
                      for p in perm.tolist()]
                     + [torch.zeros(0, dtype=torch.long)])
    new_off = torch.tensor([0] + torch.tensor([seg[p] for p in perm.tolist()]).cumsum(0).tolist(),
                           dtype=torch.int32)
    y2 = mxfp4_grouped_gemm(a[rows], w[perm].contiguous(), s[perm].contiguous(),
                            expert_offsets=new_off, expert_counts=cnt[perm].contiguous(),
                            fuse_swiglu=fuse, swiglu_limit=5.0 if fuse else None)
    owned = torch.cat([torch.arange(int(new_off[i]), int(new_off[i]) + int(cnt[perm[i]]))
                       for i in range(E)] + [torch.zeros(0, dtype=torch.long)])
    assert torch.equal(y2[owned], y[rows][owned])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), E=st.integers(1, 6), cap=st.integers(1, 9),
       mode=st.sampled_from(SWIGLU_MODES),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, FP8]))
def test_contiguous_and_masked_agree(seed, E, cap, mode, dtype):
    """The same rows laid out contiguously or per-expert give bitwise the same outputs."""
    gen = torch.Generator().manual_seed(seed)
    N, K = 32, 128
    w, s = rand_weights(gen, E, N, K)
    mm = torch.randint(0, cap + 1, (E,), generator=gen, dtype=torch.int32)
    a3, sc3 = rand_act(gen, (E, cap, K), dtype)
    fuse, lim = mode != "plain", (3.0 if mode == "swiglu_limit" else None)
    y3 = mxfp4_grouped_gemm(a3, w, s, masked_m=mm, a_scale=sc3, fuse_swiglu=fuse, swiglu_limit=lim)
    # Contiguous: expert e's segment is its whole capacity block, counts = masked_m.
    offsets = torch.arange(0, (E + 1) * cap, cap, dtype=torch.int32)
    y2 = mxfp4_grouped_gemm(a3.reshape(E * cap, K), w, s, expert_offsets=offsets, expert_counts=mm,
                            a_scale=None if sc3 is None else sc3.reshape(E * cap, -1),
                            fuse_swiglu=fuse, swiglu_limit=lim)
    owned = torch.arange(cap)[None, :] < mm[:, None]
    assert torch.equal(y2.reshape(E, cap, -1)[owned].view(torch.uint8),
                       y3[owned].view(torch.uint8))


# -------------------------------------------------------------------------- routed layout
def rand_ids(gen, T, k, E, *, unrouted=0.15):
    """Router-like ids [T, k] int32: k distinct experts a token, a fraction of slots -1 (experts
    elsewhere)."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.long)
    drop = torch.rand(ids.shape, generator=gen) < unrouted
    return torch.where(drop, -1, ids).to(torch.int32)


def routed_case(gen, *, T, k, E, N, K, dtype, mode, per_slot=False, ids=None):
    """Runs the routed layout into a poisoned output and checks it against the reference; returns
    (output, a, a_scale, w, s, ids, fuse, lim)."""
    w, s = rand_weights(gen, E, N, K)
    ids = rand_ids(gen, T, k, E) if ids is None else ids
    a, a_scale = rand_act(gen, (T * k if per_slot else T, K), dtype)
    fuse = mode != "plain"
    lim = None
    if mode == "swiglu_limit" and bool((ids >= 0).any()):
        a, a_scale, lim = clamp_inputs(gen, a, a_scale, w, s, topk_ids=ids)
    od = default_out_dtype(a)
    n_out = N // 2 if fuse else N
    out = poisoned((T * k, n_out), od)
    got = mxfp4_grouped_gemm(a, w, s, topk_ids=ids, a_scale=a_scale, fuse_swiglu=fuse,
                             swiglu_limit=lim, out=out)
    assert got is out
    assert_matches_ref(got, a, w, s, out_dtype=od, fuse_swiglu=fuse, swiglu_limit=lim,
                       initial=poisoned(out.shape, torch.float64), a_scale=a_scale, topk_ids=ids)
    return got, a, a_scale, w, s, ids, fuse, lim


@pytest.mark.parametrize("per_slot", [False, True])
@pytest.mark.parametrize("mode", SWIGLU_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_routed_matches_ref(gen, dtype, mode, per_slot):
    """topk_ids in place of a dispatch: row t*k + j is expert ids[t, j] on token t's row (or on
    row t*k + j of a [T*k, K] a); rows of -1 stay poisoned."""
    T = int(torch.randint(1, 12, (1,), generator=gen))
    routed_case(gen, T=T, k=3, E=7, N=64, K=256, dtype=dtype, mode=mode, per_slot=per_slot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_routed_equals_dispatch_path(gen, dtype):
    """The model's two paths, bitwise: moe_dispatch -> contiguous GEMMs -> combine by token_row,
    and the routed GEMMs -> combine by topk_ids (gate_up with SwiGLU, then down on its output)."""
    from zeroinfer.ops import moe_combine, moe_dispatch

    T, k, E, D, inter = int(torch.randint(1, 20, (1,), generator=gen)), 4, 9, 128, 64
    ids = rand_ids(gen, T, k, E)
    w1, s1 = rand_weights(gen, E, 2 * inter, D)
    w2, s2 = rand_weights(gen, E, D, inter)
    x, xs = rand_act(gen, (T, D), dtype)
    wt = torch.rand(T, k, generator=gen)
    act = dict(a_scale=xs, out_dtype=torch.float32)
    d = moe_dispatch(x, ids, E)
    seg = dict(expert_offsets=d.expert_offsets, expert_counts=d.expert_counts)
    h = mxfp4_grouped_gemm(d.sorted_x, w1, s1, fuse_swiglu=True, swiglu_limit=4.0, **seg,
                           **dict(act, a_scale=None if xs is None else xs[d.row_token.long()]))
    o = mxfp4_grouped_gemm(h, w2, s2, **seg)
    want = moe_combine(o, d.token_row, wt)
    hr = mxfp4_grouped_gemm(x, w1, s1, topk_ids=ids, fuse_swiglu=True, swiglu_limit=4.0, **act)
    live = d.token_row.reshape(-1) >= 0
    assert torch.equal(hr[live], h[d.token_row.reshape(-1)[live].long()])
    orr = mxfp4_grouped_gemm(hr, w2, s2, topk_ids=ids)
    got = moe_combine(orr, None, wt, topk_ids=ids)
    assert torch.equal(got, want)


def test_routed_skewed_single_token_and_unrouted(gen):
    """Every token's slot j on expert j (k experts of T rows each, more rows than a tile); one
    token; every slot -1 (nothing written); no tokens."""
    T, k, E = 37, 3, 8
    ids = torch.arange(k, dtype=torch.int32).repeat(T, 1)
    routed_case(gen, T=T, k=k, E=E, N=64, K=128, dtype=torch.bfloat16, mode="swiglu_limit",
                ids=ids)
    routed_case(gen, T=1, k=6, E=16, N=96, K=256, dtype=FP8, mode="swiglu", per_slot=True)
    got = routed_case(gen, T=5, k=2, E=4, N=32, K=64, dtype=torch.float32, mode="plain",
                      ids=torch.full((5, 2), -1, dtype=torch.int32))[0]
    assert bool(torch.isnan(got).all())
    w, s = rand_weights(gen, 3, 32, 64)
    y = mxfp4_grouped_gemm(torch.empty(0, 64), w, s, topk_ids=torch.zeros(0, 6, dtype=torch.int32))
    assert y.shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_routed_tokens_with_no_slots(gen, dtype):
    """T tokens routed to k = 0 experts: a [T*0, N] result with nothing to compute (it reached
    the C++ with no ids pointer and failed an internal check)."""
    T = int(torch.randint(1, 9, (1,), generator=gen))
    w, s = rand_weights(gen, 3, 32, 128)
    a, a_scale = rand_act(gen, (T, 128), dtype)
    ids = torch.zeros(T, 0, dtype=torch.int32)
    y = mxfp4_grouped_gemm(a, w, s, topk_ids=ids, a_scale=a_scale)
    assert y.shape == (0, 32) and y.dtype == default_out_dtype(a)
    ref = mxfp4_grouped_gemm_ref(a, w, s, topk_ids=ids, a_scale=a_scale)
    assert ref.shape == y.shape
    h = mxfp4_grouped_gemm(a, w, s, topk_ids=ids, a_scale=a_scale, fuse_swiglu=True,
                           out=torch.empty(0, 16, dtype=torch.float32), out_dtype=torch.float32)
    assert h.shape == (0, 16)


def test_routed_interim_torch_path_on_cpu(gen):
    """The interim CUDA path's routed branch (float32 on CUDA) is plain torch: checked on CPU."""
    from zeroinfer.ops.moe_gemm import _interim_routed_cuda

    for per_slot in (False, True):
        T, k, E, N, K = 6, 3, 5, 64, 128
        w, s = rand_weights(gen, E, N, K)
        ids = rand_ids(gen, T, k, E)
        a, _ = rand_act(gen, (T * k if per_slot else T, K), torch.float32)
        out = poisoned((T * k, N // 2), torch.float32)
        _interim_routed_cuda(a, w, s, ids, None, True, 2.0, out)
        assert_matches_ref(out, a, w, s, out_dtype=torch.float32, fuse_swiglu=True,
                           swiglu_limit=2.0, initial=poisoned(out.shape, torch.float64),
                           topk_ids=ids)


def test_routed_bad_inputs():
    g = torch.Generator().manual_seed(0)
    w, s = rand_weights(g, 3, 32, 128)
    a = torch.randn(4, 128, generator=g)
    ids = torch.tensor([[0, 2], [1, -1], [2, 0], [1, 2]], dtype=torch.int32)
    _raises(ValueError, r"exactly one of .*got expert_offsets and topk_ids", a, w, s, topk_ids=ids,
            expert_offsets=torch.tensor([0, 2, 2, 4], dtype=torch.int32))
    _raises(ValueError, r"expert_counts is only for the contiguous layout .*not with topk_ids", a,
            w, s, topk_ids=ids, expert_counts=torch.zeros(3, dtype=torch.int32))
    _raises(TypeError, r"topk_ids must have dtype int32", a, w, s, topk_ids=ids.long())
    _raises(ValueError, r"a must have one row per token \(\[4, K\]\) or per slot \(\[8, K\]\)",
            torch.randn(5, 128), w, s, topk_ids=ids)
    for bad, rng in ((3, r"\[-1, 3\]"), (-2, r"\[-2, 2\]")):
        ids_bad = ids.clone()
        ids_bad[2, 1] = bad
        _raises(ValueError, r"topk_ids values must be in \[0, E = 3\) or -1, got range " + rng,
                a, w, s, topk_ids=ids_bad)
    from zeroinfer.ops import moe_combine

    o = torch.randn(8, 16)
    wt = torch.rand(4, 2)
    with pytest.raises(ValueError, match=r"pass token_row .* or, for the routed layout.*got both"):
        moe_combine(o, ids, wt, topk_ids=ids)
    with pytest.raises(ValueError, match=r"got neither"):
        moe_combine(o, None, wt)
    with pytest.raises(ValueError, match=r"expert_out must have T\*k = 8 rows .*got 7"):
        moe_combine(o[:7], None, wt, topk_ids=ids)


# ----------------------------------------------------------------------------- bad inputs
def _good(gen=None, *, masked=False, dtype=torch.float32, E=3, N=32, K=128, M=6, cap=4):
    g = gen or torch.Generator().manual_seed(0)
    w, s = rand_weights(g, E, N, K)
    if masked:
        a, a_scale = rand_act(g, (E, cap, K), dtype)
        lay = {"masked_m": torch.tensor([1, 0, cap][:E] + [0] * max(0, E - 3), dtype=torch.int32)}
    else:
        a, a_scale = rand_act(g, (M, K), dtype)
        lay = {"expert_offsets": torch.tensor([0, 2, 2, M], dtype=torch.int32)}
    kw = dict(lay)
    if a_scale is not None:
        kw["a_scale"] = a_scale
    return a, w, s, kw


def _raises(exc, match, a, w, s, **kw):
    with pytest.raises(exc, match=match):
        mxfp4_grouped_gemm(a, w, s, **kw)


def test_good_inputs_pass():
    for masked in (False, True):
        for dtype in (torch.float32, torch.bfloat16, FP8):
            a, w, s, kw = _good(masked=masked, dtype=dtype)
            mxfp4_grouped_gemm(a, w, s, **kw)


def test_bad_k():
    a, w, s, kw = _good()
    a48 = torch.randn(6, 48)
    w48 = torch.zeros(3, 32, 24, dtype=torch.uint8)
    s48 = torch.zeros(3, 32, 1, dtype=torch.uint8)
    _raises(ValueError, r"K = a\.shape\[-1\] = 48 must be a positive multiple of 32", a48, w48, s48,
            **kw)
    _raises(ValueError, r"w must have shape \[E, N, K/2\].*K = 128", a, w[:, :, :32].contiguous(),
            s, **kw)
    a8, w8, s8, kw8 = _good(dtype=FP8, K=96)
    kw8["a_scale"] = torch.ones(6, 1)
    _raises(ValueError, r"K = a\.shape\[-1\] = 96 must be a multiple of 128", a8, w8, s8, **kw8)


def test_bad_types_and_dtypes():
    a, w, s, kw = _good()
    _raises(TypeError, r"a must be a torch\.Tensor", a.numpy(), w, s, **kw)
    _raises(TypeError, r"a must have dtype", a.half(), w, s, **kw)
    _raises(TypeError, r"w must have dtype", a, w.float(), s, **kw)
    _raises(TypeError, r"w must be a torch\.Tensor", a, [1], s, **kw)
    _raises(TypeError, r"w_scale must have dtype", a, w, s.to(torch.int32), **kw)
    _raises(TypeError, r"w_scale must be a torch\.Tensor", a, w, None, **kw)
    _raises(TypeError, r"expert_offsets must have dtype", a, w, s,
            expert_offsets=kw["expert_offsets"].long())
    _raises(TypeError, r"expert_offsets must be a torch\.Tensor", a, w, s,
            expert_offsets=[0, 2, 2, 6])
    _raises(TypeError, r"expert_counts must have dtype", a, w, s, **kw,
            expert_counts=torch.tensor([2, 0, 4]))
    a3, w3, s3, kw3 = _good(masked=True)
    _raises(TypeError, r"masked_m must have dtype", a3, w3, s3,
            masked_m=kw3["masked_m"].to(torch.int64))
    a8, w8, s8, kw8 = _good(dtype=FP8)
    _raises(TypeError, r"a_scale must have dtype", a8, w8, s8, expert_offsets=kw8["expert_offsets"],
            a_scale=kw8["a_scale"].bfloat16())
    _raises(TypeError, r"out_dtype must be float32 or bfloat16", a, w, s, **kw,
            out_dtype=torch.float16)
    _raises(TypeError, r"out_dtype must be a torch\.dtype", a, w, s, **kw, out_dtype="float32")
    _raises(TypeError, r"out must have dtype float32", a, w, s, **kw,
            out=torch.empty(6, 32, dtype=torch.bfloat16))
    _raises(TypeError, r"fuse_swiglu must be a bool", a, w, s, **kw, fuse_swiglu=1)
    _raises(TypeError, r"swiglu_limit must be a float", a, w, s, **kw, fuse_swiglu=True,
            swiglu_limit="10")
    _raises(TypeError, r"check must be a bool", a, w, s, **kw, check=1)


def test_bad_shapes():
    a, w, s, kw = _good()
    _raises(ValueError, r"a must be 2-D", a[None], w, s, **kw)
    _raises(ValueError, r"w must be 3-D", a, w[0], s, **kw)
    _raises(ValueError, r"w_scale must have shape \[3, 32, 4\]", a, w, s[:, :16].contiguous(), **kw)
    _raises(ValueError, r"w_scale must be 3-D", a, w, s[0], **kw)
    _raises(ValueError, r"expert_offsets must have shape \[4\]", a, w, s,
            expert_offsets=kw["expert_offsets"][:3].contiguous())
    _raises(ValueError, r"expert_counts must have shape \[3\]", a, w, s, **kw,
            expert_counts=torch.zeros(4, dtype=torch.int32))
    _raises(ValueError, r"out must have shape \[6, 32\]", a, w, s, **kw, out=torch.empty(6, 16))
    _raises(ValueError, r"out must have shape \[6, 16\]", a, w, s, **kw, fuse_swiglu=True,
            out=torch.empty(6, 32))
    a3, w3, s3, kw3 = _good(masked=True)
    _raises(ValueError, r"a must be 3-D", a3[0], w3, s3, **kw3)
    _raises(ValueError, r"a must have shape \[E, cap, K\] with E = 3", a3[:2].contiguous(), w3, s3,
            **kw3)
    _raises(ValueError, r"masked_m must have shape \[3\]", a3, w3, s3,
            masked_m=torch.zeros(2, dtype=torch.int32))
    _raises(ValueError, r"out must have shape \[3, 4, 32\]", a3, w3, s3, **kw3,
            out=torch.empty(3, 5, 32))
    a8, w8, s8, kw8 = _good(dtype=FP8)
    _raises(ValueError, r"a_scale must have shape \[6, 1\]", a8, w8, s8,
            expert_offsets=kw8["expert_offsets"], a_scale=torch.ones(6, 2))
    _raises(ValueError, r"w must be \[E, N, K/2\] with E >= 1", a, w[:0], s[:0],
            expert_offsets=torch.zeros(1, dtype=torch.int32))


def test_non_contiguous():
    a, w, s, kw = _good()
    _raises(ValueError, r"a must be contiguous", torch.randn(128, 6).t(), w, s, **kw)
    wide = torch.zeros(3, 32, 128, dtype=torch.uint8)
    _raises(ValueError, r"w must be contiguous", a, wide[:, :, ::2], s, **kw)
    _raises(ValueError, r"w_scale must be contiguous", a, w, torch.zeros(3, 32, 8,
            dtype=torch.uint8)[:, :, ::2], **kw)
    _raises(ValueError, r"expert_offsets must be contiguous", a, w, s,
            expert_offsets=torch.tensor([0, 9, 2, 9, 2, 9, 6], dtype=torch.int32)[::2])
    _raises(ValueError, r"out must be contiguous", a, w, s, **kw, out=torch.empty(32, 6).t())


def test_mixed_devices():
    a, w, s, kw = _good()
    meta = torch.device("meta")
    _raises(ValueError, r"w must be on cpu", a, w.to(meta), s, **kw)
    _raises(ValueError, r"w_scale must be on cpu", a, w, s.to(meta), **kw)
    _raises(ValueError, r"expert_offsets must be on cpu", a, w, s,
            expert_offsets=kw["expert_offsets"].to(meta))
    _raises(ValueError, r"out must be on cpu", a, w, s, **kw, out=torch.empty(6, 32, device=meta))
    a3, w3, s3, kw3 = _good(masked=True)
    _raises(ValueError, r"masked_m must be on cpu", a3, w3, s3, masked_m=kw3["masked_m"].to(meta))
    _raises(ValueError, r"must be on 'cpu' or 'cuda'", a.to(meta), w.to(meta), s.to(meta),
            expert_offsets=kw["expert_offsets"].to(meta))


def test_layout_selection():
    a, w, s, kw = _good()
    both = dict(kw, masked_m=torch.zeros(3, dtype=torch.int32))
    _raises(ValueError, r"exactly one of expert_offsets .*, masked_m .* or topk_ids .*got "
            r"expert_offsets and masked_m", a, w, s, **both)
    _raises(ValueError, r"exactly one of expert_offsets .* or topk_ids .*got none", a, w, s)
    a3, w3, s3, kw3 = _good(masked=True)
    _raises(ValueError, r"expert_counts is only for the contiguous layout", a3, w3, s3, **kw3,
            expert_counts=torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("check", [None, False, True])  # CPU tensors are always validated
def test_bad_routing_values(check):
    a, w, s, kw = _good()
    off = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    _raises(ValueError, r"expert_offsets must be nondecreasing.*expert_offsets\[1\] = 4 > "
            r"expert_offsets\[2\] = 2", a, w, s, expert_offsets=off(0, 4, 2, 6), check=check)
    _raises(ValueError, r"expert_offsets\[E\] = 7 must be <= M = a\.shape\[0\] = 6", a, w, s,
            expert_offsets=off(0, 2, 2, 7), check=check)
    _raises(ValueError, r"expert_offsets\[0\] must be >= 0", a, w, s,
            expert_offsets=off(-1, 2, 2, 6), check=check)
    _raises(ValueError, r"expert_counts\[2\] = 5 must be in \[0, .* = 4\]", a, w, s, **kw,
            expert_counts=off(2, 0, 5), check=check)
    _raises(ValueError, r"expert_counts\[0\] = -1 must be in", a, w, s, **kw,
            expert_counts=off(-1, 0, 4), check=check)
    a3, w3, s3, _ = _good(masked=True)
    _raises(ValueError, r"masked_m values must be in \[0, cap = a\.shape\[1\] = 4\], got "
            r"masked_m\[1\] = 5", a3, w3, s3, masked_m=off(0, 5, 1), check=check)
    _raises(ValueError, r"masked_m values must be in .*masked_m\[2\] = -2", a3, w3, s3,
            masked_m=off(0, 1, -2), check=check)


def test_bad_scales_and_swiglu():
    a8, w8, s8, kw8 = _good(dtype=FP8)
    _raises(ValueError, r"a_scale .* is required when a is float8_e4m3fn", a8, w8, s8,
            expert_offsets=kw8["expert_offsets"])
    a, w, s, kw = _good()
    _raises(ValueError, r"a_scale must be None for float32 a", a, w, s, **kw,
            a_scale=torch.ones(6, 1))
    ab, wb, sb, kwb = _good(dtype=torch.bfloat16)
    _raises(ValueError, r"a_scale must be None for bfloat16 a", ab, wb, sb, **kwb,
            a_scale=torch.ones(6, 1))
    wo, so = rand_weights(torch.Generator().manual_seed(1), 3, 33, 128)
    _raises(ValueError, r"fuse_swiglu needs an even N = w\.shape\[1\].*N = 33", a, wo, so, **kw,
            fuse_swiglu=True)
    _raises(ValueError, r"swiglu_limit is only meaningful with fuse_swiglu=True", a, w, s, **kw,
            swiglu_limit=10.0)
    for bad in (0.0, -1.0):
        _raises(ValueError, r"swiglu_limit must be > 0", a, w, s, **kw, fuse_swiglu=True,
                swiglu_limit=bad)
    for bad in (math.inf, math.nan):
        _raises(ValueError, r"swiglu_limit must be finite", a, w, s, **kw, fuse_swiglu=True,
                swiglu_limit=bad)


def test_out_alias():
    g = torch.Generator().manual_seed(0)
    w, s = rand_weights(g, 1, 64, 64)
    a = torch.randn(5, 64, generator=g)
    off = torch.tensor([0, 5], dtype=torch.int32)
    _raises(ValueError, r"output out must not alias input a", a, w, s, expert_offsets=off, out=a)


# --------------------------------------------------------- interim CUDA path (torch), on CPU
def layout_case(gen, masked, dtype, mode, *, E, N, K, cap, max_rows, empty):
    """Random weights, activations and a masked or contiguous layout for one SwiGLU mode.
    Returns (w, s, a, a_scale, layout kwargs, output row shape, fuse, swiglu limit)."""
    w, s = rand_weights(gen, E, N, K)
    if masked:
        layout = {"masked_m": torch.randint(0, cap + 1, (E,), generator=gen, dtype=torch.int32)}
        a, a_scale = rand_act(gen, (E, cap, K), dtype)
        rows = (E, cap)
    else:
        counts = rand_counts(gen, E, max_rows, empty=empty)
        offsets, cnt, total = make_contiguous(gen, counts, pad_max=3)
        layout = {"expert_offsets": offsets, "expert_counts": cnt}
        a, a_scale = rand_act(gen, (total, K), dtype)
        rows = (total,)
    fuse = mode != "plain"
    lim = None
    if mode == "swiglu_limit":
        a, a_scale, lim = clamp_inputs(gen, a, a_scale, w, s, **layout)
    return w, s, a, a_scale, layout, rows, fuse, lim


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("mode", SWIGLU_MODES)
def test_interim_torch_path_on_cpu(gen, masked, dtype, mode):
    """The interim CUDA path is plain torch: run it on CPU tensors against the reference, so it is
    covered without a GPU (test_cuda_matches_reference runs it on the GPU)."""
    from zeroinfer.ops.moe_gemm import _interim_cuda

    w, s, a, a_scale, layout, rows, fuse, lim = layout_case(gen, masked, dtype, mode, E=4, N=64,
                                                           K=256, cap=7, max_rows=30, empty=1)
    N = w.shape[1]
    od = default_out_dtype(a)
    out = poisoned((*rows, N // 2 if fuse else N), od)
    _interim_cuda(a, w, s, layout.get("expert_offsets"), layout.get("expert_counts"),
                  layout.get("masked_m"), a_scale, fuse, lim, out)
    assert_matches_ref(out, a, w, s, out_dtype=od, fuse_swiglu=fuse, swiglu_limit=lim,
                       initial=poisoned(out.shape, torch.float64), a_scale=a_scale, **layout)


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("mode", SWIGLU_MODES)
def test_cuda_matches_reference(gen, masked, dtype, mode):
    """The CUDA path (for now the interim torch path) against the reference, on the GPU."""
    w, s, a, a_scale, layout, rows, fuse, lim = layout_case(gen, masked, dtype, mode, E=6, N=96,
                                                           K=256, cap=9, max_rows=40, empty=2)
    N = w.shape[1]
    od = default_out_dtype(a)
    n_out = N // 2 if fuse else N
    dev = torch.device("cuda")
    cu = {k: v.to(dev) for k, v in layout.items()}
    out = poisoned((*rows, n_out), od).to(dev)
    got = mxfp4_grouped_gemm(a.to(dev), w.to(dev), s.to(dev), a_scale=None if a_scale is None
                             else a_scale.to(dev), fuse_swiglu=fuse, swiglu_limit=lim, out=out,
                             check=True, **cu)
    assert got.device.type == "cuda"
    assert_matches_ref(got.cpu(), a, w, s, out_dtype=od, fuse_swiglu=fuse, swiglu_limit=lim,
                       initial=poisoned((*rows, n_out), torch.float64), a_scale=a_scale, **layout)

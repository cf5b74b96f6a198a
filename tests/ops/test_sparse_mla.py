"""zeroinfer.ops.sparse_mla_attention against the float64 reference, on fresh random inputs.

Formats: float32 / bfloat16 caches and the V4 FP8 layout (from the quantizer, and raw random
bytes). The reference decodes the FP8 bytes itself, so every format is compared at float32
accuracy except where the op's own output is bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroinfer import _C
from zeroinfer.ops._backend import ptr
from zeroinfer.ops.sparse_mla import _sparse_mla_torch, sparse_mla_attention
from zeroinfer.quant.kv_fp8 import quantize_kv_fp8
from zeroinfer.reference.sparse_mla import sparse_mla_attention_ref

D = 512
FORMATS = ["f32", "bf16", "fp8", "fp8raw"]
PATTERNS = ["sorted", "random", "window", "mixed", "none"]


pytestmark = pytest.mark.usefixtures("single_torch_thread")


# --- input builders --------------------------------------------------------------------------

def make_cache(gen: torch.Generator, fmt: str, num_blocks: int, block_size: int) -> torch.Tensor:
    if fmt == "fp8raw":  # arbitrary bytes: every e4m3 code but NaN, varied scales, random pad
        nb, bs = num_blocks, block_size
        nope = torch.randint(0, 254, (nb, bs, 448), generator=gen, dtype=torch.int32)
        nope = torch.where(nope >= 0x7F, nope + 1, nope).to(torch.uint8)  # skip 0x7f and 0xff
        rope = (torch.randn(nb, bs, 64, generator=gen)).bfloat16().view(torch.uint8)
        scales = torch.randint(117, 123, (nb, bs, 8), generator=gen, dtype=torch.int32)
        # About one row in eight takes the kernels' slow dequantisation (a block scale above
        # 2^7): that block gets a scale of 2^8..2^10 and small codes (|value| <= 2^-6 * 1.875)
        # so its scores stay in the range of the others.
        slow = torch.rand(nb, bs, generator=gen) < 0.125
        blk = torch.randint(0, 7, (nb, bs), generator=gen)
        big = torch.randint(135, 138, (nb, bs), generator=gen, dtype=torch.int32)
        kept = scales.gather(2, blk[..., None])[..., 0]
        scales.scatter_(2, blk[..., None], torch.where(slow, big, kept)[..., None])
        in_blk = (torch.arange(448) // 64)[None, None, :] == blk[..., None]
        small = (nope & 0x80) | (nope & 0x0F)
        nope = torch.where(slow[..., None] & in_blk, small, nope)
        scales[..., 7] = torch.randint(0, 256, (nb, bs), generator=gen)  # pad: must be ignored
        rows = torch.cat([nope, rope], dim=-1).reshape(nb, bs * 576)
        return torch.cat([rows, scales.to(torch.uint8).reshape(nb, bs * 8)], dim=1)
    # Per-token magnitudes vary over a few octaves so the FP8 scales differ between tokens.
    mag = torch.exp2(torch.randint(-3, 4, (num_blocks, block_size, 1), generator=gen).float())
    kv = torch.randn(num_blocks, block_size, D, generator=gen) * mag
    if fmt == "f32":
        return kv
    if fmt == "bf16":
        return kv.bfloat16()
    assert fmt == "fp8"
    return quantize_kv_fp8(kv)


def num_slots(cache: torch.Tensor) -> int:
    if cache.dtype == torch.uint8:
        return cache.shape[0] * (cache.shape[1] // 584)
    return cache.shape[0] * cache.shape[1]


def make_indices(gen: torch.Generator, pattern: str, T: int, K: int, slots: int) -> torch.Tensor:
    if pattern == "none" or slots == 0:
        return torch.full((T, K), -1, dtype=torch.int32)
    if pattern == "sorted":
        idx = torch.randint(0, slots, (T, K), generator=gen).sort(dim=1).values
    elif pattern == "random":  # a small range so duplicates are common
        idx = torch.randint(0, max(1, min(slots, K // 2 + 1)), (T, K), generator=gen)
    elif pattern == "window":  # contiguous runs of slots, like a sliding window
        start = torch.randint(0, slots, (T, 1), generator=gen)
        idx = (start + torch.arange(K)) % slots
    else:
        assert pattern == "mixed"
        idx = torch.randint(0, slots, (T, K), generator=gen)
        idx = torch.where(torch.rand(T, K, generator=gen) < 0.3, -1, idx)
        if T > 1:
            idx[T // 2] = -1  # one token with no valid key at all
    return idx.to(torch.int32)


def random_scale(gen: torch.Generator) -> float:
    return D**-0.5 * float(torch.empty(1).uniform_(0.5, 3.0, generator=gen))


def assert_matches(out, lse, ref_out, ref_lse, out_dtype):
    assert out.dtype == out_dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(ref_lse)  # tokens (and heads) with no valid key
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out[empty] == 0).all()
    scale = ref_out.abs().max().item() if ref_out.numel() else 1.0
    if out_dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5 * scale)
    else:  # the op rounds its float32 result to bf16 once: half a bf16 ulp = 2^-9 relative
        torch.testing.assert_close(out.double(), ref_out, rtol=4e-3, atol=1e-4 * scale)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def run_case(gen, *, fmt, T, H, bs, K, pattern, sink, extra, q_dtype, poison=True):
    nb = max(1, (K + 2 * bs) // bs)
    cache = make_cache(gen, fmt, nb, bs)
    idx = make_indices(gen, pattern, T, K, num_slots(cache))
    q = torch.randn(T, H, D, generator=gen).to(q_dtype)
    scale = random_scale(gen)
    kw = {}
    if sink:
        kw["attn_sink"] = torch.randn(H, generator=gen) * 2
    if extra:
        bs2 = 4 if bs != 4 else 16
        K2 = K // 2 + 3
        cache2 = make_cache(gen, fmt, max(1, (K2 + bs2) // bs2), bs2)
        kw["extra_kv_cache"] = cache2
        kw["extra_indices"] = make_indices(gen, "mixed" if pattern != "none" else "none", T, K2,
                                           num_slots(cache2))
    out_buf = lse_buf = None
    if poison:
        out_buf = torch.full((T, H, D), float("nan"), dtype=q_dtype)
        lse_buf = torch.full((T, H), float("nan"))
        kw.update(out=out_buf, lse=lse_buf)
    out, lse = sparse_mla_attention(q, cache, idx, scale, **kw)
    if poison:
        assert out is out_buf and lse is lse_buf
    kw.pop("out", None), kw.pop("lse", None)
    ref_out, ref_lse = sparse_mla_attention_ref(q, cache, idx, scale, **kw)
    assert_matches(out, lse, ref_out, ref_lse, q_dtype)
    return out, lse


# --- against the reference -------------------------------------------------------------------

SHAPES = [  # T, H, block_size, K
    (0, 8, 16, 7),
    (1, 1, 1, 1),
    (1, 64, 64, 200),
    (3, 8, 16, 64),
    (17, 16, 1, 7),
    (3, 128, 16, 64),
    (1, 16, 64, 0),
    (17, 1, 64, 200),
    (3, 5, 16, 33),
]


@pytest.mark.parametrize("T,H,bs,K", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_matches_reference(gen, T, H, bs, K, fmt, pattern):
    q_dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    run_case(gen, fmt=fmt, T=T, H=H, bs=bs, K=K, pattern=pattern, sink=False, extra=False,
             q_dtype=q_dtype, poison=pattern != "sorted")


@pytest.mark.parametrize("T,H,bs,K", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sink,extra", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("pattern", ["window", "mixed", "none"])
def test_sink_and_extra_cache(gen, T, H, bs, K, fmt, sink, extra, pattern):
    q_dtype = torch.bfloat16 if fmt in ("bf16", "fp8raw") else torch.float32
    run_case(gen, fmt=fmt, T=T, H=H, bs=bs, K=K, pattern=pattern, sink=sink, extra=extra,
             q_dtype=q_dtype)


@pytest.mark.parametrize("fmt,q_dtype", [("f32", torch.bfloat16), ("fp8", torch.bfloat16),
                                         ("bf16", torch.float32), ("fp8raw", torch.float32)])
def test_q_and_cache_dtypes_mix(gen, fmt, q_dtype):
    run_case(gen, fmt=fmt, T=3, H=16, bs=16, K=64, pattern="mixed", sink=True, extra=True,
             q_dtype=q_dtype)


def test_all_invalid_gives_zero_and_neg_inf(gen):
    cache = make_cache(gen, "fp8", 4, 16)
    q = torch.randn(3, 8, D, generator=gen)
    idx = torch.full((3, 10), -1, dtype=torch.int32)
    extra_idx = torch.full((3, 4), -1, dtype=torch.int32)
    for sink in (None, torch.randn(8, generator=gen)):
        out = torch.full((3, 8, D), float("nan"))
        lse = torch.full((3, 8), float("nan"))
        sparse_mla_attention(q, cache, idx, 0.1, attn_sink=sink, extra_kv_cache=cache,
                             extra_indices=extra_idx, out=out, lse=lse)
        assert (out == 0).all() and torch.isneginf(lse).all()


def test_duplicates_count_twice(gen):
    """A slot listed twice weighs like two keys: same result as a cache holding it twice."""
    kv = torch.randn(1, 4, D, generator=gen)
    q = torch.randn(2, 4, D, generator=gen)
    dup = torch.tensor([[0, 1, 1], [2, 2, 2]], dtype=torch.int32)
    kv2 = torch.cat([kv[0, [0, 1, 1]], kv[0, [2, 2, 2]]]).reshape(2, 3, D)
    distinct = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    a = sparse_mla_attention(q, kv, dup, 0.05)
    b = sparse_mla_attention(q, kv2, distinct, 0.05)
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-6)
    # and lse grows by log 2 against the de-duplicated list of row 1
    single = sparse_mla_attention(q[1:], kv, torch.tensor([[2]], dtype=torch.int32), 0.05)
    torch.testing.assert_close(a[1][1], single[1][0] + math.log(3), rtol=1e-6, atol=1e-6)


def test_deterministic(gen):
    cache = make_cache(gen, "fp8", 8, 16)
    q = torch.randn(5, 64, D, generator=gen).bfloat16()
    idx = make_indices(gen, "mixed", 5, 150, num_slots(cache))
    a = sparse_mla_attention(q, cache, idx, 0.05)
    b = sparse_mla_attention(q, cache, idx, 0.05)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# --- properties ------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 4), H=st.sampled_from([1, 4, 13]),
       K=st.integers(1, 90), fmt=st.sampled_from(FORMATS), sink=st.booleans())
def test_permuting_indices_changes_nothing(seed, T, H, K, fmt, sink):
    gen = torch.Generator().manual_seed(seed)
    cache = make_cache(gen, fmt, 4, 16)
    idx = make_indices(gen, "mixed", T, K, num_slots(cache))
    q = torch.randn(T, H, D, generator=gen)
    s = torch.randn(H, generator=gen) if sink else None
    perm = torch.argsort(torch.rand(T, K, generator=gen), dim=1)
    a_out, a_lse = sparse_mla_attention(q, cache, idx, 0.06, attn_sink=s)
    b_out, b_lse = sparse_mla_attention(q, cache, idx.gather(1, perm), 0.06, attn_sink=s)
    torch.testing.assert_close(b_out, a_out, rtol=1e-5, atol=1e-5 * a_out.abs().max().item())
    torch.testing.assert_close(b_lse, a_lse, rtol=1e-5, atol=1e-5)


def reblock(kv_tokens: torch.Tensor, block_size: int, fmt: str) -> torch.Tensor:
    """The same tokens (slot s = token s) in a cache with another block size."""
    n = kv_tokens.shape[0]
    nb = -(-n // block_size)
    padded = torch.cat([kv_tokens, torch.zeros(nb * block_size - n, D)]).reshape(nb, block_size, D)
    return {"f32": padded, "bf16": padded.bfloat16(), "fp8": quantize_kv_fp8(padded)}[fmt]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 4), H=st.sampled_from([1, 8, 11]),
       K=st.integers(0, 100), fmt=st.sampled_from(["f32", "bf16", "fp8"]),
       bs1=st.sampled_from([1, 3, 16]), bs2=st.sampled_from([2, 64]), data=st.data())
def test_splitting_keys_between_caches(seed, T, H, K, fmt, bs1, bs2, data):
    """One list over one cache == the list split between a main and an extra cache holding the
    same tokens (with other block sizes)."""
    split = data.draw(st.integers(0, K))
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randn(50, D, generator=gen)
    idx = make_indices(gen, "mixed", T, K, 50)
    q = torch.randn(T, H, D, generator=gen)
    one = sparse_mla_attention(q, reblock(tokens, 8, fmt), idx, 0.05)
    two = sparse_mla_attention(q, reblock(tokens, bs1, fmt), idx[:, :split].contiguous(), 0.05,
                               extra_kv_cache=reblock(tokens, bs2, fmt),
                               extra_indices=idx[:, split:].contiguous())
    torch.testing.assert_close(two[0], one[0], rtol=1e-5, atol=1e-5 * one[0].abs().max().item())
    torch.testing.assert_close(two[1], one[1], rtol=1e-5, atol=1e-5)


# --- the interim torch path (the CUDA path until the Hopper kernel), run on CPU here ---------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T,H,K", [(1, 64, 200), (3, 8, 0), (17, 4, 7)])
def test_interim_torch_path_on_cpu(gen, fmt, T, H, K):
    cache = make_cache(gen, fmt, 8, 16)
    idx = make_indices(gen, "mixed", T, K, num_slots(cache))
    cache2 = make_cache(gen, fmt, 3, 4)
    idx2 = make_indices(gen, "window", T, 5, num_slots(cache2))
    q = torch.randn(T, H, D, generator=gen)
    sink = torch.randn(H, generator=gen)
    out = torch.full((T, H, D), float("nan"))
    lse = torch.full((T, H), float("nan"))
    _sparse_mla_torch(q, cache, idx, 0.05, attn_sink=sink, extra_kv_cache=cache2,
                      extra_indices=idx2, out=out, lse=lse)
    ref = sparse_mla_attention_ref(q, cache, idx, 0.05, attn_sink=sink, extra_kv_cache=cache2,
                                   extra_indices=idx2)
    assert_matches(out, lse, *ref, torch.float32)


# The CUDA kernel's tests are in test_sparse_mla_cuda.py.


# --- argument validation ---------------------------------------------------------------------

def base_args():
    T, H = 2, 4
    return dict(
        q=torch.randn(T, H, D),
        kv_cache=torch.randn(3, 16, D),
        indices=torch.tensor([[0, 5, -1, 47, 3], [1, 1, 2, -1, -1]], dtype=torch.int32),
        softmax_scale=0.05,
        attn_sink=torch.randn(H),
        extra_kv_cache=torch.randn(2, 4, D),
        extra_indices=torch.tensor([[0, 7], [-1, 3]], dtype=torch.int32),
        out=torch.empty(T, H, D),
        lse=torch.empty(T, H),
    )


def fp8_args():
    a = base_args()
    a["kv_cache"] = quantize_kv_fp8(a["kv_cache"])
    a["extra_kv_cache"] = quantize_kv_fp8(a["extra_kv_cache"])
    return a


def noncontig(t):
    return t.transpose(0, 1).contiguous().transpose(0, 1) if t.dim() > 1 else t.repeat(2)[::2]


def shared_storage_lse(a):
    """lse overlapping out's memory (disjoint slices of one buffer are legal)."""
    buf = torch.empty(a["out"].numel())
    a["out"] = buf.view(a["out"].shape)
    a["lse"] = buf[: a["lse"].numel()].view(a["lse"].shape)


BAD = [  # (name, mutate(args), exception, match)
    ("q-type", lambda a: a.update(q=a["q"].tolist()), TypeError, "q"),
    ("q-dtype", lambda a: a.update(q=a["q"].half()), TypeError, "q"),
    ("q-ndim", lambda a: a.update(q=a["q"].reshape(8, D)), ValueError, "q"),
    ("q-dim", lambda a: a.update(q=a["q"][..., :256].contiguous()), ValueError, "q"),
    ("q-noncontig", lambda a: a.update(q=noncontig(a["q"])), ValueError, "q"),
    ("q-no-heads", lambda a: a.update(q=torch.randn(2, 0, D)), ValueError, "q"),
    ("kv-dtype", lambda a: a.update(kv_cache=a["kv_cache"].double()), TypeError, "kv_cache"),
    ("kv-int", lambda a: a.update(kv_cache=a["kv_cache"].int()), TypeError, "kv_cache"),
    ("kv-ndim", lambda a: a.update(kv_cache=a["kv_cache"].reshape(48, D)), ValueError, "kv_cache"),
    ("kv-dim", lambda a: a.update(kv_cache=torch.randn(3, 16, 576)), ValueError, "kv_cache"),
    ("kv-noncontig", lambda a: a.update(kv_cache=noncontig(a["kv_cache"])), ValueError, "kv_cache"),
    ("kv-meta", lambda a: a.update(kv_cache=a["kv_cache"].to("meta")), ValueError, "kv_cache"),
    ("kv-block0", lambda a: a.update(kv_cache=torch.randn(3, 0, D)), ValueError, "kv_cache"),
    ("kv-fp8-584", lambda a: a.update(kv_cache=torch.zeros(3, 16 * 584 - 8, dtype=torch.uint8)),
     ValueError, "kv_cache.*584"),
    ("kv-fp8-ndim", lambda a: a.update(kv_cache=torch.zeros(3, 16, 584, dtype=torch.uint8)),
     ValueError, "kv_cache"),
    ("kv-fp8-empty", lambda a: a.update(kv_cache=torch.zeros(3, 0, dtype=torch.uint8)),
     ValueError, "kv_cache"),
    ("kv-fp8-noncontig",
     lambda a: a.update(kv_cache=torch.zeros(16 * 584, 3, dtype=torch.uint8).t()),
     ValueError, "kv_cache"),
    ("idx-dtype", lambda a: a.update(indices=a["indices"].long()), TypeError, "indices"),
    ("idx-rows", lambda a: a.update(indices=a["indices"][:1].contiguous()), ValueError, "indices"),
    ("idx-ndim", lambda a: a.update(indices=a["indices"].reshape(-1)), ValueError, "indices"),
    ("idx-noncontig", lambda a: a.update(indices=noncontig(a["indices"])), ValueError, "indices"),
    ("idx-meta", lambda a: a.update(indices=a["indices"].to("meta")), ValueError, "indices"),
    ("idx-high", lambda a: a["indices"].__setitem__((1, 0), 48), ValueError, "indices"),
    ("idx-low", lambda a: a["indices"].__setitem__((0, 2), -2), ValueError, "indices"),
    ("scale-zero", lambda a: a.update(softmax_scale=0.0), ValueError, "softmax_scale"),
    ("scale-neg", lambda a: a.update(softmax_scale=-0.1), ValueError, "softmax_scale"),
    ("scale-nan", lambda a: a.update(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("scale-inf", lambda a: a.update(softmax_scale=float("inf")), ValueError, "softmax_scale"),
    ("scale-str", lambda a: a.update(softmax_scale="0.1"), TypeError, "softmax_scale"),
    ("scale-tensor", lambda a: a.update(softmax_scale=torch.tensor(0.1)), TypeError,
     "softmax_scale"),
    ("sink-dtype", lambda a: a.update(attn_sink=a["attn_sink"].double()), TypeError, "attn_sink"),
    ("sink-shape", lambda a: a.update(attn_sink=torch.randn(5)), ValueError, "attn_sink"),
    ("sink-ndim", lambda a: a.update(attn_sink=torch.randn(1, 4)), ValueError, "attn_sink"),
    ("sink-noncontig", lambda a: a.update(attn_sink=noncontig(a["attn_sink"])), ValueError,
     "attn_sink"),
    ("sink-meta", lambda a: a.update(attn_sink=a["attn_sink"].to("meta")), ValueError,
     "attn_sink"),
    ("extra-only-cache", lambda a: a.update(extra_indices=None), ValueError, "extra_kv_cache"),
    ("extra-only-idx", lambda a: a.update(extra_kv_cache=None), ValueError, "extra_indices"),
    ("extra-format", lambda a: a.update(extra_kv_cache=a["extra_kv_cache"].bfloat16()), TypeError,
     "extra_kv_cache"),
    ("extra-fp8-mix", lambda a: a.update(extra_kv_cache=quantize_kv_fp8(a["extra_kv_cache"])),
     TypeError, "extra_kv_cache"),
    ("extra-dim", lambda a: a.update(extra_kv_cache=torch.randn(2, 4, 64)), ValueError,
     "extra_kv_cache"),
    ("extra-meta", lambda a: a.update(extra_kv_cache=a["extra_kv_cache"].to("meta")), ValueError,
     "extra_kv_cache"),
    ("extra-idx-dtype", lambda a: a.update(extra_indices=a["extra_indices"].long()), TypeError,
     "extra_indices"),
    ("extra-idx-rows", lambda a: a.update(extra_indices=torch.zeros(3, 2, dtype=torch.int32)),
     ValueError, "extra_indices"),
    ("extra-idx-noncontig", lambda a: a.update(extra_indices=noncontig(a["extra_indices"])),
     ValueError, "extra_indices"),
    ("extra-idx-high", lambda a: a["extra_indices"].__setitem__((0, 1), 8), ValueError,
     "extra_indices"),
    ("out-dtype", lambda a: a.update(out=a["out"].bfloat16()), TypeError, "out"),
    ("out-shape", lambda a: a.update(out=torch.empty(2, 4, 256)), ValueError, "out"),
    ("out-noncontig", lambda a: a.update(out=noncontig(a["out"])), ValueError, "out"),
    ("out-meta", lambda a: a.update(out=a["out"].to("meta")), ValueError, "out"),
    ("out-alias-q", lambda a: a.update(out=a["q"]), ValueError, "out"),
    ("lse-dtype", lambda a: a.update(lse=a["lse"].double()), TypeError, "lse"),
    ("lse-shape", lambda a: a.update(lse=torch.empty(2, 5)), ValueError, "lse"),
    ("lse-noncontig", lambda a: a.update(lse=noncontig(a["lse"])), ValueError, "lse"),
    ("lse-alias-out", shared_storage_lse, ValueError, "lse"),
    ("check-type", lambda a: a.update(check_indices="yes"), TypeError, "check_indices"),
]


@pytest.mark.parametrize("name,mutate,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments(name, mutate, exc, match):
    a = base_args()
    sparse_mla_attention(**a)  # the base case is valid
    mutate(a)
    with pytest.raises(exc, match=rf"\b{match}\b"):
        sparse_mla_attention(**a)


FP8_BAD = [b for b in BAD if b[0].startswith(("q-", "idx-", "extra-idx-", "out-", "lse-"))]


@pytest.mark.parametrize("name,mutate,exc,match", FP8_BAD, ids=[b[0] for b in FP8_BAD])
def test_bad_arguments_fp8_caches(name, mutate, exc, match):
    a = fp8_args()  # same slot counts as base_args, in the FP8 layout
    sparse_mla_attention(**a)
    mutate(a)
    with pytest.raises(exc, match=rf"\b{match}\b"):
        sparse_mla_attention(**a)


def test_kernel_rejects_out_of_range_slot_itself(gen):
    """Last line of defence: the C++ twin checks slots even if the Python layer were bypassed."""
    q = torch.randn(1, 4, D, generator=gen)
    kv = torch.randn(2, 4, D, generator=gen)
    idx = torch.tensor([[0, 8]], dtype=torch.int32)
    out, lse = torch.empty(1, 4, D), torch.empty(1, 4)
    with pytest.raises(ValueError, match="slot 8 outside"):
        _C.sparse_mla_attention_cpu(
            q=ptr(q), q_dtype=0, num_tokens=1, num_heads=4, q_stride_token=4 * D,
            q_stride_head=D, kv=ptr(kv), kv_dtype=0, kv_num_blocks=2, kv_block_size=4,
            kv_block_stride_bytes=4 * D * 4, indices=ptr(idx), topk=2, indices_stride=2,
            softmax_scale=0.1, out=ptr(out), out_stride_token=4 * D, out_stride_head=D,
            lse=ptr(lse), lse_stride_token=4)


def test_e4m3_bit_move_model():
    """The CUDA kernels' fast FP8 dequantisation (e4m3x2_as_bf16x2_shifted in sparse_mla.cu):
    prmt with a sign-replicated byte, an arithmetic shift by 4 and a mask, modelled in int64 for
    every pair of e4m3 codes and both byte placements, must give the bf16 bits of value * 2^-120
    (then the kernel's exact multiply by a power of two restores the scale). The GPU tests check
    the kernel itself; this pins the bit trick its comment relies on."""
    codes = torch.arange(256, dtype=torch.int64)
    lo, hi = codes.repeat_interleave(256), codes.repeat(256)
    finite = ((lo & 0x7F) != 0x7F) & ((hi & 0x7F) != 0x7F)  # e4m3fn NaN codes excluded
    lo, hi = lo[finite], hi[finite]

    def expected(b):
        v = b.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64) * 2.0**-120
        return v.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF

    for lo_byte, hi_byte in ((0, 1), (2, 3)):
        word = (lo << (8 * lo_byte)) | (hi << (8 * hi_byte))
        byte = lambda i: (word >> (8 * i)) & 0xFF  # noqa: E731
        sign_rep = torch.where(byte(lo_byte) >= 0x80, 0xFF, 0)
        a = (byte(hi_byte) << 24) | (sign_rep << 16) | (byte(lo_byte) << 8)  # prmt, byte 0 zero
        a_signed = torch.where(a >= 2**31, a - 2**32, a)
        out = (a_signed >> 4) & 0x87F087F0  # shr.s32 then the mask
        assert torch.equal(out & 0xFFFF, expected(lo))
        assert torch.equal((out >> 16) & 0xFFFF, expected(hi))

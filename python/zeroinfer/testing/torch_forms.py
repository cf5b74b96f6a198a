"""The torch forms the model had before its one-launch ops (mhc_collapse, mhc_mix, rope_rotate;
python/zeroinfer/model/ at 9c1fbd3; rms_norm at 4b3af3e; moe_route at session 38's start). The
first three ops must give these forms' bits: the tests assert it and the benchmarks check it
before timing, against these one copies. rms_norm sums its squares in its own fixed order, so it
matches its forms to rounding; moe_route picks the same experts (in descending order, where
the form keeps torch.topk's) with the same weights to rounding."""

from __future__ import annotations

import torch


def torch_collapse(pre, streams):
    """float32 products and sums, streams in order, one cast at the end."""
    out = pre[:, 0, None] * streams[:, 0].float()
    for n in range(1, streams.shape[1]):
        out = out + pre[:, n, None] * streams[:, n].float()
    return out.to(streams.dtype)


def torch_mix(streams, out, post, comb):
    """post / comb cast to the streams' dtype, each op rounding."""
    dtype = streams.dtype
    comb = comb.to(dtype)
    mixed = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)
    for j in range(streams.shape[1]):
        mixed = mixed + comb[:, j, :, None] * streams[:, j, None, :]
    return mixed


def torch_rope(x, cos, sin):
    """The trailing 2 * cos.shape[-1] channels rotated in interleaved pairs, in float32."""
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.float().view(shape), sin.float().view(shape)
    rope = x[..., -r:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    out = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], out.to(x.dtype)], dim=-1)


def torch_rms_norm(x, weight, eps):
    """HF's weighted RMS norm: float32 throughout, the weight's product last, one cast."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def torch_rms_norm_unweighted(x, eps):
    """No weight: the factor cast to x's dtype, the product in it."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def torch_moe_route(logits, k, scale, bias):
    """The router's torch form after its linear layer (python/zeroinfer/model/moe.py before
    moe_route): scores in the logits' dtype, unsorted top-k, renormalised weights."""
    scores = torch.nn.functional.softplus(logits).sqrt()
    ids = torch.topk(scores + bias, k, dim=-1, sorted=False).indices
    w = scores.gather(1, ids)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale
    return ids.to(torch.int32), w.float()

"""mHC hyper-connections in three launches: the mixes (pre, post and the Sinkhorn-normalised comb
matrix) from the connection's projection, the collapse of the residual streams into the block's
input, and the mix of the block's output back into the streams.

Per token, z = [z_pre (N) | z_post (N) | z_comb (N*N, row-major)] and base likewise:

    pre  = sigmoid(z_pre * scale[0] + base_pre) + eps
    post = 2 * sigmoid(z_post * scale[1] + base_post)
    C    = softmax(z_comb * scale[2] + base_comb, dim=-1) + eps
    C    = C / (C.sum(-2) + eps)                          # columns first
    iters - 1 times: C = C / (C.sum(-1) + eps); C = C / (C.sum(-2) + eps)

In torch this is ~6 * iters + 20 small ops a hyper-connection (V4: iters = 20, two a layer), which
on a GPU decode step cost a launch each; the kernel computes each token alone, so the result does
not depend on the batch either.

Applying them (mhc_collapse, mhc_mix) is elementwise, with the roundings of the torch form the
model had (each product and partial sum rounded to the streams' dtype, streams summed in order,
no fused multiply-adds), so the kernels give that form's bits on CPU and CUDA alike:

    collapse   x[t]    = sum_n pre[t, n] * streams[t, n]                   (float32, then cast)
    mix        y[t, k] = post[t, k] * out[t] + sum_j comb[t, j, k] * streams[t, j]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zeroinfer import _C
from zeroinfer.ops._backend import dtype_code, ptr, stream_of, use_cuda
from zeroinfer.ops._checks import check_float, check_no_alias, check_positive_int, check_tensor

MHC_MAX_STREAMS: int = _C.MHC_MAX_STREAMS


class MhcMixes(NamedTuple):
    pre: torch.Tensor   # [T, N] float32
    post: torch.Tensor  # [T, N] float32
    comb: torch.Tensor  # [T, N, N] float32, C[i, j] (the residual mix uses C transposed)


def mhc_mixes(
    z: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    streams: int,
    iters: int,
    eps: float,
    out: MhcMixes | None = None,
) -> MhcMixes:
    """pre, post and comb of one hyper-connection for T tokens (definition in the module doc).

    z [T, (2 + N) * N], scale [3] and base [(2 + N) * N]: float32, contiguous, one device.
    streams = N in 1..MHC_MAX_STREAMS (V4: 4); iters >= 1 Sinkhorn iterations (V4: 20);
    eps >= 0. Returns new tensors, or fills `out`.
    """
    op = "mhc_mixes"
    f32 = (torch.float32,)
    n = check_positive_int(op, "streams", streams)
    if n > MHC_MAX_STREAMS:
        raise ValueError(f"{op}: streams must be <= {MHC_MAX_STREAMS}, got {n}")
    iters = check_positive_int(op, "iters", iters)
    eps = check_float(op, "eps", eps)
    if eps < 0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")
    width = (2 + n) * n
    check_tensor(op, "z", z, dtypes=f32, shape=(None, width))
    dev = z.device
    check_tensor(op, "scale", scale, dtypes=f32, shape=(3,), device=dev)
    check_tensor(op, "base", base, dtypes=f32, shape=(width,), device=dev)
    tokens = z.shape[0]
    if out is None:
        out = MhcMixes(z.new_empty(tokens, n), z.new_empty(tokens, n), z.new_empty(tokens, n, n))
    else:
        shapes = ((tokens, n), (tokens, n), (tokens, n, n))
        for name, t, shape in zip(MhcMixes._fields, out, shapes):
            check_tensor(op, f"out.{name}", t, dtypes=f32, shape=shape, device=dev)
        check_no_alias(op, {f"out.{k}": t for k, t in zip(MhcMixes._fields, out)},
                       {"z": z, "scale": scale, "base": base})
    _C.mhc_mixes(use_cuda(dev, op), tokens, n, iters, eps, ptr(z), ptr(scale), ptr(base),
                 ptr(out.pre), ptr(out.post), ptr(out.comb), stream_of(dev))
    return out


def _check_streams(op: str, streams: torch.Tensor) -> tuple[int, int, int]:
    check_tensor(op, "streams", streams, dtypes=(torch.float32, torch.bfloat16), ndim=3)
    tokens, n, dim = streams.shape
    if not 1 <= n <= MHC_MAX_STREAMS:
        raise ValueError(f"{op}: streams must have 1..{MHC_MAX_STREAMS} streams (dim 1), got "
                         f"shape {tuple(streams.shape)}")
    return tokens, n, dim


def mhc_collapse(pre: torch.Tensor, streams: torch.Tensor, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The block input sum_n pre[:, n] * streams[:, n] [T, D] in the streams' dtype.

    pre [T, N] float32; streams [T, N, D] float32 or bfloat16, N in 1..MHC_MAX_STREAMS; both
    contiguous, one device. Returns a new tensor, or fills `out`.
    """
    op = "mhc_collapse"
    tokens, n, dim = _check_streams(op, streams)
    dev = streams.device
    check_tensor(op, "pre", pre, dtypes=(torch.float32,), shape=(tokens, n), device=dev)
    if out is None:
        out = streams.new_empty(tokens, dim)
    else:
        check_tensor(op, "out", out, dtypes=(streams.dtype,), shape=(tokens, dim), device=dev)
        check_no_alias(op, {"out": out}, {"pre": pre, "streams": streams})
    _C.mhc_collapse(use_cuda(dev, op), tokens, n, dim, dtype_code(streams), ptr(pre),
                    ptr(streams), ptr(out), stream_of(dev))
    return out


def mhc_mix(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The new streams [T, N, D]: stream k = post[:, k] * block_out + sum_j comb[:, j, k] *
    streams[:, j], in the streams' dtype (definition in the module doc).

    streams [T, N, D] float32 or bfloat16; block_out [T, D] of the same dtype; post [T, N] and
    comb [T, N, N] float32 (mhc_mixes' outputs); all contiguous, one device. Returns a new
    tensor, or fills `out` (which must not overlap the inputs).
    """
    op = "mhc_mix"
    tokens, n, dim = _check_streams(op, streams)
    dev = streams.device
    check_tensor(op, "block_out", block_out, dtypes=(streams.dtype,), shape=(tokens, dim),
                 device=dev)
    check_tensor(op, "post", post, dtypes=(torch.float32,), shape=(tokens, n), device=dev)
    check_tensor(op, "comb", comb, dtypes=(torch.float32,), shape=(tokens, n, n), device=dev)
    if out is None:
        out = torch.empty_like(streams)
    else:
        check_tensor(op, "out", out, dtypes=(streams.dtype,), shape=(tokens, n, dim), device=dev)
        check_no_alias(op, {"out": out},
                       {"streams": streams, "block_out": block_out, "post": post, "comb": comb})
    _C.mhc_mix(use_cuda(dev, op), tokens, n, dim, dtype_code(streams), ptr(post), ptr(comb),
               ptr(streams), ptr(block_out), ptr(out), stream_of(dev))
    return out

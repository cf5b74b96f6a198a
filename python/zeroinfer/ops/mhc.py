"""The mixes of an mHC hyper-connection (pre, post and the Sinkhorn-normalised comb matrix) from
its projection, in one kernel launch.

Per token, z = [z_pre (N) | z_post (N) | z_comb (N*N, row-major)] and base likewise:

    pre  = sigmoid(z_pre * scale[0] + base_pre) + eps
    post = 2 * sigmoid(z_post * scale[1] + base_post)
    C    = softmax(z_comb * scale[2] + base_comb, dim=-1) + eps
    C    = C / (C.sum(-2) + eps)                          # columns first
    iters - 1 times: C = C / (C.sum(-1) + eps); C = C / (C.sum(-2) + eps)

In torch this is ~6 * iters + 20 small ops a hyper-connection (V4: iters = 20, two a layer), which
on a GPU decode step cost a launch each; the kernel computes each token alone, so the result does
not depend on the batch either.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zeroinfer import _C
from zeroinfer.ops._backend import ptr, stream_of, use_cuda
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

"""mHC: manifold-constrained hyper-connections. The residual is N streams per token; each block
reads a weighted collapse of them and writes its output back through `post` and a doubly
stochastic mixing matrix C (Sinkhorn-normalised)."""

from __future__ import annotations

import torch
from torch import nn

from zeroinfer import ops
from zeroinfer.model.linear import linear, pad_rows
from zeroinfer.model.norm import rms_norm_unweighted


def f32(t: torch.Tensor) -> torch.Tensor:
    """t as float32, without a torch call where it already is (the parameters are)."""
    return t if t.dtype == torch.float32 else t.float()


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, hidden: int, iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.eps, self.norm_eps = n, iters, eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def weights(self, streams: torch.Tensor):
        """streams [T, N, D] -> (post [T, N] f32, comb [T, N, N] f32, collapsed [T, D])."""
        # Every step is row-independent (the norm and the mixes are our ops, linear pads its own
        # rows), so unlike HyperHead's sigmoid nothing here needs the rows padded.
        flat = rms_norm_unweighted(f32(streams.flatten(1)), self.norm_eps)
        z = linear(flat, f32(self.fn))
        # pre, post and the Sinkhorn-normalised comb in one launch (~130 torch calls at 20 iters).
        pre, post, comb = ops.mhc_mixes(z, f32(self.scale), f32(self.base), streams=self.n,
                                        iters=self.iters, eps=self.eps)
        return post, comb, ops.mhc_collapse(pre, streams)

    @staticmethod
    def mix(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        """New stream k = post[k] * out + sum_j comb[j, k] * streams[j] (C transposed), with HF's
        roundings (post and comb cast to the streams' dtype, every product and sum rounded),
        streams summed in order: a token's result does not depend on the batch."""
        return ops.mhc_mix(streams, out, post, comb)


class HyperHead(nn.Module):
    """Final collapse of the N streams (no Sinkhorn, no post/comb)."""

    def __init__(self, hc_mult: int, hidden: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        # Padded rows: torch's vectorised kernels (sigmoid here) round differently from their
        # scalar tail loops, so a tensor whose size is not a multiple of the vector width would
        # give the last tokens of a batch different bits than the same tokens elsewhere.
        padded, T = pad_rows(streams)
        flat = rms_norm_unweighted(f32(padded.flatten(1)), self.norm_eps)
        pre = torch.sigmoid(linear(flat, f32(self.hc_fn)) * f32(self.hc_scale)
                            + f32(self.hc_base)) + self.eps
        return ops.mhc_collapse(pre[:T], streams)

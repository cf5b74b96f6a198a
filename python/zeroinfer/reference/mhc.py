"""References for the mHC ops in float64, written from V4's definition of a hyper-connection
(../shared/reference/deepseek-v4-architecture.md section 2): the mixes one token at a time, the
collapse and the mix as whole-tensor sums."""

from __future__ import annotations

import math

import torch


def mhc_mixes_ref(z, scale, base, *, streams, iters, eps):
    """(pre [T, N], post [T, N], comb [T, N, N]) in float64 on the CPU."""
    n = streams
    z, scale, base = (t.detach().cpu().double() for t in (z, scale, base))
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    pre, post, comb = [], [], []
    for row in z.tolist():
        pre.append([sig(row[i] * scale[0].item() + base[i].item()) + eps for i in range(n)])
        post.append([2.0 * sig(row[n + i] * scale[1].item() + base[n + i].item())
                     for i in range(n)])
        logits = [[row[2 * n + r * n + k] * scale[2].item() + base[2 * n + r * n + k].item()
                   for k in range(n)] for r in range(n)]
        c = []
        for r in range(n):
            m = max(logits[r])
            e = [math.exp(v - m) for v in logits[r]]
            c.append([v / sum(e) + eps for v in e])

        def columns(c):
            sums = [sum(c[r][k] for r in range(n)) for k in range(n)]
            return [[c[r][k] / (sums[k] + eps) for k in range(n)] for r in range(n)]

        c = columns(c)
        for _ in range(iters - 1):
            c = [[v / (sum(c[r]) + eps) for v in c[r]] for r in range(n)]
            c = columns(c)
        comb.append(c)
    f64 = torch.float64
    t = len(pre)
    return (torch.tensor(pre, dtype=f64).view(t, n), torch.tensor(post, dtype=f64).view(t, n),
            torch.tensor(comb, dtype=f64).view(t, n, n))


def mhc_collapse_ref(pre, streams):
    """sum_n pre[:, n] * streams[:, n]: [T, D] float64 on the CPU."""
    pre, streams = pre.detach().cpu().double(), streams.detach().cpu().double()
    return (pre[:, :, None] * streams).sum(1)


def mhc_mix_ref(streams, block_out, post, comb):
    """y[t, k] = post[t, k] * block_out[t] + sum_j comb[t, j, k] * streams[t, j]: [T, N, D]
    float64 on the CPU."""
    streams, block_out, post, comb = (t.detach().cpu().double()
                                      for t in (streams, block_out, post, comb))
    return post[:, :, None] * block_out[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, streams)

"""FusedLinears: one GEMM for linears that share an input, their weights kept as views of the
stacked rows (so state_dict and loading are unchanged and memory is not doubled)."""

from __future__ import annotations

import torch

from zeroinfer.model.linear import FusedLinears, Linear, linear


def test_outputs_views_and_restacking(gen):
    a, b = Linear(24, 40, torch.float32), Linear(24, 8, torch.float32)
    with torch.no_grad():
        a.weight.copy_(torch.randn(40, 24, generator=gen))
        b.weight.copy_(torch.randn(8, 24, generator=gen))
    wa, wb = a.weight.detach().clone(), b.weight.detach().clone()
    fused = FusedLinears(a, b)
    x = torch.randn(5, 24, generator=gen)
    ya, yb = fused(x)
    assert ya.shape == (5, 40) and yb.shape == (5, 8)
    torch.testing.assert_close(ya, x @ wa.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(yb, x @ wb.T, atol=1e-5, rtol=1e-5)
    # the weights are now the stacked tensor's rows: same storage, same values, same names
    w = fused.weight
    assert a.weight.data_ptr() == w.data_ptr() and b.weight.data_ptr() == w[40].data_ptr()
    assert torch.equal(a.state_dict()["weight"], wa) and torch.equal(b.weight, wb)
    # loading into a linear (copy_) writes the stacked rows: the next call sees it
    with torch.no_grad():
        b.weight.copy_(torch.randn(8, 24, generator=gen))
    assert torch.equal(fused(x)[1], linear(x, w)[:, 40:])
    assert torch.equal(w[40:], b.weight)
    # replacing a weight outright: the next call stacks again, from the new weight
    new = torch.randn(40, 24, generator=gen)
    a.weight = torch.nn.Parameter(new.clone())
    ya2, _ = fused(x)
    assert fused.weight is not w and torch.equal(fused.weight[:40], new)
    torch.testing.assert_close(ya2, x @ new.T, atol=1e-5, rtol=1e-5)
    assert a.weight.data_ptr() == fused.weight.data_ptr()

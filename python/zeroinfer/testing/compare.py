"""The one comparison helper for kernel outputs against float64 references."""

from __future__ import annotations

import torch


def assert_close_to_ref(got: torch.Tensor, ref: torch.Tensor, *, tol: float, name: str = "output",
                        where: torch.Tensor | None = None) -> None:
    """max |got - ref| <= tol * max(|ref|, tiny), elementwise over `where` (a bool mask) if given.

    The error is scaled by the reference's largest magnitude (not elementwise), the right
    measure for dot-product outputs whose small entries carry the cancellation error of the big
    ones. NaN or inf in `got` where `ref` is finite always fails, as does a shape mismatch.
    """
    got = got.detach().cpu().double()
    ref = ref.detach().cpu().double()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    if where is not None:
        got, ref = got[where.cpu()], ref[where.cpu()]
    if ref.numel() == 0:
        return
    same_inf = torch.isinf(ref) & (got == ref)
    bad = ~torch.isfinite(got) & ~same_inf
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} non-finite values where the reference is finite"
    finite = torch.isfinite(ref)
    scale = max(float(ref[finite].abs().max()) if bool(finite.any()) else 0.0, 1e-30)
    err = float((got[finite] - ref[finite]).abs().max()) if bool(finite.any()) else 0.0
    assert err <= tol * scale, f"{name}: max abs error {err:.3e} > {tol:g} x max|ref| ({scale:.3e})"

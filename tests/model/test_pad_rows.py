"""linear.pad_rows: rows padded to ROW_TILE as a free view where the storage goes on past them
(empty_rows, a padded GEMM's output or a column slice of it), zero rows appended otherwise -
and a linear's real rows the same bits either way (what the room may hold never reaches them)."""

from __future__ import annotations

import pytest
import torch

from zeroinfer.model.linear import ROW_TILE, empty_rows, linear, pad_rows, tile_rows


@pytest.mark.parametrize("n", [1, 5, 16, 17])
def test_rows_with_room_extend_as_a_view(gen, n):
    x = empty_rows((n, 24), torch.float32, torch.device("cpu"))
    x.copy_(torch.randn(n, 24, generator=gen))
    p, got_n = pad_rows(x)
    assert got_n == n and p.shape == (tile_rows(n), 24) and p.shape[0] % ROW_TILE == 0
    assert p.data_ptr() == x.data_ptr() and torch.equal(p[:n], x)


def test_column_slice_of_a_padded_output_extends_as_a_view(gen):
    full = torch.randn(16, 40, generator=gen)
    gate = full[:3, 8:24]  # rows 0..2 of a column slice, the storage holding 16 rows
    p, n = pad_rows(gate)
    assert n == 3 and p.shape == (16, 16) and p.data_ptr() == gate.data_ptr()
    assert torch.equal(p, full[:, 8:24])


def test_rows_without_room_get_zero_rows(gen):
    x = torch.randn(3, 8, generator=gen)
    p, n = pad_rows(x)
    assert n == 3 and p.shape == (16, 8) and p.data_ptr() != x.data_ptr()
    assert torch.equal(p[:3], x) and not p[3:].any()
    # a slice whose storage ends before a whole tile: no view past the storage's end
    y = torch.randn(20, 8, generator=gen)[10:13]
    q, _ = pad_rows(y)
    assert q.data_ptr() != y.data_ptr() and not q[3:].any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,out_features", [(5, 64, 48), (1, 4096, 1024), (17, 512, 2048)])
def test_linear_rows_ignore_what_the_room_holds(gen, device, dtype, n, k, out_features):
    """A GEMM's real rows are the same bits whatever its padding rows hold (here NaN) - on the
    CPU's BLAS and on cuBLAS (the GPU's GEMMs at decode-like shapes)."""
    w = torch.randn(out_features, k, generator=gen).to(device, dtype)
    x = empty_rows((n, k), dtype, torch.device(device))
    x.copy_(torch.randn(n, k, generator=gen))
    x.as_strided((tile_rows(n), k), x.stride())[n:] = float("nan")  # poison the room
    want = linear(x.clone(), w)  # a plain copy: zero rows appended
    got = linear(x, w)
    assert torch.equal(got, want) and torch.isfinite(got.float()).all()

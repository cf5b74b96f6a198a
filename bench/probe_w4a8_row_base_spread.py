"""W4A8 row bases against the per-stage bases on the GPU, by the spread of a row's scale bytes:
how many outputs differ bitwise (the kernel allows row bases up to a spread of
MXFP4_ROW_BASE_SPREAD; bench/results/h200/moe_gemm_NOTES.md, session 8, says why 11 and not 14).
Builds the cases with tests/ops/test_moe_gemm_cuda.py's helpers; writes nothing.

  python3 bench/probe_w4a8_row_base_spread.py [spread ...]     (default 14 12 11 4 0)
"""

import dataclasses
import sys

import torch

sys.path.insert(0, "tests/ops")
import test_moe_gemm_cuda as T  # noqa: E402

import zeroinfer.ops.moe_gemm as mg  # noqa: E402
from zeroinfer.ops.moe_gemm import mxfp4_prepack  # noqa: E402


def forced_row_bases(pw, hi):
    """Row bases = each packed row's largest byte (the checkpoint rows mapped to packed rows the
    way mxfp4_prepack does), ignoring the spread rule."""
    _, src = mg._packed_rows(hi.shape[1], pw.fuse_swiglu, hi.device)
    rb = torch.full((hi.shape[0], src.numel()), 127, dtype=torch.uint8, device=hi.device)
    valid = src >= 0
    rb[:, valid] = hi[:, src[valid]]
    return rb.contiguous()


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("probe_w4a8_row_base_spread.py needs a CUDA GPU")
    spreads = [int(a) for a in sys.argv[1:]] or [14, 12, 11, 4, 0]
    gen = torch.Generator().manual_seed(1)
    for spread in spreads:
        for top in (120, 133):
            c = T.make_case(gen, E=6, N=320, K=512, dtype=T.FP8, masked=False,
                            counts=[0, 1, 8, 9, 40, 300], mode="plain", wlo=112, whi=130)
            off = torch.randint(0, spread + 1, c["s"].shape, generator=gen)
            c["s"] = (top - off).to(torch.uint8)
            pw = mxfp4_prepack(c["w"].cuda(), c["s"].cuda(), fuse_swiglu=c["fuse"],
                               act_dtype=T.FP8)
            if spread > T._C.MXFP4_ROW_BASE_SPREAD:  # force the row bases past the kernel's rule
                hi = c["s"].cuda().amax(-1).to(torch.uint8)
                pw = dataclasses.replace(pw, row_base=forced_row_bases(pw, hi))
            got = T.run_cuda(c, out_dtype=torch.float32, packed=pw)
            ref = T.run_cuda(c, out_dtype=torch.float32,
                             packed=dataclasses.replace(pw, row_base=None))
            diff = got.view(torch.int32) != ref.view(torch.int32)
            rel = ((got - ref).abs() / ref.abs().clamp(min=1e-30))[diff]
            print(f"spread {spread:2d} top {top}: row-based groups "
                  f"{float((pw.row_base != 0).float().mean()):.2f}, outputs differing "
                  f"{int(diff.sum())} of {diff.numel()}, max relative "
                  f"{float(rel.max()) if diff.any() else 0.0:.3g}")


if __name__ == "__main__":
    main()

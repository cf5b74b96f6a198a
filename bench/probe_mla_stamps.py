"""Where a sparse MLA CTA's time goes: clock stamps at the phase boundaries of the 64-head kernels
(sparse_mla_fp8_kernel and sparse_mla_bf16_kernel, any R), to split the fixed cost of a work item
(the index -> slot -> row chain and Q before the first tile, the output stores after the last)
from the per-tile cost, and to see the grid's launch ramp.

  python3 bench/probe_mla_stamps.py make OUT.cu     # a stamped copy of csrc/cuda/sparse_mla.cu
  python3 bench/probe_mla_stamps.py run 128:64:fp8,64:64:fp8,128:64:bf16   # under that build

`make` needs no GPU: it patches the kernels at fixed anchors (and fails loudly when one moved) so
that thread 0 of each CTA stamps its phases, and the launcher, when ZI_STAMPS is set, prints them
per slot over the CTAs (bench/stamp_probe.py: the stamps, the printing kernel). Build it beside
the tree with bench/ab_builds.sh (`bash bench/ab_builds.sh 0 true
stamps=OUT.cu@csrc/cuda/sparse_mla.cu` builds without running anything), then
`PYTHONPATH=/tmp/ab/stamps:$PYTHONPATH python3 bench/probe_mla_stamps.py run CASES` traces two
launches a case (L2 flushed before each, as bench_sparse_mla.py times them) and times the call.
A case is requests : heads : fp8 / bf16 [: s_q] at bench_sparse_mla.py's decode shapes.

Slots (thread 0): 1 after the programmatic-launch wait; 2 (FP8) tile 0's rows dequantised into
shared memory, i.e. the index -> slot -> row chain done; 3 the first tile may start (FP8: after
the prologue's barrier; bf16: tile 0's copies landed); 4 + i the end of tile i (i < 10; FP8 after
the loop's closing barrier, bf16 after its P V); 14 the outputs stored (the CTA's end); 18 the
CTA's entry on the globaltimer, relative to the grid's earliest (the launch ramp).
"""

import sys

from stamp_probe import ENTRY, head, host_launch, make as patch, trace

KERNEL = "csrc/cuda/sparse_mla.cu"
_CTAS, _SLOTS = 512, 32

# Source lines the anchors below take whole (_WAIT, _STORE: in both kernels).
_BF16_WAIT = ("      cp_async_wait<4>();  // tile it (and Q) landed for this thread's copies;"
              " it + 1's may not\n")
_FP8_BARRIER = ("    __syncthreads();  // tile it+1 and its flags complete;"
                " everyone is done with tile it and P\n")
_BF16_SMEM = ("  const auto [sQ, sK, sP, sRed, sRefs, sValid, sXchg] ="
              " smem_tiles<R, false>(smem_raw);\n")
_FP8_SMEM = "      smem_tiles<R, true>(smem_raw);\n"
_WAIT = ("  const WorkItem w = work_item<R>(a);\n"
         "  await_earlier_kernels();  // (a programmatic launch: launch.cuh)\n")
_STORE = "  store_outputs<G::kHeads, G::OT, G::C>(acc, m_run, l_run, sRed, sQ, a, w, sinks);\n"
_END = "  ZS_PUT0(14, zs_t0);\n  if (threadIdx.x == 0) ZS_END(zs_t0, zs_g0)\n}\n"  # a kernel's end

_LAUNCH = "  launch_programmatic(kernel, grid, dim3(Geom<R>::kThreads), bytes, stream, a);\n"
# The kernels' stamps are thread 0's.
_PUT0 = "#define ZS_PUT0(slot, t0) (threadIdx.x == 0 ? ZS_PUT(slot, t0) : (void)0)\n"

# (anchor, replacement) pairs, each anchor found exactly once in the kernel source.
_PATCHES = [
    ("// Warp layout of a CTA of 16 R heads (see the header comment).\n",
     head(_CTAS, _SLOTS) + _PUT0
     + "// Warp layout of a CTA of 16 R heads (see the header comment).\n"),
    # bf16 kernel
    (_BF16_SMEM + _WAIT, ENTRY + _BF16_SMEM + _WAIT + "  ZS_PUT0(1, zs_t0);\n"),
    (_BF16_WAIT, _BF16_WAIT + "      if (it == 0) ZS_PUT0(3, zs_t0);\n"),
    ("      wgmma::fence_operands(reinterpret_cast<float(&)[G::OT * 4]>(acc[0][0]));\n    }\n",
     "      wgmma::fence_operands(reinterpret_cast<float(&)[G::OT * 4]>(acc[0][0]));\n"
     "      if (it < 10) ZS_PUT0(4 + it, zs_t0);\n    }\n"),
    ("      __syncthreads();  // ... and everyone's; all warps are done with tile it-1\n",
     "      __syncthreads();  // ... and everyone's; all warps are done with tile it-1\n"
     "      if (it == 0) ZS_PUT0(3, zs_t0);\n"),
    ("      pv_issue<R>(acc, p_base, k_base, rg, cg, lane);\n      pv_wait<R>(acc);\n    }\n",
     "      pv_issue<R>(acc, p_base, k_base, rg, cg, lane);\n      pv_wait<R>(acc);\n"
     "      if (it < 10) ZS_PUT0(4 + it, zs_t0);\n    }\n"),
    ("  cp_async_wait<0>();\n\n" + _STORE + "}\n", "  cp_async_wait<0>();\n\n" + _STORE + _END),
    # FP8 kernel
    (_FP8_SMEM + _WAIT, _FP8_SMEM + ENTRY + _WAIT + "  ZS_PUT0(1, zs_t0);\n"),
    ("  store_fp8_row(rows, sK, e, q);\n  if (q == 0) sValid[e] = rows.valid;\n",
     "  store_fp8_row(rows, sK, e, q);\n  if (q == 0) sValid[e] = rows.valid;\n"
     "  ZS_PUT0(2, zs_t0);\n"),
    ("  prefetch_fp8_row<kP>(ref_load, q);\n  __syncthreads();\n",
     "  prefetch_fp8_row<kP>(ref_load, q);\n  __syncthreads();\n  ZS_PUT0(3, zs_t0);\n"),
    (_FP8_BARRIER + "  }\n\n" + _STORE + "}\n",
     _FP8_BARRIER + "    if (it < 10) ZS_PUT0(4 + it, zs_t0);\n  }\n\n" + _STORE + _END),
    # the launcher
    (_LAUNCH, host_launch(_LAUNCH, "grid.x * grid.y * grid.z", _CTAS, _SLOTS)),
]


def make(out: str) -> None:
    patch(KERNEL, _PATCHES, out)


def run(cases: str) -> None:
    import torch
    from bench_sparse_mla import make_inputs

    from zeroinfer.ops import sparse_mla_attention

    for case in cases.split(","):
        parts = case.split(":")
        b, h, fmt = int(parts[0]), int(parts[1]), parts[2]
        s_q = int(parts[3]) if len(parts) > 3 else 1
        gen = torch.Generator(device="cuda").manual_seed(0)
        a, _ = make_inputs(b * s_q, h, fmt, "cuda", gen, s_q=s_q)
        trace(case, lambda a=a: sparse_mla_attention(**a))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        sys.exit(__doc__)

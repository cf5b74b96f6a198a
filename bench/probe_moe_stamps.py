"""Where a float8 wide-tile CTA's time goes: clock stamps at its phase boundaries (the method of
moe_gemm_NOTES.md sessions 18 and 23).

  python3 bench/probe_moe_stamps.py make OUT.cu [nowarm]   # a stamped copy of csrc/cuda/moe_gemm.cu
  python3 bench/probe_moe_stamps.py run gate_up:512:skewed,down:512:skewed   # under that build

`make` needs no GPU: it patches the kernel at fixed anchors (and fails loudly when one moved)
so that consumer thread 0 and producer thread 0 stamp their phases, and the launcher, when
ZI_STAMPS is set, prints them per slot over the CTAs (bench/stamp_probe.py: the stamps, the
printing kernel). `nowarm` also drops the consumers' warm-up pass. Build it beside the
tree with bench/ab_builds.sh (`bash bench/ab_builds.sh 0 true stamps=OUT.cu` builds without
running anything), then `PYTHONPATH=/tmp/ab/stamps:$PYTHONPATH python3 bench/probe_moe_stamps.py
run CASES` traces two launches a case (L2 flushed before each) and times the kernel. Cases as
bench/ab_moe_cases.py (gemm:tokens:routing, W4A8).

Slots: consumer thread 0: 1 schedule built; pass p = 0 (the warm-up) .. 3: 2+3p first full barrier
passed, 3+3p stage loop done, 4+3p epilogue done; 15 its end. Producer thread 0, item i = 0..2:
20+6i item tile known, 21+6i first copies issued, 22+6i first weights landed, 23+6i first stage
decoded, 24+6i first stage handed over, 25+6i last stage handed over. Lane 0 of consumer warp w
(0..7): 40+w / 48+w the epilogue of the first / second item done (the next item's first full
barrier waits for the slowest warp of warpgroup 0); 18 the CTA's entry after the grid's earliest.
"""

import sys

from stamp_probe import ENTRY, head, host_launch, make as patch, trace

KERNEL = "csrc/cuda/moe_gemm.cu"
_CTAS, _SLOTS = 256, 64
_LAUNCH = "    launch_programmatic(kernel, g, b, static_cast<size_t>(smem), stream, prm);\n"

_PASS = ("(static_cast<int>((it - (static_cast<int64_t>(blockIdx.x) - gridDim.x))"
         " / gridDim.x))")

# (anchor, replacement) pairs, each anchor found exactly once in the kernel source.
_PATCHES = [
    ("// ---- the warp-specialised float8 wide tile (tokens as M) ---",
     head(_CTAS, _SLOTS) + "// ---- the warp-specialised float8 wide tile (tokens as M) ---"),
    ("  const Mxfp4CudaGemmParams& p = prm.p;\n",
     ENTRY + "  const Mxfp4CudaGemmParams& p = prm.p;\n"),
    ("  const Schedule<C> sch(p, smem + C::pipe_bytes);  // (its barrier publishes the above)\n",
     "  const Schedule<C> sch(p, smem + C::pipe_bytes);  // (its barrier publishes the above)\n"
     "  if (threadIdx.x == 0) ZS_PUT(1, zs_t0);\n"),
    ("      const ItemTile w = sch.tile_of(p, it);\n"
     "      const bool row_based = tile_row_based(w);",
     "      const ItemTile w = sch.tile_of(p, it);\n"
     "      const int zi = static_cast<int>((it - blockIdx.x) / gridDim.x);\n"
     "      const bool zs_on = ptid == 0 && zi < 3;\n"
     "      if (zs_on) ZS_PUT(20 + 6 * zi, zs_t0);\n"
     "      const bool row_based = tile_row_based(w);"),
    ("        if (st < kt_total) fill(st);\n        cp_async_commit();\n      }\n",
     "        if (st < kt_total) fill(st);\n        cp_async_commit();\n      }\n"
     "      if (zs_on) ZS_PUT(21 + 6 * zi, zs_t0);\n"),
    ("        mbar_wait(smem_u32(&weights_mb[slot]), (phases >> slot) & 1u);"
     "  // the packed weights\n",
     "        mbar_wait(smem_u32(&weights_mb[slot]), (phases >> slot) & 1u);"
     "  // the packed weights\n"
     "        if (zs_on && kt == 0) ZS_PUT(22 + 6 * zi, zs_t0);\n"),
    ("        for (int h = 0; h < kS; ++h) decode_strip(slot, decoded & 1, h);\n"
     "        ++decoded;\n",
     "        for (int h = 0; h < kS; ++h) decode_strip(slot, decoded & 1, h);\n"
     "        if (zs_on && kt == 0) ZS_PUT(23 + 6 * zi, zs_t0);\n        ++decoded;\n"),
    ("        bar_arrive(C::bar_full + 2 * slot, C::full0_count);  // warpgroup 0 (1 follows it)\n"
     "        slot = slot == C::stages - 1 ? 0 : slot + 1;\n      }\n",
     "        bar_arrive(C::bar_full + 2 * slot, C::full0_count);  // warpgroup 0 (1 follows it)\n"
     "        if (zs_on && kt == 0) ZS_PUT(24 + 6 * zi, zs_t0);\n"
     "        slot = slot == C::stages - 1 ? 0 : slot + 1;\n      }\n"
     "      if (zs_on) ZS_PUT(25 + 6 * zi, zs_t0);\n"),
    ("        bar_sync(C::bar_full + 2 * slot + cw, cw == 0 ? C::full0_count : C::full1_count);"
     "\n",
     "        bar_sync(C::bar_full + 2 * slot + cw, cw == 0 ? C::full0_count : C::full1_count);"
     "\n"
     f"        if (threadIdx.x == 0 && taken + kt_total == stop && {_PASS} < 4)\n"
     f"          ZS_PUT(2 + 3 * {_PASS}, zs_t0);\n"),
    ("    ItemTile wn = w;\n",
     f"    const int zp = {_PASS};\n"
     "    if (threadIdx.x == 0 && zp < 4) ZS_PUT(3 + 3 * zp, zs_t0);\n    ItemTile wn = w;\n"),
    ("    w = wn;\n    row_based = rbn;\n  }\n}",
     "    if (threadIdx.x == 0 && zp < 4) ZS_PUT(4 + 3 * zp, zs_t0);\n"
     "    if ((threadIdx.x & 31) == 0 && zp >= 1 && zp <= 2)\n"
     "      ZS_PUT(40 + 8 * (zp - 1) + (threadIdx.x >> 5), zs_t0);\n"
     "    w = wn;\n    row_based = rbn;\n  }\n"
     "  if (threadIdx.x == 0) {\n"
     "    ZS_PUT(15, zs_t0);\n    ZS_END(zs_t0, zs_g0)\n  }\n}"),
    (_LAUNCH, host_launch(_LAUNCH, "grid", _CTAS, _SLOTS)),
]
_NOWARM = ("for (int64_t it = static_cast<int64_t>(blockIdx.x) - gridDim.x; it < items;",
           "for (int64_t it = static_cast<int64_t>(blockIdx.x); it < items;")


def make(out: str, nowarm: bool) -> None:
    patch(KERNEL, _PATCHES + ([_NOWARM] if nowarm else []), out)


def run(cases: str) -> None:
    import torch
    from ab_moe_cases import make_case

    gen = torch.Generator().manual_seed(0)
    dgen = torch.Generator(device="cuda").manual_seed(1)
    for case in cases.split(","):
        gemm, _ = make_case(case, torch.float8_e4m3fn, gen, dgen)
        trace(case, gemm)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "make":
        make(sys.argv[2], "nowarm" in sys.argv[3:])
    elif len(sys.argv) == 3 and sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        sys.exit(__doc__)

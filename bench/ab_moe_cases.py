"""Kernel times of MXFP4 grouped-GEMM cases under whichever zeroinfer build is on PYTHONPATH, for
A/B runs of two or more builds (bench/ab_builds.sh alternates them, one build a process). Prints
one JSON line {case: [kernel_us, output checksum]}: the checksum (the bf16 outputs' bits summed)
tells whether a variant changed any result.

  python3 bench/ab_moe_cases.py gate_up:512:skewed,down:2048:uniform[,...] [bf16] [tiny_loop=N]
a case is gemm (gate_up / gate_up_plain / down, or layer: gate_up then down back to back, as
bench_moe_gemm.py's gate_up+down rows) : tokens : routing (uniform / skewed, as
bench_moe_gemm.py) [: fp8 / bf16 [: warm]]; activations are float8 (W4A8) unless the case or the
`bf16` argument says bf16. `warm` times the case without the L2 flush before each call, so the
kernel's instructions stay cached (the weights of a decode case mostly do not fit the L2 anyway):
beside the flushed case it tells what fetching cold code costs a variant. `tiny_loop=1` / `=2`
runs the float8 tiny tile's plain / skewed stage loop (zeroinfer.ops.moe_gemm._FORCE_FP8_TINY_LOOP)
instead of the device's choice: an A/B of the two in one build.
"""

import json
import sys

import torch

sys.path.insert(0, "bench")
from bench_moe_gemm import (EXPERTS, HIDDEN, INTER, LIMIT, _quant_fp8, make_weights,  # noqa: E402
                            routing_offsets)

import zeroinfer.ops.moe_gemm as mg  # noqa: E402
from zeroinfer.ops import mxfp4_grouped_gemm, mxfp4_prepack  # noqa: E402
from zeroinfer.testing import bench  # noqa: E402


def make_case(case, act, gen, dgen, packed=None, offsets=None):
    """(run, offsets) for a case gemm:tokens:routing: run() launches the grouped GEMM on fresh
    random tokens (gen draws the routing, dgen the device data). `packed` (a dict by gemm name)
    shares the prepacked weights between cases; otherwise each call prepacks its own. `offsets`
    reuses a routing (the same work on other data)."""
    name, tokens, routing = case.split(":")
    # gate_up_plain: gate_up's shape without the fused SwiGLU (plain outputs), to tell what the
    # epilogue costs from what the longer K does.
    n, k, fuse = {"gate_up": (2 * INTER, HIDDEN, True), "gate_up_plain": (2 * INTER, HIDDEN, False),
                  "down": (HIDDEN, INTER, False)}[name]
    pw = packed.get(name) if packed is not None else None
    if pw is None:
        w, s = make_weights(EXPERTS, n, k, dgen)
        pw = mxfp4_prepack(w, s, fuse_swiglu=fuse, act_dtype=act)
        del w, s
        if packed is not None:
            packed[name] = pw
    if offsets is None:
        offsets = routing_offsets(int(tokens), EXPERTS, routing == "skewed", gen).cuda()
    x = torch.randn(int(offsets[-1]), k, generator=dgen, device="cuda") * 0.5
    a, a_scale = _quant_fp8(x) if act == torch.float8_e4m3fn else (x.bfloat16(), None)

    def run(inp=None):
        return mxfp4_grouped_gemm(a if inp is None else inp, pw, None, a_scale=a_scale,
                                  expert_offsets=offsets, fuse_swiglu=fuse,
                                  swiglu_limit=LIMIT if fuse else None)

    return run, offsets


def make_layer(tokens, routing, act, gen, dgen, packed):
    """gate_up then down on the same routing: W4A16 feeds down gate_up's output (the model's
    chain), W4A8 down's own float8 input (the quantisation between them is the caller's)."""
    gate_up, offsets = make_case(f"gate_up:{tokens}:{routing}", act, gen, dgen, packed)
    down, _ = make_case(f"down:{tokens}:{routing}", act, gen, dgen, packed, offsets)
    if act == torch.bfloat16:
        return lambda: down(gate_up())
    return lambda: (gate_up(), down())[1]


def main() -> None:
    cases = sys.argv[1].split(",")
    act = torch.bfloat16 if "bf16" in sys.argv[2:] else torch.float8_e4m3fn
    for arg in sys.argv[2:]:
        if arg.startswith("tiny_loop="):
            mg._FORCE_FP8_TINY_LOOP = int(arg.partition("=")[2])
    gen = torch.Generator().manual_seed(0)
    dgen = torch.Generator(device="cuda").manual_seed(1)
    packed, res = {torch.bfloat16: {}, torch.float8_e4m3fn: {}}, {}
    for case in cases:
        parts = case.split(":")
        case_act = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[parts[3]] if len(
            parts) > 3 else act
        if parts[0] == "layer":
            run = make_layer(parts[1], parts[2], case_act, gen, dgen, packed[case_act])
        else:
            run, _ = make_case(":".join(parts[:3]), case_act, gen, dgen, packed[case_act])
        out = run()
        chk = int(out.view(torch.int16).to(torch.int64).sum())
        warm = len(parts) > 4 and parts[4] == "warm"
        res[case] = [bench.time_kernels(run, flush_l2=not warm) * 1e6, chk]
    print(json.dumps(res))


if __name__ == "__main__":
    main()

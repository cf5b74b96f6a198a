"""Static instruction count of each MXFP4 GEMM kernel's k-stage loop(s), from its SASS: the
instructions from the head to the back branch of each innermost loop that holds tensor-core
instructions (HMMA / HGMMA / QGMMA), by opcode; a kernel with two stage loops (W4A8: per-stage
and row bases) prints both, in code order. A quick, device-free check of what a change does to
the SIMT work per stage (e.g. WIP_WG_LOADS.md on branch wip/wg-load-by-warp).

  python3 bench/sass_stage_loop.py [kernel.cu] [--top N]
needs nvcc and cuobjdump + nvdisasm on PATH (pip wheels nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm carry them); compiles for sm_90a into a temporary cubin.
"""

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stage_loops(sass: str):
    """(kernel name, [instruction text]) of each innermost loop that holds tensor-core ops, in
    code order (a kernel may run one of several stage loops, e.g. the W4A8 row-base one)."""
    for func in re.split(r"\n\s*Function : ", sass)[1:]:
        name = func.split("\n", 1)[0].strip()
        ins = [(int(m.group(1), 16), m.group(2).strip())
               for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", func)]
        mma = [i for i, (_, t) in enumerate(ins) if re.search(r"\b(HMMA|HGMMA|QGMMA)\b", t)]
        loops = []  # (head index, back branch index) of each backward branch around an mma
        for j, (_, t) in enumerate(ins):
            m = re.search(r"BRA (?:`\()?0x([0-9a-f]+)", t)
            if not m or int(m.group(1), 16) >= ins[j][0]:
                continue
            head = int(m.group(1), 16)
            start = next(i for i, (a, _) in enumerate(ins) if a == head)
            if any(start <= i <= j for i in mma):
                loops.append((start, j))
        for start, j in loops:
            if not any(start <= s2 and j2 <= j and (s2, j2) != (start, j) for s2, j2 in loops):
                yield name, [t for _, t in ins[start:j + 1]]


def opcode(text: str) -> str:
    return text.split()[1] if text.startswith("@") else text.split()[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", nargs="?", default=str(ROOT / "csrc/cuda/moe_gemm.cu"))
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run(["nvcc", "-std=c++20", "-O3", "--expt-relaxed-constexpr",
                        "-gencode=arch=compute_90a,code=sm_90a", f"-I{ROOT / 'csrc/include'}",
                        "-cubin", "-o", str(cubin), args.source], check=True)
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True,
                              capture_output=True, text=True).stdout
    for name, body in stage_loops(sass):
        ops = Counter(opcode(t) for t in body)
        nops = sum(1 for t in body if t.startswith("@!PT"))
        short = re.sub(r"_ZN2zi\w*?_GLOBAL__N__\w+?(mxfp4\w+?kernel)", r"\1", name)[:90]
        print(f"{short}\n  {len(body)} instructions ({nops} never-executed @!PT), "
              + ", ".join(f"{k} {v}" for k, v in ops.most_common(args.top)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

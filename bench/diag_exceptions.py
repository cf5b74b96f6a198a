"""Which C++-exception paths out of zeroinfer._C crash this machine's Python? (README "Known
issues": on the H200 image any exception leaving _C through pybind11 segfaulted.)

  python3 bench/diag_exceptions.py [--so PATH_TO__C.so ...]

For each _C build (default: the one in python/zeroinfer) and each import order (no torch,
torch first, _C first, torch + CUDA initialised first) a CHILD process runs, one step at a time
(each step printed before it runs, so the last line before a crash names it):
  inside     _C._throw_catch_inside: throw + catch entirely inside _C (C++ runtime/unwinder only)
  guarded    _C._raise_for_test: exception caught in _C, returned as a Python error object
             (the path every binding now takes)
  unguarded  _C._raise_unguarded: pybind11's own path (throw through its dispatcher and
             exception translators) -- what every binding did before
and then the child reports the C++ runtime the process has mapped (libstdc++ / libgcc_s /
libunwind / libc++ from /proc/self/maps), which object the global lookup of __cxa_throw,
_Unwind_RaiseException, __gxx_personality_v0 resolves to (dlsym + dladdr), the pybind11
internals ids built into torch and _C, and the CET shadow-stack state. Finally, for the first
crashing (build, order), it reruns it under LD_DEBUG=bindings and prints where _C's
exception-related symbols were bound.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(r"""
    import ctypes, importlib.util, os, re, sys
    so, order, steps = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    def say(*a):
        print(*a, flush=True)
    def load_c():
        spec = importlib.util.spec_from_file_location("_C", so)
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        return m
    if order in ("torch_first", "torch_cuda_first"):
        say("step import torch"); import torch
        if order == "torch_cuda_first":
            say("step torch.cuda init"); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    say("step import _C"); C = load_c()
    if order == "c_first":
        say("step import torch"); import torch  # noqa: F401
    for step in steps:
        say("step", step)
        try:
            if step == "inside":
                say("  result", C._throw_catch_inside(10))
            elif step == "guarded":
                C._raise_for_test("invalid_argument", "guarded boom")
            elif step == "unguarded":
                C._raise_unguarded("unguarded boom")
        except Exception as e:
            say("  raised", type(e).__name__, str(e)[:60])
    # What the process has mapped, and where the C++ runtime's entry points resolve.
    libs = sorted({l.split()[-1] for l in open("/proc/self/maps") if len(l.split()) >= 6
                   and re.search(r"libstdc\+\+|libgcc_s|libunwind|libc\+\+|libcxxabi|_C\.", l)})
    for l in libs:
        say("  mapped", l)
    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]
    libdl = ctypes.CDLL(None)
    dladdr = libdl.dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    for sym in ("__cxa_throw", "_Unwind_RaiseException", "__gxx_personality_v0",
                "__cxa_begin_catch", "_Unwind_Resume"):
        try:
            addr = ctypes.cast(getattr(libdl, sym), ctypes.c_void_p).value
        except AttributeError:
            say("  global", sym, "-> (not found)"); continue
        info = DlInfo()
        dladdr(addr, ctypes.byref(info))
        say("  global", sym, "->", (info.fname or b"?").decode())
    # Every mapped object that itself DEFINES an unwinder / C++ ABI entry point (interposition
    # candidates when loaded RTLD_GLOBAL).
    objs = sorted({l.split()[-1] for l in open("/proc/self/maps") if len(l.split()) >= 6
                   and ".so" in l.split()[-1]})
    for path in objs:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        own = [s for s in ("_Unwind_RaiseException", "__cxa_throw") if hasattr(lib, s)]
        for s in own:
            info = DlInfo(); dladdr(ctypes.cast(getattr(lib, s), ctypes.c_void_p).value, ctypes.byref(info))
            if info.fname and os.path.realpath(info.fname.decode()) == os.path.realpath(path):
                say("  defines", s, path)
    try:
        st = open("/proc/self/status").read()
        say("  cet", " ".join(l for l in st.splitlines() if "x86_" in l) or "(no x86_ feature lines)")
    except OSError:
        pass
    say("done")
""")


def pybind11_ids(path: str) -> list[str]:
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    return sorted({m.decode() for m in re.findall(rb"__pybind11_internals_v[0-9A-Za-z_]+", data)})


def run_child(so: str, order: str, steps: str, env_extra: dict | None = None, timeout=300):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", CHILD, so, order, steps], capture_output=True,
                          text=True, env=env, timeout=timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--so", action="append", help="a _C*.so to test (repeatable)")
    ap.add_argument("--no-cuda", action="store_true", help="skip the torch + CUDA order")
    args = ap.parse_args()
    sos = args.so or glob.glob(str(REPO / "python/zeroinfer/_C*.so"))
    print(f"python {sys.version.split()[0]} at {sys.executable}")
    try:
        import torch

        tdir = Path(torch.__file__).parent
        print(f"torch {torch.__version__}; pybind11 internals ids in torch: "
              f"{pybind11_ids(str(next(tdir.glob('_C*.so'))))} "
              f"{pybind11_ids(str(tdir / 'lib/libtorch_python.so'))}")
        cuda_ok = torch.cuda.is_available() and not args.no_cuda
    except Exception as e:  # noqa: BLE001 - report and go on without torch
        print(f"torch not importable: {e}")
        cuda_ok = False
    orders = ["no_torch", "torch_first", "c_first"] + (["torch_cuda_first"] if cuda_ok else [])
    summary, first_crash = [], None
    # Every (build, order, path) in its own child, run 8 at a time: one crash hides nothing.
    jobs = [(so, order, steps) for so in sos for order in orders
            for steps in ("inside", "guarded", "unguarded")]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda j: run_child(*j), jobs))
    for so in sos:
        print(f"\n=== {so}\n    pybind11 ids: {pybind11_ids(so)}")
        r = subprocess.run(["ldd", so], capture_output=True, text=True)
        print("    ldd: " + "; ".join(l.strip().split(" (")[0] for l in r.stdout.splitlines()))
        for (so_, order, steps), res in zip(jobs, results):
            if so_ != so:
                continue
            lines = res.stdout.strip().splitlines()
            ok = res.returncode == 0 and lines and lines[-1] == "done"
            status = "ok" if ok else f"CRASH (exit {res.returncode}) after: {lines[-1] if lines else '-'}"
            summary.append((Path(so).parent.name, order, steps, status))
            if not ok and first_crash is None:
                first_crash = (so, order, steps)
            if steps == "unguarded" or not ok:
                print(f"--- {order} / {steps}: {status}")
                print("\n".join("    " + l for l in lines if not l.startswith("step")))
                if res.stderr.strip():
                    print("    stderr: " + res.stderr.strip()[-600:].replace("\n", "\n    "))
    print("\n=== summary")
    for build, order, steps, status in summary:
        print(f"{build:28s} {order:18s} {steps:10s} {status}")
    if first_crash:
        so, order, steps = first_crash
        print(f"\n=== LD_DEBUG=bindings for {order}/{steps} ({so}): bindings of _C's C++-runtime symbols")
        res = run_child(so, order, steps, {"LD_DEBUG": "bindings"})
        pat = re.compile(r"_C\.|zeroinfer")
        sym = re.compile(r"__cxa_|_Unwind_|__gxx_personality|_ZTI|__dynamic_cast|_ZSt9terminate")
        hits = [l.strip() for l in res.stderr.splitlines() if pat.search(l) and sym.search(l)]
        print("\n".join(hits[:60]) or "(no matching binding lines)")


if __name__ == "__main__":
    main()

"""Benchmark mxfp4_grouped_gemm against the best plain-torch path on the same inputs.

  python bench/bench_moe_gemm.py                         # CPU: the C++ twin vs torch (CPU)
  python bench/bench_moe_gemm.py --device cuda           # sm_90a kernel vs torch, roofline (H200)
  python bench/bench_moe_gemm.py --device cuda --quick   # a short self-check subset
  python bench/bench_moe_gemm.py --device cuda --tokens 128,512  # these token counts only

CUDA run (cuda_main below): V4-Flash shapes with all 256 experts, W4A16 (bf16 activations) and
W4A8 (e4m3 activations, per-token per-128 scales), 1..8192 tokens, uniform and skewed routing.
Weights are prepacked once (mxfp4_prepack, not timed). Every case is first checked against the
torch path (relative error), then timed with the L2 flushed. The JSON says what the torch
baseline includes. The description below is of the CPU run.

V4-Flash routed-expert GEMMs, bf16 activations, MXFP4 weights:
  gate_up: [rows, 4096] @ (w1 ‖ w3)[e]ᵀ, N = 2 * 2048, fused clipped SwiGLU (λ = 10) -> [rows, 2048]
  down:    [rows, 2048] @ w2[e]ᵀ, N = 4096 -> [rows, 4096]
Routing: each token picks top-6 of the experts (uniform: random scores; skewed: every token on the
same 6 experts); rows are sorted by expert (contiguous layout, as moe_dispatch produces). The CPU
run uses a subset of 16 experts (weights of all 256 do not fit a small machine); the CUDA run all
256.

The torch baseline dequantizes each active expert to float32 (byte -> value-pair table gather,
times the UE8M0 scales) and multiplies with torch.matmul, SwiGLU in torch; its time includes the
dequantization, as the kernel's does. Bytes are what a kernel must move at least: the packed
weights and scales of the active experts, the activations read and the outputs written.
"""

from __future__ import annotations


import torch

from zeroinfer import _C
import zeroinfer.ops.moe_gemm as mg
from zeroinfer.ops.moe_gemm import mxfp4_act_scale_mn_major, mxfp4_grouped_gemm, mxfp4_prepack
from zeroinfer.quant.mxfp4 import dequantize_mxfp4
from zeroinfer.testing import bench, stream_read

HIDDEN, INTER, EXPERTS, TOPK, LIMIT = 4096, 2048, 256, 6, 10.0
CUDA_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)  # the CUDA run's token counts, in draw order
CPU_EXPERTS = 16
# The CUDA kernel's tile shapes (_C.mxfp4_cuda_plan picks one from the shapes, or up to four
# split between the experts by their row counts on the device).
_TILE_NAMES = {1: "small", 2: "wide", 3: "tiny", 4: "wgmma"}


def _plan_name(fp8, m):
    launches = _C.mxfp4_cuda_plan(fp8, False, m, EXPERTS, 0, 0)
    return "|".join(_TILE_NAMES[t] + (f">={lo}" if lo else "") for t, lo in launches)


def torch_grouped(a, w, s, offsets, fuse, limit, out_dtype):
    """Best plain-torch path: per active expert, dequantize to float32 and matmul."""
    n_out = w.shape[1] // 2 if fuse else w.shape[1]
    out = torch.empty(a.shape[0], n_out, dtype=out_dtype, device=a.device)
    off = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = off[e], off[e + 1]
        if hi == lo:
            continue
        y = a[lo:hi].float() @ dequantize_mxfp4(w[e], s[e]).T
        if fuse:
            g, u = y[:, :n_out].clamp(max=limit), y[:, n_out:].clamp(-limit, limit)
            y = torch.nn.functional.silu(g) * u
        out[lo:hi] = y
    return out


def routing_offsets(tokens, num_experts, skew, gen):
    """int32 offsets [E+1] of the expert-sorted rows for top-k routing of `tokens` tokens."""
    if skew:
        ids = torch.arange(TOPK).repeat(tokens, 1)
    else:
        ids = torch.rand(tokens, num_experts, generator=gen).topk(TOPK, dim=1).indices
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)


def make_weights(num_experts, n, k, gen):
    """Random checkpoint bytes (every nibble) and scale bytes, made on gen's device."""
    dev = gen.device
    w = torch.randint(0, 256, (num_experts, n, k // 2), dtype=torch.uint8, generator=gen, device=dev)
    s = torch.randint(118, 124, (num_experts, n, k // 32), dtype=torch.uint8, generator=gen,
                      device=dev)
    return w, s


def main() -> None:
    import sys

    quick = "--quick" in sys.argv
    if quick:
        sys.argv.remove("--quick")
    only = None  # --tokens a,b: only these token counts (CUDA run; a full run's inputs)
    if "--tokens" in sys.argv:
        i = sys.argv.index("--tokens")
        try:
            only = [int(t) for t in sys.argv[i + 1].split(",")]
        except (IndexError, ValueError):
            raise SystemExit("--tokens expects comma-separated token counts, e.g. 128,512")
        del sys.argv[i:i + 2]
    args = bench.parse_args(__doc__)
    if args.device == "cuda":
        cuda_main(args, quick, only)
        return
    if only is not None:
        raise SystemExit("--tokens applies to the CUDA run (--device cuda)")
    dev = args.device
    cuda = dev == "cuda"
    num_experts = EXPERTS if cuda else CPU_EXPERTS
    tokens_list = [1, 8, 64, 512, 2048, 8192] if cuda else [1, 8, 32]
    ceilings = bench.measure_cuda_ceilings() if cuda else None
    if cuda:
        timer = bench.time_cuda
        timer_torch = lambda f: bench.time_cuda(f, warmup=2, reps=10)  # noqa: E731
    else:
        # CPU machines here are shared: other jobs come and go. Take the best of a few medians
        # (the same for both sides) so a burst of foreign load does not decide the row.
        timer = lambda f: min(bench.time_cpu(f, warmup=1, reps=5) for _ in range(3))  # noqa: E731
        timer_torch = lambda f: min(bench.time_cpu(f, warmup=0, reps=1)  # noqa: E731
                                    for _ in range(3))
    gen = torch.Generator().manual_seed(0)                 # routing (on the host)
    dgen = torch.Generator(device=dev).manual_seed(1)      # weights and activations
    gemms = {
        "gate_up": (2 * INTER, HIDDEN, True),
        "down": (HIDDEN, INTER, False),
    }
    weights = {name: make_weights(num_experts, n, k, dgen) for name, (n, k, _) in gemms.items()}
    rows = []
    for tokens in tokens_list:
        for skew in (False, True) if cuda else (False,):
            offsets = routing_offsets(tokens, num_experts, skew, gen)
            m = int(offsets[-1])
            active = int((offsets[1:] > offsets[:-1]).sum())
            offsets_dev = offsets.to(dev)
            for name, (n, k, fuse) in gemms.items():
                w, s = weights[name]
                a = (torch.randn(m, k, generator=dgen, device=dev) * 0.5).to(torch.bfloat16)
                lim = LIMIT if fuse else None
                run = lambda: mxfp4_grouped_gemm(a, w, s, expert_offsets=offsets_dev,  # noqa: E731
                                                 fuse_swiglu=fuse, swiglu_limit=lim)
                run_torch = lambda: torch_grouped(a, w, s, offsets, fuse, LIMIT,  # noqa: E731
                                                  torch.bfloat16)
                # A fast wrong kernel must not post a number: check against the torch path first.
                got, want = run().float(), run_torch().float()
                err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
                assert err < 2e-2, f"{name} tokens={tokens}: relative error {err:.3g} vs torch"
                t = timer(run)
                t_torch = timer_torch(run_torch)
                n_out = n // 2 if fuse else n
                weight_bytes = active * n * (k // 2 + k // 32)
                moved = weight_bytes + m * k * a.element_size() + m * n_out * 2
                flops = 2.0 * m * n * k
                row = {
                    "gemm": name, "tokens": tokens, "routing": "skewed" if skew else "uniform",
                    "experts": num_experts, "active": active, "rows": m, "N": n, "K": k,
                    "weight_bytes": weight_bytes,
                    **bench.roofline_row(seconds=t, bytes_moved=moved, flops=flops,
                                         ceilings=ceilings),
                    "gflops": flops / t / 1e9,
                    "torch_us": t_torch * 1e6,
                    "speedup_vs_torch": t_torch / t,
                }
                rows.append(row)
                print(f"  {name} tokens={tokens} {'skewed' if skew else 'uniform'}: "
                      f"{t * 1e6:.0f} us (torch {t_torch * 1e6:.0f} us)", flush=True)
    cols = ["gemm", "tokens", "routing", "active", "rows", "N", "K", "weight_bytes", "flops",
            "time_us", "gbps", "gflops", "torch_us", "speedup_vs_torch"]
    if cuda:
        cols += ["floor_us", "fraction_of_floor"]
    bench.print_table(rows, cols)
    extra = {"ceilings": ceilings, "threads": None if cuda else _C.num_threads(),
             "note": "CUDA: interim torch path until the Hopper kernel lands" if cuda else
             f"CPU: C++ twin; {CPU_EXPERTS} of the 256 experts present; times are the best "
             "of 3 medians (kernel) / of 3 single calls after the check call (torch) on a "
             "shared machine"}
    path = bench.write_results("moe_gemm_cuda" if cuda else "moe_gemm_cpu", rows,
                               device="cuda" if cuda else "cpu", extra=extra,
                               out_dir=args.out_dir)
    print(f"wrote {path}")


# ------------------------------------------------------------------------------------------ CUDA
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _dequant_bf16(w, s):
    """[G, N, K/2] e2m1 pairs + [G, N, K/32] UE8M0 -> bf16 [G, N, K], exactly (torch ops)."""
    v = torch.tensor(_E2M1, dtype=torch.bfloat16, device=w.device)
    lut = torch.stack([v.repeat(16), v.repeat_interleave(16)], dim=-1)  # byte -> (lo, hi)
    g, n, kh = w.shape
    vals = lut[w.to(torch.int32)].reshape(g, n, kh // 16, 32)
    sc = torch.exp2(s.float() - 127).to(torch.bfloat16)  # exact (bf16 has float32's range)
    return (vals * sc[..., None]).reshape(g, n, kh * 2)


def _swiglu_torch(y, n_out, limit):
    g, u = y[:, :n_out].float(), y[:, n_out:].float()
    return (torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit))


def _quant_fp8(x):
    """bf16/float [m, k] -> (e4m3 [m, k], float32 per-token per-128 scales [m, k/128]), the
    scales token-contiguous (mxfp4_act_scale_mn_major: the layout the prefill tile reads
    fastest; an activation quantiser writes it directly)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 128, 128)
    scale = (xb.abs().amax(-1) / 448.0).clamp(min=1e-12)
    q = (xb / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(m, k)
    return q, mxfp4_act_scale_mn_major(scale)


class TorchPath:
    """Best plain-torch path on the same inputs: dequantize the ACTIVE experts' MXFP4 weights to
    bf16 (exact), dequantize e4m3 activations to bf16 (W4A8), then one torch._grouped_mm over the
    expert segments (a per-expert matmul loop where _grouped_mm is unavailable or refuses the
    shapes), clipped SwiGLU in float32. Its time includes both dequantizations."""

    def __init__(self, kind: str | None = None):
        self.kind = kind or ("grouped_mm" if hasattr(torch, "_grouped_mm") else "matmul_loop")

    def __call__(self, a, a_scale, w, s, off_host, fuse, limit, n_out):
        active = [e for e in range(len(off_host) - 1) if off_host[e + 1] > off_host[e]]
        x = a if a_scale is None else \
            (a.float().reshape(a.shape[0], -1, 128) * a_scale[..., None]).reshape(a.shape)
        x = x.to(torch.bfloat16)
        idx = torch.tensor(active, device=a.device)
        wd = _dequant_bf16(w.index_select(0, idx), s.index_select(0, idx))
        seg = [off_host[e + 1] - off_host[e] for e in active]
        start = off_host[active[0]]
        y = None
        if self.kind == "grouped_mm":
            ends = torch.tensor(seg, dtype=torch.int32).cumsum(0).to(torch.int32).to(a.device)
            try:
                y = torch._grouped_mm(x[start:start + sum(seg)], wd.transpose(1, 2), offs=ends)
            except (RuntimeError, ValueError, TypeError):
                self.kind = "matmul_loop"
        if y is None:
            dt = torch.float32 if self.kind == "float32_loop" else torch.bfloat16
            y = torch.cat([x[off_host[e]:off_host[e + 1]].to(dt) @ wd[i].to(dt).T
                           for i, e in enumerate(active)])
        if fuse:
            y = _swiglu_torch(y, n_out, limit)
        return y.to(torch.bfloat16)


def _fp8_ceiling():
    try:
        m = 8192
        a = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        f = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,  # noqa: E731
                                     out_dtype=torch.bfloat16)
        t = bench.time_cuda(f, warmup=3, reps=20, flush_l2=False)
        return 2 * m**3 / t
    except Exception as exc:  # noqa: BLE001 - a missing ceiling must not stop the run
        print(f"fp8 ceiling not measured: {exc}")
        return None


def _read_seconds(data, active_ids, reps):
    """A plain one-launch read of the active experts' packed weights, timed like kernel_us
    (both activation types pack to the same bytes an expert); None without Triton."""
    try:
        return stream_read.best_read_seconds(data, active_ids,
                                             lambda f: bench.time_kernels(f, reps=min(reps, 10)))
    except Exception as exc:  # noqa: BLE001 - a missing reference must not stop the run
        print(f"read reference not measured: {exc}")
        return None


def _layer_rows(parts, off_dev, reps, ceilings) -> list[dict]:
    """A MoE layer's two GEMMs back to back, as the model launches them: gate_up, then down on
    its output (W4A16; for W4A8 the caller quantises h in between, untimed here, so down reads
    its own float8 input). Where the launches are programmatic the second may start under the
    first's tail, which the per-GEMM rows (each after its own L2 flush) cannot show. One row per
    activation type whose two GEMMs passed their checks; bytes and FLOPs are the two rows' sums."""
    out = []
    for act in ("bf16", "fp8"):
        if ("gate_up", act) not in parts or ("down", act) not in parts:
            continue
        (ga, gs, gw, grow), (da, ds, dw, drow) = parts["gate_up", act], parts["down", act]

        def gate_up(ga=ga, gs=gs, gw=gw):
            return mxfp4_grouped_gemm(ga, gw, None, a_scale=gs, expert_offsets=off_dev,
                                      fuse_swiglu=True, swiglu_limit=LIMIT)

        def run(act=act, gate_up=gate_up, da=da, ds=ds, dw=dw):
            h = gate_up()
            return mxfp4_grouped_gemm(h if act == "bf16" else da, dw, None, a_scale=ds,
                                      expert_offsets=off_dev)

        t = bench.time_cuda_graph(run, warmup=3, reps=reps)
        t_kern = bench.time_kernels(run, reps=reps)
        summed = {key: grow[key] + drow[key] for key in ("weight_bytes", "act_bytes", "out_bytes")}
        peak = ceilings["fp8_flops_per_s"] if grow["peak_used"] == "fp8" else \
            ceilings["bf16_flops_per_s"]
        ceil = {"hbm_bytes_per_s": ceilings["hbm_bytes_per_s"], "bf16_flops_per_s": peak}
        row = {key: grow[key] for key in ("act", "tokens", "routing", "experts", "active", "rows",
                                          "tile", "peak_used")}
        row.update(gemm="gate_up+down", N=None, K=None, **summed,
                   **bench.roofline_row(seconds=t, bytes_moved=grow["bytes"] + drow["bytes"],
                                        flops=grow["flops"] + drow["flops"], ceilings=ceil,
                                        kernel_seconds=t_kern),
                   weight_gbps=summed["weight_bytes"] / t / 1e9,
                   weight_bw_fraction=summed["weight_bytes"] / t / ceilings["hbm_bytes_per_s"],
                   kernel_weight_bw_fraction=summed["weight_bytes"] / t_kern
                   / ceilings["hbm_bytes_per_s"],
                   separate_kernel_us=grow["kernel_us"] + drow["kernel_us"])
        out.append(row)
        print(f"  gate_up+down {act} tokens={row['tokens']} {row['routing']}: {t * 1e6:.1f} us "
              f"(floor {row['fraction_of_floor']:.0%}), kernels {t_kern * 1e6:.1f} us "
              f"({row['kernel_fraction_of_floor']:.0%}; the two timed apart "
              f"{row['separate_kernel_us']:.1f} us)", flush=True)
    return out


def cuda_main(args, quick: bool, only: list[int] | None = None) -> None:
    import time

    torch.manual_seed(0)
    tokens_list = [1, 32, 512] if quick else list(CUDA_TOKENS)
    if only is not None and not set(only) <= set(tokens_list):
        raise SystemExit(f"--tokens: each must be one of {tokens_list}, got {only}")
    routings = (False,) if quick else (False, True)
    reps = 10 if quick else 30
    ceilings = bench.measure_cuda_ceilings()
    fp8_peak = _fp8_ceiling()
    ceilings["fp8_flops_per_s"] = fp8_peak
    print("ceilings:", {k: f"{v:.4g}" for k, v in ceilings.items() if v})
    gen = torch.Generator().manual_seed(0)
    dgen = torch.Generator(device="cuda").manual_seed(1)
    gemms = {"gate_up": (2 * INTER, HIDDEN, True), "down": (HIDDEN, INTER, False)}
    weights, packed, prepack_s = {}, {}, {}
    for name, (n, k, fuse) in gemms.items():
        weights[name] = make_weights(EXPERTS, n, k, dgen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        packed[name] = {act: mxfp4_prepack(*weights[name], fuse_swiglu=fuse, act_dtype=dt)
                        for act, dt in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn))}
        torch.cuda.synchronize()
        prepack_s[name] = time.perf_counter() - t0
    torch_path = TorchPath()
    check_path = TorchPath("float32_loop")  # the correctness check: float32 GEMMs per expert
    rows, failures = [], []
    for tokens in tokens_list:
        for skew in routings:
            offsets = routing_offsets(tokens, EXPERTS, skew, gen)
            if only is not None and tokens not in only:
                # drawn all the same (routing and activations): the counts timed see exactly
                # a full run's inputs
                for _n, k, _fuse in gemms.values():
                    torch.randn(int(offsets[-1]), k, generator=dgen, device="cuda")
                continue
            off_host = offsets.tolist()
            m = off_host[-1]
            off_dev = offsets.cuda()
            active_ids = torch.tensor([e for e in range(EXPERTS) if off_host[e + 1] > off_host[e]],
                                      dtype=torch.int32, device="cuda")
            active = active_ids.numel()
            layer_parts = {}  # (gemm, act) -> (a, a_scale, packed weights, row), for _layer_rows
            for name, (n, k, fuse) in gemms.items():
                w, s = weights[name]
                n_out = n // 2 if fuse else n
                t_read = _read_seconds(packed[name]["bf16"].data, active_ids, reps)
                x = torch.randn(m, k, generator=dgen, device="cuda") * 0.5
                for act in ("bf16", "fp8"):
                    if act == "bf16":
                        a, a_scale = x.to(torch.bfloat16), None
                    else:
                        a, a_scale = _quant_fp8(x)
                    lim = LIMIT if fuse else None
                    pw = packed[name][act]
                    run = lambda: mxfp4_grouped_gemm(  # noqa: E731
                        a, pw, None, a_scale=a_scale, expert_offsets=off_dev, fuse_swiglu=fuse,
                        swiglu_limit=lim)
                    run_torch = lambda: torch_path(a, a_scale, w, s, off_host,  # noqa: E731
                                                   fuse, LIMIT, n_out)
                    tag = f"{name} {act} tokens={tokens} {'skewed' if skew else 'uniform'}"
                    got = run().float()
                    want = check_path(a, a_scale, w, s, off_host, fuse, LIMIT, n_out).float()
                    err = float((got - want).norm() / want.norm().clamp(min=1e-30))
                    if not err < 1e-2:
                        print(f"  WRONG {tag}: relative error {err:.3g} vs a float32 torch "
                              "path", flush=True)
                        failures.append(tag)
                        continue
                    # Device time of the launch (CUDA-graph replay: the op is sync-free); the
                    # eager call, Python validation included, is reported apart.
                    t = bench.time_cuda_graph(run, warmup=3, reps=reps)
                    t_kern = bench.time_kernels(run, reps=reps)
                    t_eager = bench.time_cuda(run, warmup=3, reps=reps)
                    t_torch = bench.time_cuda(run_torch, warmup=1, reps=5 if quick else 10)
                    weight_bytes = active * pw.n_pad * pw.k_pad * 17 // 32
                    act_bytes = m * k * a.element_size() + (0 if a_scale is None
                                                            else a_scale.numel() * 4)
                    out_bytes = m * n_out * 2
                    flops = 2.0 * m * n * k
                    peak = fp8_peak if (act == "fp8" and fp8_peak) else ceilings["bf16_flops_per_s"]
                    ceil = {"hbm_bytes_per_s": ceilings["hbm_bytes_per_s"],
                            "bf16_flops_per_s": peak}
                    row = {
                        "gemm": name, "act": act, "tokens": tokens,
                        "routing": "skewed" if skew else "uniform", "experts": EXPERTS,
                        "active": active, "rows": m, "N": n, "K": k,
                        "tile": _plan_name(act == "fp8", m),
                        "weight_bytes": weight_bytes, "act_bytes": act_bytes,
                        "out_bytes": out_bytes,
                        **bench.roofline_row(seconds=t, bytes_moved=weight_bytes + act_bytes
                                             + out_bytes, flops=flops, ceilings=ceil,
                                             kernel_seconds=t_kern),
                        "peak_used": "fp8" if peak is fp8_peak and act == "fp8" else "bf16",
                        "weight_gbps": weight_bytes / t / 1e9,
                        "weight_bw_fraction": weight_bytes / t / ceilings["hbm_bytes_per_s"],
                        "kernel_weight_bw_fraction":
                            weight_bytes / t_kern / ceilings["hbm_bytes_per_s"],
                        "read_us": None if t_read is None else t_read * 1e6,
                        "read_weight_bw_fraction": None if t_read is None
                        else weight_bytes / t_read / ceilings["hbm_bytes_per_s"],
                        "kernel_vs_read": None if t_read is None else t_read / t_kern,
                        "rel_err_vs_float32_torch": err,
                        "eager_call_us": t_eager * 1e6,
                        "torch_us": t_torch * 1e6,
                        "speedup_vs_torch": t_torch / t,
                    }
                    rows.append(row)
                    layer_parts[name, act] = (a, a_scale, pw, row)
                    print(f"  {tag}: {t * 1e6:.1f} us, weights {row['weight_gbps']:.0f} GB/s "
                          f"({row['weight_bw_fraction']:.0%} of HBM), "
                          f"{row['tflops']:.1f} TFLOP/s, floor {row['fraction_of_floor']:.0%} "
                          f"(kernels {t_kern * 1e6:.1f} us: "
                          f"{row['kernel_fraction_of_floor']:.0%}), "
                          + ("" if t_read is None else
                             f"a plain read of the weights {t_read * 1e6:.1f} us "
                             f"({row['read_weight_bw_fraction']:.0%} of HBM), ")
                          + f"torch {t_torch * 1e6:.0f} us", flush=True)
                    del got, want
            rows += _layer_rows(layer_parts, off_dev, reps, ceilings)
            torch.cuda.empty_cache()
    cols = ["gemm", "act", "tokens", "routing", "active", "rows", "tile", "time_us",
            "weight_gbps", "weight_bw_fraction", "gbps", "tflops", "floor_us",
            "fraction_of_floor", "kernel_us", "kernel_weight_bw_fraction",
            "kernel_fraction_of_floor", "read_us", "read_weight_bw_fraction", "kernel_vs_read",
            "eager_call_us", "torch_us", "speedup_vs_torch"]
    bench.print_table(rows, cols)
    extra = {
        "ceilings": ceilings,
        "quick": quick,
        "tokens_subset": only,
        "prepack_seconds": prepack_s,
        "torch_baseline": f"{torch_path.kind}: dequantize the active experts' MXFP4 weights to "
                          "bf16 (exact) and, for fp8 activations, the activations to bf16, then "
                          "bf16 GEMM(s) over the expert segments and the clipped SwiGLU in "
                          "float32; its time includes the dequantizations (the kernel reads "
                          "MXFP4 directly); the kernel's prepack is done once and not timed",
        "a_scale_layout": "W4A8 rows: float32 per-token scales token-contiguous "
                          "(mxfp4_act_scale_mn_major)",
        "bytes": "weight_bytes = packed MXFP4 bytes (4.25 bits/weight) of the experts with "
                 "tokens; act_bytes = activations (+ float32 scales); out_bytes = bf16 outputs",
        "floor": "max(bytes / measured HBM copy rate, flops / measured peak); peak = bf16 matmul "
                 "for W4A16 rows, torch._scaled_mm e4m3 for W4A8 rows (peak_used)",
        "timing": "time_us: CUDA-graph replay of the op with L2 flushed before each call "
                  "(events around the replay: graph launch included); kernel_us: the op's own "
                  "device work (CUPTI kernel durations, bench.time_kernels), with "
                  "kernel_fraction_of_floor / kernel_weight_bw_fraction on it; eager_call_us: the "
                  "same op called from Python (validation and launch overhead included); "
                  "torch_us: the torch path called eagerly; read_us: the fastest of a few grid "
                  "shapes of a plain streaming read (Triton, zeroinfer.testing.stream_read) of "
                  "exactly the active experts' packed weights in one launch, timed like kernel_us "
                  "(read_weight_bw_fraction: weight_bytes / read_us over the copy rate: what one "
                  "launch moving these bytes reaches at all; kernel_vs_read = read_us / "
                  "kernel_us; null without Triton); gate_up+down rows: the layer's two GEMMs "
                  "back to back after one flush (W4A16: down on gate_up's output; W4A8: on its "
                  "own float8 input, the quantisation between them untimed), bytes and FLOPs "
                  "summed, separate_kernel_us = the two per-GEMM kernel_us",
        "failures": failures,
        "fp8_tiny_loop": ("plain" if _C.mxfp4_fp8_tiny_plain_loop(mg._FORCE_FP8_TINY_LOOP)
                          else "skewed") + " (the W4A8 tiny tile's stage loop on this device)",
    }
    path = bench.write_results("moe_gemm", rows, device="cuda", extra=extra,
                               out_dir=args.out_dir)
    print(f"wrote {path}")
    if failures:
        raise SystemExit(f"{len(failures)} case(s) disagree with torch: {failures}")


if __name__ == "__main__":
    main()

"""How fast can the GPU gather the rows of the sparse-MLA benchmark's bf16 64-head b = 128 case
(per query token: a 128-slot window + 512 sorted picks out of a 2048-entry pool, 1 KB rows;
81,920 distinct rows, 84 MB), with no attention math at all? Two gathers, each timed like the
benchmark (CUPTI kernel time, L2 flushed), against the streaming copy rate that the benchmark's
floor uses (and the same lists over the FP8 cache - 584 bytes a row, the 8 scale bytes elsewhere
in the block - by Triton and by the copy chain, beside the FP8 kernels):
  - Triton: each program loads R rows and sums them (pure reads, many programs an SM);
  - the kernel's own copy chain without its math (needs CuPy, which the H200 image has): one CTA
    a token, 256 threads, tiles of 64 rows gathered by 16-byte cp.async into a ring of NBUF
    64 KB buffers (NBUF - 1 tiles in flight; 2 = the kernel's double buffer), and a spin of
    SPIN ns a tile where the kernel computes.
An exploration aid for bench/results/h200/sparse_mla_NOTES.md (session 21); writes nothing.

  python3 bench/probe_gather_rows.py
"""

import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "bench")
from bench_sparse_mla import make_inputs  # noqa: E402

from zeroinfer.ops import sparse_mla_attention  # noqa: E402
from zeroinfer.testing import bench  # noqa: E402


@triton.jit
def _gather_sum(main, extra, idx, eidx, out, W: tl.constexpr, K: tl.constexpr, R: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1)
    e = c * R + tl.arange(0, R)
    d = tl.arange(0, 512)
    in_win = e < W
    slot_w = tl.load(idx + t * W + e, mask=in_win, other=0)
    slot_e = tl.load(eidx + t * K + (e - W), mask=~in_win, other=0)
    pw = main + slot_w.to(tl.int64)[:, None] * 512 + d[None, :]
    pe = extra + slot_e.to(tl.int64)[:, None] * 512 + d[None, :]
    v = tl.where(in_win[:, None], tl.load(pw, mask=in_win[:, None], other=0.0),
                 tl.load(pe, mask=~in_win[:, None], other=0.0))
    tl.store(out + (t * tl.num_programs(1) + c) * 512 + d, tl.sum(v.to(tl.float32), axis=0))


@triton.jit
def _gather_fp8(main, extra, idx, eidx, out, W: tl.constexpr, K: tl.constexpr, R: tl.constexpr):
    """The FP8 layout's rows: 576 bytes (72 int64 words) at block * 64 * 584 + token * 576 and
    8 scale bytes at block * 64 * 584 + 64 * 576 + token * 8, for 64-token blocks; XOR-summed."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    e = c * R + tl.arange(0, R)
    d = tl.arange(0, 128)
    in_win = e < W
    slot = tl.where(in_win, tl.load(idx + t * W + e, mask=in_win, other=0),
                    tl.load(eidx + t * K + (e - W), mask=~in_win, other=0)).to(tl.int64)
    blk = (slot // 64) * (64 * 584 // 8)
    row = blk + (slot % 64) * (576 // 8)
    sc = blk + (64 * 576 // 8) + (slot % 64)
    wmask = (d < 72)[None, :]
    pw = main + row[:, None] + d[None, :]
    pe = extra + row[:, None] + d[None, :]
    v = tl.where(in_win[:, None], tl.load(pw, mask=wmask & in_win[:, None], other=0),
                 tl.load(pe, mask=wmask & ~in_win[:, None], other=0))
    s = tl.where(in_win, tl.load(main + sc, mask=in_win, other=0),
                 tl.load(extra + sc, mask=~in_win, other=0))
    x = tl.xor_sum(v, axis=1) ^ s
    tl.store(out + (t * tl.num_programs(1) + c) * R + tl.arange(0, R), x)


_CHAIN_SRC = r"""
extern "C" __global__ void __launch_bounds__(256, 1)
chain(const unsigned long long* rows, int ntiles, int nbuf, long long spin_ns, float* out) {
  extern __shared__ __align__(1024) unsigned char sm[];
  const int tid = threadIdx.x, j = tid & 7, e0 = tid >> 3;  // 32 rows at a time, 8 threads a row
  const unsigned long long* my = rows + (long long)blockIdx.x * ntiles * 64;
  auto issue = [&](int tile) {  // the kernel's swizzled layout: 8 panels of 64 rows x 128 B
    const unsigned base = (unsigned)__cvta_generic_to_shared(sm) + (tile % nbuf) * 65536;
    for (int r = 0; r < 2; ++r) {
      const int e = e0 + 32 * r;
      const char* src = (const char*)my[tile * 64 + e] + j * 16;
      for (int p = 0; p < 8; ++p) {
        const unsigned dst = base + p * 8192 + e * 128 + ((j ^ (e & 7)) << 4);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src + p * 128));
      }
    }
    asm volatile("cp.async.commit_group;\n");
  };
  for (int t = 0; t < nbuf - 1; ++t) {
    if (t < ntiles) issue(t); else asm volatile("cp.async.commit_group;\n");
  }
  float acc = 0.f;
  for (int it = 0; it < ntiles; ++it) {
    if (nbuf == 2) asm volatile("cp.async.wait_group 0;\n");  // nbuf - 2 groups may stay out
    else if (nbuf == 3) asm volatile("cp.async.wait_group 1;\n");
    else asm volatile("cp.async.wait_group 2;\n");
    __syncthreads();
    if (it + nbuf - 1 < ntiles) issue(it + nbuf - 1); else asm volatile("cp.async.commit_group;\n");
    acc += *(const float*)(sm + (it % nbuf) * 65536 + tid * 16);
    if (spin_ns > 0) {
      unsigned long long t0, t1;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
      do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1)); } while (t1 - t0 < spin_ns);
    }
    __syncthreads();
  }
  out[blockIdx.x * 256 + tid] = acc;
}
"""


# The same chain over the FP8 cache's rows: 576 bytes (36 16-byte chunks) and an 8-byte scale
# group a row, a 64-row tile packed into a 37 KB buffer; no spin (the copies alone).
_CHAIN_FP8_SRC = r"""
extern "C" __global__ void __launch_bounds__(256, 1)
chain_fp8(const unsigned long long* rows, const unsigned long long* scales, int ntiles, int nbuf,
          float* out) {
  extern __shared__ __align__(1024) unsigned char sm[];
  const int tid = threadIdx.x;
  const long long first = (long long)blockIdx.x * ntiles * 64;
  constexpr int kBuf = 64 * 576 + 64 * 8;
  auto issue = [&](int tile) {
    const unsigned base = (unsigned)__cvta_generic_to_shared(sm) + (tile % nbuf) * kBuf;
    for (int c = tid; c < 64 * 36; c += 256) {  // 9 chunks a thread: row c / 36, chunk c % 36
      const int e = c / 36, k = c % 36;
      const char* src = (const char*)rows[first + tile * 64 + e] + 16 * k;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(base + 16 * c), "l"(src));
    }
    if (tid < 64) {
      const char* src = (const char*)scales[first + tile * 64 + tid];
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n"
                   :: "r"(base + 64 * 576 + 8 * tid), "l"(src));
    }
    asm volatile("cp.async.commit_group;\n");
  };
  for (int t = 0; t < nbuf - 1; ++t) {
    if (t < ntiles) issue(t); else asm volatile("cp.async.commit_group;\n");
  }
  float acc = 0.f;
  for (int it = 0; it < ntiles; ++it) {
    if (nbuf == 2) asm volatile("cp.async.wait_group 0;\n");
    else if (nbuf == 3) asm volatile("cp.async.wait_group 1;\n");
    else asm volatile("cp.async.wait_group 2;\n");
    __syncthreads();
    if (it + nbuf - 1 < ntiles) issue(it + nbuf - 1); else asm volatile("cp.async.commit_group;\n");
    acc += *(const float*)(sm + (it % nbuf) * kBuf + tid * 16);
    __syncthreads();
  }
  out[blockIdx.x * 256 + tid] = acc;
}
"""


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("probe_gather_rows.py needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    kw, distinct = make_inputs(128, 64, "bf16", "cuda", gen)
    nbytes = distinct * 1024
    main_c, extra_c = kw["kv_cache"].reshape(-1, 512), kw["extra_kv_cache"].reshape(-1, 512)
    idx, eidx = kw["indices"].contiguous(), kw["extra_indices"].contiguous()
    T, W = idx.shape
    K = eidx.shape[1]
    bw = bench.measure_cuda_ceilings()["hbm_bytes_per_s"]
    print(f"{torch.cuda.get_device_name()}: copy rate {bw / 1e12:.2f} TB/s; {distinct} distinct "
          f"rows, {nbytes / 1e6:.1f} MB")

    def report(name, s, nbytes=nbytes, note=""):
        print(f"{name:38s} {s * 1e6:7.1f} us  {nbytes / s / 1e12:5.2f} TB/s  "
              f"{nbytes / s / bw:5.2f} of the copy rate{note}")

    for R, nw in ((16, 4), (32, 4), (64, 4), (64, 8)):
        out = torch.empty(T * ((W + K) // R), 512, device="cuda")
        report(f"triton gather, {R} rows a program, {nw} warps", bench.time_kernels(
            lambda: _gather_sum[(T, (W + K) // R)](main_c, extra_c, idx, eidx, out, W=W, K=K,
                                                    R=R, num_warps=nw)))
    report("sparse_mla_attention (bf16, 64 heads)",
           bench.time_kernels(lambda: sparse_mla_attention(**kw)))
    # The same lists over the FP8 cache (584 bytes a token: what the FP8 rows' floor counts);
    # the same seed gives the same lists for either head count.
    fp8 = {h: make_inputs(128, h, "fp8", "cuda", torch.Generator(device="cuda").manual_seed(0))
           for h in (64, 16)}
    kw8, distinct8 = fp8[64]
    m8, e8 = kw8["kv_cache"].view(torch.int64), kw8["extra_kv_cache"].view(torch.int64)
    i8, ei8 = kw8["indices"].contiguous(), kw8["extra_indices"].contiguous()
    out8 = torch.empty(T * (W + K), dtype=torch.int64, device="cuda")
    for R, nw in ((16, 4), (32, 4), (64, 4)):
        report(f"triton FP8 gather, {R} rows a program", bench.time_kernels(
            lambda: _gather_fp8[(T, (W + K) // R)](m8, e8, i8, ei8, out8, W=W, K=K, R=R,
                                                    num_warps=nw)), distinct8 * 584)
    for h, (kwh, _) in fp8.items():
        report(f"sparse_mla_attention (FP8, {h} heads)",
               bench.time_kernels(lambda: sparse_mla_attention(**kwh)), distinct8 * 584,
               " (rows only)")
    try:
        import cupy as cp
    except ImportError:
        print("(no CuPy: the copy-chain rows are skipped)")
        return
    fn = cp.RawModule(code=_CHAIN_SRC, options=("-std=c++17", "--gpu-architecture=sm_90"))
    fn = fn.get_function("chain")
    rows = torch.cat([main_c.data_ptr() + idx.long() * 1024,
                      extra_c.data_ptr() + eidx.long() * 1024], 1).contiguous()
    ntiles = rows.shape[1] // 64
    out = torch.empty(T * 256, device="cuda")
    for nbuf in (2, 3):
        fn.max_dynamic_shared_size_bytes = nbuf * 65536
        for spin in (0, 1000, 1500, 2000):
            def go(nbuf=nbuf, spin=spin):
                fn((T,), (256,), (cp.uint64(rows.data_ptr()), cp.int32(ntiles), cp.int32(nbuf),
                                   cp.int64(spin), cp.uint64(out.data_ptr())),
                   shared_mem=nbuf * 65536)
            report(f"copy chain, {nbuf} buffers, {spin} ns a tile", bench.time_kernels(go))
    # FP8: the rows' and scale groups' addresses as _gather_fp8 works them out (64-token blocks)
    fn8 = cp.RawModule(code=_CHAIN_FP8_SRC, options=("-std=c++17", "--gpu-architecture=sm_90"))
    fn8 = fn8.get_function("chain_fp8")

    def addr(base, slot, scale):
        blk, tok = (slot.long() // 64) * (64 * 584), slot.long() % 64
        return base + blk + (64 * 576 + tok * 8 if scale else tok * 576)

    def both(scale):
        return torch.cat([addr(m8.data_ptr(), i8, scale), addr(e8.data_ptr(), ei8, scale)],
                         1).contiguous()

    rows8, sc8 = both(False), both(True)
    # Where the scale bytes sit, at the same picks (session 32): the V4 layout's block end; read
    # from the row's own first line (no access of their own: what any inline layout costs at
    # most); and a token-interleaved layout, 592-byte rows (576 + 8 scale bytes + 8 pad, so every
    # row stays 16-byte aligned). Session 33: the same 576-byte reads at a 640-byte pitch (every
    # row 128-byte aligned, none crossing a line it does not need) and at a 1 KB pitch (the bf16
    # rows' alignment): if the rows a second stay where the 584-byte pitch has them, what binds is
    # a cost per row, not the bytes or how rows straddle lines and DRAM pages.
    def pitched(pitch):
        """The picks' row addresses at `pitch` bytes apart, in buffers of their own (returned
        with them, to keep them alive)."""
        bufs = [torch.empty((int(i.max()) + 1) * pitch, dtype=torch.uint8, device="cuda")
                for i in (i8, ei8)]
        return bufs, torch.cat([bufs[0].data_ptr() + i8.long() * pitch,
                                bufs[1].data_ptr() + ei8.long() * pitch], 1).contiguous()

    rows_at = {pitch: pitched(pitch) for pitch in (592, 640, 1024)}
    aos, p640, p1k = (rows_at[pitch][1] for pitch in (592, 640, 1024))
    layouts = (("scales at the block end", rows8, sc8), ("no scale access", rows8, rows8),
               ("592-byte rows, scales inline", aos, aos + 576),
               ("576 B at a 640-byte pitch, no scales", p640, p640),
               ("576 B at a 1 KB pitch, no scales", p1k, p1k))
    for name, r8, s8 in layouts:
        for nbuf in (2, 3, 4):
            fn8.max_dynamic_shared_size_bytes = nbuf * (64 * 584)
            def go8(nbuf=nbuf, r8=r8, s8=s8):
                fn8((T,), (256,), (cp.uint64(r8.data_ptr()), cp.uint64(s8.data_ptr()),
                                   cp.int32(ntiles), cp.int32(nbuf), cp.uint64(out.data_ptr())),
                    shared_mem=nbuf * (64 * 584))
            report(f"FP8 copy chain, {nbuf} buffers, {name}", bench.time_kernels(go8),
                   distinct8 * 584)


if __name__ == "__main__":
    main()

// CUDA MXFP4 grouped expert GEMM for sm_90a (contract in zeroinfer/moe_gemm.h).
//
// Swap AB: the weight rows are the MMA's M dimension (16 per mma) and the tokens its N dimension
// (8 per mma), so an expert with 1..8 tokens wastes no weight bandwidth. Weights are streamed in
// the repacked layout (zeroinfer.ops.mxfp4_prepack): per 16 rows x 64 k, lane L's 16 bytes at
// L*16 are exactly its A-fragment values for the block (bit layout per activation type, chosen
// for the cheapest decode), followed by the block's 32 scale bytes; per 64-row group, stage by
// stage (a group's 4 strips x 2 blocks of one 128-k stage are one contiguous run).
//
// Numerics (identical for every tile shape, so results are batch-invariant and deterministic):
//   W4A16 (bf16 activations): e2m1 -> bf16 is exact: a nibble s|c (c = 3 code bits) placed as
//     bf16 bits s<<15 | c<<6 is the e2m1 value times 2^-126 (the code's exponent bits land in the
//     bf16 exponent, 0.5 becomes the subnormal 2^-127); one bf16 multiply by 2^(scale-1) (two
//     exact multiplies when a scale byte exceeds 128) folds in the bias and the UE8M0 scale,
//     exactly. mma.sync m16n8k16 bf16 with float32 accumulation, in k order.
//   W4A8 (e4m3 activations, per-token per-128 float32 scales; the contract is in
//     zeroinfer/moe_gemm.h): per weight row and 128-k stage, base b = its largest UE8M0 byte;
//     each e2m1 value becomes the e4m3 value * 2^(s-b+6) through a byte table (a prmt and a
//     LOP3 a register), the stage's four k32 groups run as one wgmma m64nNk32 chain from zero, then
//     acc = fma(partial * 2^(b-133), a_scale, acc) in float32, in k order. With a per-row base B
//     for the whole K (Mxfp4CudaGemmParams::row_base, where the row's scale bytes are within 11
//     of their largest) the values are e2m1 * 2^(s-B+6) instead and the promotion one fma,
//     acc = fma(partial, a_scale, acc), with one multiply by 2^(B-133) at the end: every term
//     2^(b-B) times the above, exactly, so bitwise the same results (caveat in the header).
//     Always wgmma: Hopper's float8 wgmma rounds differently from mma.sync m16n8k32 (measured
//     ~4e-4 apart), so one instruction family keeps every float8 tile bitwise equal.
//
// K order: the MMA's k index is a permutation of the real k inside every 32-group (weights and
// activations are permuted alike, so the dot product is unchanged): lane t of a k16 step holds
// real k 16h + 4t .. 16h + 4t + 3 of half h, i.e. the activation fragment of a lane is 8 (bf16)
// or 2 x 4 (e4m3) consecutive bytes of its token's row.
//
// Tiles: a CTA computes BN weight rows x BM tokens of one expert over the whole K (no split-K, so
// no cross-CTA reduction), with a cp.async pipeline of BK = 128 stages (weights, tokens and the
// float8 scales of that k block). mxfp4_cuda_plan picks the shapes from the shapes: one, or up to
// four tiers split between the experts on the device by their row counts (skewed routing):
//   tiny:  64 rows x 8 tokens (decode, <= 8 rows; ~75 registers and a small activation stage, so
//          7 CTAs / 28 warps per SM)
//   small: 64 rows x 32 tokens (decode; bf16 skips the n8 steps past the expert's rows, so 1..8
//          tokens cost one mma per weight fragment)
//   wgmma: 2 warpgroups x 64 rows x 64 tokens (experts of a few tens of rows; see WgCfg)
//   wide:  bf16 2 warpgroups x 64 rows x 128 tokens, two CTAs an SM; float8 128 rows x 256
//          tokens, warp-specialised with the tokens as wgmma's M (WsFp8Cfg), one CTA an SM
// bf16 runs tiny / small on mma.sync m16n8k16 (Cfg) and the larger tiles on wgmma, whose k16
// reduction gives bitwise the results of the mma.sync tiles (tested); float8 runs every shape on
// wgmma (WgCfg: 1 warpgroup for tiny and small), bitwise equal to each other.
// Persistent grid: each CTA builds the per-expert tile prefix ON THE DEVICE from the offsets /
// counts / masked_m (no host sync), then walks the work items (tile slot, N tile) with a grid
// stride; slots past the device-computed total exit. Rows of a tile past the expert's count are
// neither loaded nor stored (their shared-memory rows hold stale data that only ever feeds
// output columns that are discarded).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <type_traits>

#include "block_scan.cuh"
#include "check.cuh"
#include "launch.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"
#include "zeroinfer/cuda_runtime.h"
#include "zeroinfer/moe_gemm.h"
#include "zeroinfer/numeric.h"

namespace zi {
namespace {

constexpr int kBK = 128;                              // k per pipeline stage
constexpr int kBlk = kMxfp4BlockBytes;                // one packed 16 x 64 block
constexpr int kStripStage = 2 * kMxfp4BlockBytes;     // one 16-row strip, one stage (k 128)
// One 64-row group's stage (zeroinfer/moe_gemm.h): the step from a strip's stage to its next.
constexpr int kGroupStage = kMxfp4GroupStrips * kStripStage;
static_assert(kMxfp4StageBlocks * kMxfp4BlockBytes == kStripStage, "a stage is 2 blocks");
constexpr int kStripChunks = kStripStage / 16;        // 16-byte cp.async chunks per strip stage
static_assert(kStripStage % 16 == 0, "strip stage must be 16-byte chunks");
static_assert(kMxfp4PackK % kBK == 0, "packed k must be whole stages");

// The mma.sync tiles (bf16 activations only; float8 runs on wgmma everywhere, see WgCfg).
template <int kWarpsN, int kWarpsM, int kWN, int kWT, int kStages, int kMinBlocks>
struct Cfg {
  static constexpr bool wgmma = false;
  static constexpr int warps_n = kWarpsN;
  static constexpr int wn = kWN;  // 16-row strips per warp
  static constexpr int wt = kWT;  // 8-token steps per warp
  static constexpr int stages = kStages, min_blocks = kMinBlocks;
  static constexpr int threads = 32 * kWarpsN * kWarpsM;
  static constexpr int bn = 16 * kWN * kWarpsN;  // weight rows per CTA tile
  static constexpr int bm = 8 * kWT * kWarpsM;   // tokens per CTA tile
  static constexpr int strips = bn / 16;
  static constexpr int w_bytes = strips * kStripStage;
  // Token row pitch in shared memory: 288 B make the fragment loads of a warp (8 rows x 4 lanes)
  // hit distinct banks.
  static constexpr int a_pitch = kBK * 2 + 32;
  static constexpr int a_bytes = bm * a_pitch;
  static constexpr int stage_bytes = w_bytes + a_bytes;
  static constexpr int pipe_bytes = kStages * stage_bytes;  // the schedule arrays follow
  static constexpr int chunks_per_row = kBK * 2 / 16;
  static_assert(stage_bytes % 16 == 0, "stage must keep 16-byte alignment");
  // The mma.sync tiles are the decode tiles: a warp decodes one 16-row strip and copies it, and
  // a thread copies at most 4 activation chunks a stage (kernel: kRowStep, kAChunks).
  static_assert(kWN == 1 && kWarpsM == 1, "mma.sync tiles: one warp a strip");
  static_assert(bm * chunks_per_row <= 4 * threads, "at most 4 activation chunks a thread");
};

// Small decode tile, two rings: as a skewed-routing tier (a few experts of >= 9 rows while most
// hold fewer: a fraction of a wave of work items, so each CTA's latency decides) 64 rows, 5
// stages at 3 CTAs an SM; as the base tile (every expert ~4-32 rows: many waves) 128 rows (8
// warps), 3 stages at 3 CTAs. Measured on the H200 (moe_gemm_NOTES.md, session 9): 3 stages x 5
// CTAs is +5-9% at 512 / 1024 tokens uniform and -23% at 32 tokens on 6 experts. 128 rows halve
// the L2 re-reads of each expert's tokens (one a row tile); on the H100 (session 25) +3.6% at 512
// tokens uniform as the base, but -15-19% at 32 tokens on 6 experts as the tier (half the CTAs:
// 192 items on 132 SMs), hence only as the base.
using SmallCfg = Cfg<4, 1, 1, 4, 5, 3>;
using SmallBaseCfg = Cfg<8, 1, 1, 4, 3, 3>;
// Tiny decode tile: 4 warps x (16 rows x 8 tokens) = 64 x 8. Same per-warp work as the small tile
// for <= 8 rows per expert, but a 4x smaller activation stage and a 4-token-step smaller
// accumulator, so 7 CTAs (<= 72 registers) fit an SM instead of 3: more warps to hide the
// decode's dependency latency. Four stages; measured on the H200 (session 9) against 6 CTAs x 5
// stages: +1-5% at 8-128 tokens, the same at 1; 8 CTAs x 3 stages: +3-5% at 8-128 tokens but
// -11% at 1 token (a fraction of a wave, where each warp's chain of stages decides).
using TinyCfg = Cfg<4, 1, 1, 1, 4, 7>;


// The wgmma tiles: kGroups warpgroups x 64 weight rows (warp w of warpgroup cw owns packed strip
// 4 cw + w) x bm tokens. Weights are the wgmma A operand taken from registers (the RS form): a
// warp's RS fragment is the mma.m16n8k16 (bf16) / m16n8k32 (e4m3) A fragment of its 16 rows,
// i.e. exactly what the decoders give from the lane's prepacked word.
//   bf16 (2 x 64 rows x 64 / 128 tokens, m64n{bm}k16): the word's k order is the prepack's
//     k-slot order (slot pair q of a 16-k group holds real pair 0,2,4,6,1,3,5,7); tokens are the B
//     operand from shared memory (K-major, 128-byte swizzle) and must be in that same order: the
//     caller passes the activations again with each 16-k group's bf16 pairs permuted so
//     (Mxfp4CudaGemmParams::a_kslot; zeroinfer.ops makes it in one pass), which lets the B tiles
//     travel by 16-byte cp.async in the same ring as the weights. Its k16 reduction gives
//     bitwise the results of the mma.sync tiles (tested).
//   e4m3 (every float8 tile: m64 n{bm} k32): the e4m3 fragments are in real k order, so B is `a`
//     itself. The UE8M0 scales are folded into the e4m3 weights per (row, 128-k stage) (W4A8 in
//     zeroinfer/moe_gemm.h), so a stage's four k32 groups are ONE wgmma chain and one promotion:
//     acc = fma(partial * 2^(b - 133), a_scale, acc) (or, with row bases, acc = fma(partial,
//     a_scale, acc) and one rescale at the end). Hopper's float8 wgmma sums at a lower
//     precision than mma.sync m16n8k32 does (measured: ~4e-4 relative apart), so float8 runs on
//     wgmma at every size, decode included, and its tiles stay bitwise equal to each other.
// Shared memory: a ring of `stages` (B tile, weights[, a_scale column]) stages, loaded `ahead`
// stages ahead; B tiles first (each a whole number of 1024-byte swizzle atoms), then the rest.
// The slot refilled at stage kt was read at stage kt + ahead - stages: with ahead = stages - 1
// that is the stage just before, whose last wgmma the warpgroups wait for (wait<0>) before the
// stage's barrier (float8 waits for every group inside its stage anyway); with fewer ahead it was
// retired by the waits of the stage before, and the tensor cores never drain.
template <bool kFp8, int kGroups, int kBM, int kStages, int kAhead, int kMinBlocks,
          bool kSkew = false>
struct WgCfg {
  static constexpr bool wgmma = true;
  static constexpr bool fp8 = kFp8;
  static constexpr int threads = 128 * kGroups;
  static constexpr int strips = 4 * kGroups;      // 64 weight rows per warpgroup
  static constexpr int bm = kBM;                  // tokens per CTA tile (wgmma N)
  static constexpr int stages = kStages, ahead = kAhead, min_blocks = kMinBlocks;
  static constexpr bool skew = kSkew;  // float8: the stage loop skewed by one stage (see kernel)
  static_assert(!skew || fp8, "only the float8 stage loop has a skewed form");
  static constexpr int w_bytes = strips * kStripStage;
  static constexpr int b_row_bytes = kBK * (fp8 ? 1 : 2);  // one token's k block: 1 or 2 panels
  static constexpr int b_bytes = bm * b_row_bytes;
  static constexpr int s_bytes = fp8 ? bm * 4 : 0;         // the stage's a_scale column
  static constexpr int ws_bytes = w_bytes + s_bytes;       // weights + scales of a stage
  static constexpr int b_ring = stages * b_bytes;
  static constexpr int pipe_bytes = b_ring + stages * ws_bytes;
  static constexpr int acc_regs = bm / 2;                 // 64 x bm fp32 over 128 threads
  static_assert(kBK == 128, "a stage is two packed 64-k blocks");
  static_assert(bm % 8 == 0 && b_bytes % 1024 == 0 && ws_bytes % 16 == 0, "ring alignment");
  static_assert(bm <= threads, "one float8 scale row per thread");
  static_assert(strips * 32 == threads, "warp w owns (decodes and loads) strip w");
  // Every strip of a tile exists (n_pad is a multiple of kMxfp4PackRows) and a warpgroup's
  // rows are one W4A8 row-base group.
  static_assert((kMxfp4PackRows / 16) % strips == 0 && kMxfp4RowBaseGroup == 64,
                "tiles are whole 64-row groups of the packed rows");
  // min_blocks CTAs an SM at V4's 256 experts (the schedule grows with E; the launcher asks the
  // occupancy API for the E at hand).
  static_assert(min_blocks * (pipe_bytes + (3 * 256 + 1) * 4 + 1024) <= 228 * 1024,
                "shared memory budget (ring + schedule, min_blocks CTAs an SM)");
  static_assert(ahead >= 1 && ahead < stages, "loads ahead within the ring");
  // store_tile_staged's [bm][columns + 16 bytes] float32 output tile reuses the ring.
  static_assert(bm * (strips * 16 * 4 + 16) <= pipe_bytes, "output tile fits the ring");
};
// bf16 wgmma (tile 4, experts of 33..64 rows): 64-token tiles, two CTAs an SM, 3 stages ahead;
// wide (tile 2, from 65 rows): 128-token tiles, two CTAs an SM (<= 128 registers) each covering
// the other's barriers. Measured on the H200 (moe_gemm_NOTES.md, session 9): at 48 rows an
// expert the 64-token tile is 1.25-1.3x the 128-token one (tiles 3/4 instead of 3/8 full), at
// 96 rows 0.78x; two CTAs of 2 stages or one warpgroup x 3 CTAs were 3-7% slower.
using WgBf16Cfg = WgCfg<false, 2, 64, 4, 3, 2>;
using WgBf16WideCfg = WgCfg<false, 2, 128, 2, 1, 2>;
// float8: prefill (tile 4), wide prefill (tile 2), decode (small, tile 1) and tiny (tile 3).
// Measured alternatives for the prefill tile (bench/results/h200/moe_gemm_NOTES.md, session 5):
// two groups in flight at one CTA an SM (222 registers) -20%; one warpgroup x 4 CTAs -7%.
using WgFp8Cfg = WgCfg<true, 2, 64, 5, 3, 2, true>;
// The float8 decode tiles' rings as the bf16 ones (SmallCfg, TinyCfg): tiny 4 stages x 7 CTAs
// everywhere; small 5 x 4 as a skewed tier, 4 x 5 as the base. Measured on the H200 (session 9)
// against tiny 5 x 6 / small 5 x 4: +2-6% of HBM at 8-1024 tokens uniform, the same at 1 token;
// the 4 x 5 small ring -2-3% on 32 tokens over 6 experts (hence only as the base). Both small
// rings as 128 rows (two warpgroups) since session 25, H100: +4.5-5.5% at 32 tokens on 6
// experts, +5-7% at 512 tokens uniform (half the L2 re-reads of each expert's tokens; unlike
// bf16's mma.sync tier, the wgmma tile keeps its rate at half the CTAs).
using WgFp8SmallCfg = WgCfg<true, 2, 32, 5, 4, 2>;
using WgFp8SmallBaseCfg = WgCfg<true, 2, 32, 4, 3, 3>;
// The tiny tile has two stage loops, picked per device (mxfp4_fp8_tiny_plain_loop): skewed, 2
// stages ahead (H100, sessions 34-35: 7-10% faster at 8-128 tokens uniform, ~3 items a CTA,
// +1-5% at one item a CTA), and plain, 3 stages ahead (the H200: every tiny-tile row of its
// session-35 run with the skewed loop read 3-12% slower than session 33's with the plain one, the
// other rows not). A kernel holding both loops, picked per launch, ran the skewed one no faster
// than the plain (session 34): two kernels.
using WgFp8TinyCfg = WgCfg<true, 1, 8, 4, 2, 7, true>;
using WgFp8TinyPlainCfg = WgCfg<true, 1, 8, 4, 3, 7>;
// The float8 wide tile (tile 2, experts of >= 129 rows): warp-specialised, the tokens as wgmma's
// M dimension (mxfp4_moe_fp8_ws_kernel). 256 tokens x 128 weight rows an item, one CTA an SM:
// warpgroups 0 and 1 consume (tokens 128 cw .. +128 as two m64n128 chains a stage, A and B from
// shared memory), warpgroup 2 produces (copies, and the FP4 -> e4m3 decode into the B tile).
// Measured on the H200 (moe_gemm_NOTES.md, sessions 16-17) against the 128 x 128 register-A tile
// it replaced (the same results, bitwise): W4A8 prefill +13-20% (gate_up), +4-15% (down); with
// the copy ring two stages ahead, the weights by TMA and the stores from registers (session 17)
// 1.2-1.4x more. Why the
// shape: with the tokens as M the promotion scales one accumulator row, two scale loads a stage
// instead of 32 (probe: the promotion loop 1.1 -> 1.45 PFLOP/s), and each decoded weight feeds
// 256 tokens, so the one producer warpgroup keeps up.
struct WsFp8Cfg {
  static constexpr bool wgmma = true;
  static constexpr bool fp8 = true;
  static constexpr int consumers = 256;    // warpgroups 0, 1
  static constexpr int producers = 128;    // warpgroup 2
  static constexpr int threads = consumers + producers;
  static constexpr int strips = 8;         // 128 weight rows (wgmma N)
  static constexpr int warp_strips = strips / (producers / 32);  // strips a producer warp decodes
  static constexpr int bm = 256;           // tokens (wgmma M: 2 warpgroups x 2 chains x 64)
  // setmaxnreg: the launch gives 168 a thread; the consumers hold 128 accumulators + 64
  // partials, the producer decodes a strip at a time. (208, not 216: ptxas then spills 2-10
  // instead of 40-64 local loads / stores in the consumers' code, none in the producer's.)
  static constexpr int launch_regs = (65536 / threads) / 8 * 8;
  static constexpr int consumer_regs = 208;
  static constexpr int producer_regs =
      ((threads * launch_regs - consumers * consumer_regs) / producers) / 8 * 8;
  static_assert(producer_regs >= 72 && consumers * consumer_regs + producers * producer_regs <=
                                           threads * launch_regs,
                "setmaxnreg moves registers within the CTA's allocation");
  // Copy slots (4): the token tile (by TMA, K-major, 128-byte swizzle: wgmma's A), the packed
  // words and scale bytes, the tokens' a_scale; the copies run two stages ahead of the decode (a
  // slot is refilled once the consumers released the stage two before its decode). Decoded
  // buffers (2): the e4m3 weights (wgmma's B, the same layout) and the weight rows' factors (per
  // stage for rows without row bases; with row bases, the 2^(B - 133) of the item's epilogue, left
  // at its last stage, whose buffer the consumers then release after their epilogue read it);
  // buffer d % 2 is rewritten at decode d once the consumers released stage d - 2. Each kind in
  // its own array, so that the 1024-byte-aligned tiles pack without padding (4 slots of 42 KB as
  // one struct would not fit beside the schedule).
  static constexpr int stages = 4, ahead = 2;
  static constexpr int b_bytes = bm * kBK;              // tokens
  static constexpr int a_bytes = strips * 16 * kBK;     // decoded weights
  static constexpr int w_bytes = strips * kStripStage;  // packed weights and scale bytes
  static constexpr int s_bytes = bm * 4;                // a_scale
  static constexpr int f_bytes = strips * 16 * 4;       // factors
  static constexpr int w_base = stages * b_bytes, s_base = w_base + stages * w_bytes,
                       dec_base = s_base + stages * s_bytes, f_base = dec_base + 2 * a_bytes;
  static constexpr int pipe_bytes = f_base + 2 * f_bytes;
  static constexpr int tok_off(int s) { return s * b_bytes; }
  static constexpr int w_off(int s) { return w_base + s * w_bytes; }
  static constexpr int s_off(int s) { return s_base + s * s_bytes; }
  static constexpr int dec_off(int d) { return dec_base + d * a_bytes; }
  static constexpr int f_off(int d) { return f_base + d * f_bytes; }
  static_assert(dec_base % 1024 == 0 && w_base % 128 == 0, "tile alignment");
  static constexpr int acc_regs = bm / 2;  // a consumer thread's 2 chains x 64
  // A CTA's items run through the ring as one stream of stages (slot = stream index % stages),
  // so the next item's first stages fill under the last chains and the epilogue of the one
  // before. Named barriers: full[s][cw] = 1 + 2 s + cw. The consumer warpgroups take turns
  // issuing a stage's first chain (ping-pong):
  // full[s][0] completes when the producer handed slot s over AND warpgroup 1 issued its chain of
  // the stage before (count producers + 256); full[s][1] when warpgroup 0 issued its chain of slot
  // s (256), which also means the slot is full.
  // The releases back to the producer (copy slot s refillable, decoded buffer d reusable) are
  // mbarriers (empty_mb, dfree_mb in the kernel), not named barriers: see the kernel's comment.
  static constexpr int bar_full = 1;
  static constexpr int full0_count = producers + 256, full1_count = 256;
  static_assert(bar_full + 2 * stages <= 16, "16 named barriers");
  static_assert(b_bytes % 1024 == 0 && a_bytes % 1024 == 0,
                "swizzled operand tiles on 1024-byte boundaries");
  static_assert(pipe_bytes + (3 * kMxfp4CudaMaxExperts + 1) * 4 + 1024 + 256 * 8 + 112 <=
                    227 * 1024,
                "shared memory budget (ring, schedule, 2 KB of byte tables, mbarriers)");
  static_assert(kMxfp4RowBaseGroup == 64 && strips == 8, "a tile is two row-base groups");
};

// ---- PTX wrappers (the shared ones are in ptx.cuh) ---------------------------------------
// 4 bytes global -> shared when `issue` (predicated, no branch), zero-filled when !valid (src
// must still be a valid address).
__device__ __forceinline__ void cp_async4_if(uint32_t dst, const void* src, bool issue,
                                             bool valid) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n"
      " @p cp.async.ca.shared.global [%0], [%1], 4, %3;\n}\n" ::"r"(dst),
      "l"(src), "r"(static_cast<int>(issue)), "r"(valid ? 4 : 0)
      : "memory");
}

// ---- weight decode -----------------------------------------------------------------------------
// A 32-bit word of a packed block holds 8 e2m1 values; for lane (g = lane/4, t = lane%4), word
// w = 2*s + h (s: 32-group, h: 16-half) holds rows g and g+8 at k 32s + 16h + 4t + j, j = 0..3.
// The bit positions differ per activation type (built by _block_maps in
// python/zeroinfer/ops/moe_gemm.py; the CPU tests emulate these decoders bit for bit).

// bf16 layout -> the k16 step's A fragment: a0 = (g; j0,j1), a1 = (g+8; j0,j1), a2 = (g; j2,j3),
// a3 = (g+8; j2,j3), each a bf16 pair (low half = first value) with bits sgn<<15 | e1 e0 m<<6,
// i.e. the value times 2^-126 (unscaled). Words come in pairs q0, q1 (the two 16-halves h of a
// 32-group): of word q_h, a0 is the word masked, a1 / a2 the word rotated right by 4 / 10 and
// masked. No four rotations of the pair mask tile a 32-bit word (checked exhaustively), so each
// word has 8 bits left over (kLeft); the two words' leftovers merge into one word z, whose
// rotations by 6 and 12 are a3 of h = 0 and h = 1: 2 instructions for z shared by both words,
// 2 for each a3 (the single-word layout took 3 shifts and 3 masks for every a3).
__device__ __forceinline__ void decode_bf16_raw(uint32_t q0, uint32_t q1, int h,
                                                uint32_t (&a)[4]) {
  constexpr uint32_t kPair = 0x81C081C0u;  // sgn 15 | e1 e0 m 8..6, twice
  constexpr uint32_t kLeft = 0x60306030u;  // bits 4, 5, 13, 14 (+16): what the rotations leave
  const uint32_t q = h == 0 ? q0 : q1;
  a[0] = q & kPair;
  a[1] = __funnelshift_r(q, q, 4) & kPair;
  a[2] = __funnelshift_r(q, q, 10) & kPair;
  const uint32_t z = (q0 & kLeft) | (__funnelshift_r(q1, q1, 2) & ~kLeft);
  a[3] = __funnelshift_r(z, z, h == 0 ? 6 : 12) & kPair;
}

// The scaled A fragment of half h of a 32-group s (words q0, q1): decode_bf16_raw, then rows g
// (a0, a2) times m1[s] and rows g + 8 (a1, a3) times m1[2 + s], and the second factors when wide
// (bf16_multipliers below). Exact: every factor is a power of two.
template <bool kWide>
__device__ __forceinline__ void decode_bf16_scaled(uint32_t q0, uint32_t q1, int h,
                                                   const uint32_t (&m1)[4],
                                                   const uint32_t (&m2)[4], int s,
                                                   uint32_t (&a)[4]) {
  decode_bf16_raw(q0, q1, h, a);
  a[0] = bf16x2_mul(a[0], m1[s]);
  a[1] = bf16x2_mul(a[1], m1[2 + s]);
  a[2] = bf16x2_mul(a[2], m1[s]);
  a[3] = bf16x2_mul(a[3], m1[2 + s]);
  if constexpr (kWide) {
    a[0] = bf16x2_mul(a[0], m2[s]);
    a[1] = bf16x2_mul(a[1], m2[2 + s]);
    a[2] = bf16x2_mul(a[2], m2[s]);
    a[3] = bf16x2_mul(a[3], m2[2 + s]);
  }
}

// float8 layout: the 3 code bits of (row g, j) are bits 4j..4j+2 of the word, of (row g+8, j)
// bits 16+4j..; the signs are bits 8j+7 (row g) and 8j+3 (row g+8). W4A8 folds the group's scale
// into e4m3 (see zeroinfer/moe_gemm.h): `lut` holds the e4m3 bytes of the 8 magnitudes
// {0, .5, .., 6} x 2^e for the row's group (e4m3_lut_init), so one prmt picks a row's 4 bytes by
// their code bits and one LOP3 ORs in the signs.
__device__ __forceinline__ void decode_e4m3_lut(uint32_t q, uint2 lg, uint2 l8, uint32_t& rg,
                                                uint32_t& r8) {
  rg = __byte_perm(lg.x, lg.y, q & 0x7777u) | (q & 0x80808080u);
  r8 = __byte_perm(l8.x, l8.y, (q >> 16) & 0x7777u) | ((q << 4) & 0x80808080u);
}

// The e4m3 byte tables, indexed by d = b - s (0..255): entry d = the 8 magnitudes x 2^(6 - d)
// rounded to nearest even (exact for d <= 14, all zero from d = 20). 2 KB of shared memory, built
// once per CTA; indexing by the raw byte difference saves a clamp per group.
constexpr int kE4m3Luts = 256;
// (On every CTA's critical path before the schedule: four entries a thread and store, the float
// built by its bits - the magnitudes' exponents 126..129 plus 6 - d stay normal for d < 20 -
// rather than ldexpf, which was ~50 instructions an entry.)
__device__ __forceinline__ void e4m3_lut_init(uint8_t* luts) {
  for (int i = threadIdx.x; i < kE4m3Luts * 2; i += blockDim.x) {  // entries 4i .. 4i + 3
    const int d = i >> 1;
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t code = (i & 1) * 4 + j, e = code >> 1, m = code & 1;  // e2m1 magnitude code
      // {0, .5, 1, 1.5, 2, 3, 4, 6} as float32 bits: 2^(e-1) x (1 + m / 2), 0.5 for code 1
      const uint32_t mag = code == 0 ? 0u : code == 1 ? 126u << 23 : (126u + e) << 23 | m << 22;
      const float v = code == 0 || d >= 20 ? 0.f : __uint_as_float(mag + ((6 - d) << 23));
      word |= uint32_t{__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)} << (8 * j);
    }
    reinterpret_cast<uint32_t*>(luts)[i] = word;
  }
}

// The largest of a word's four bytes (prmt extracts, no SIMD-byte emulation).
__device__ __forceinline__ uint32_t max_byte(uint32_t x) {
  return max(max(x & 0xffu, __byte_perm(x, 0u, 0x4441u)),
             max(__byte_perm(x, 0u, 0x4442u), x >> 24));
}

// 2^(b - 133) for a UE8M0 byte b, exactly (a float32 subnormal below b = 7), NaN for b = 255;
// branch-free (the W4A8 promotion factor 2^(b-127) * 2^-6).
__device__ __forceinline__ float exp2_b_minus_133(uint32_t b) {
  const uint32_t bits = b >= 7u ? (b - 6u) << 23 : 1u << (b + 16u);
  return b == 255u ? __uint_as_float(0x7fc00000u) : __uint_as_float(bits);
}

// The W4A8 promotion of a stage's wgmma partial into the accumulators (this thread's fragment:
// c0, c1 row g, c2, c3 row g + 8, tokens 8 j + 2 t, +1; sst: the stage's a_scale column): acc +=
// partial * 2^(b-133) * a_scale, the factors fg / f8 of rows g / g + 8 applied by a multiply
// first; kRowBase: the partial is relative to the row base (Mxfp4CudaGemmParams::row_base), so
// the factor waits for the end of the item (scale_rows) and each output costs one fma.
template <bool kRowBase, int kN>
__device__ __forceinline__ void promote_stage(float (&acc)[kN], const float (&part)[kN],
                                              const float* sst, int t, float fg, float f8) {
  auto scaled = [](float x, float f) { return kRowBase ? x : x * f; };
#pragma unroll
  for (int j = 0; j < kN / 4; ++j) {  // this thread's tokens 8 j + 2 t (+1)
    const float2 as = *reinterpret_cast<const float2*>(sst + j * 8 + 2 * t);
    acc[4 * j + 0] = fmaf(scaled(part[4 * j + 0], fg), as.x, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(scaled(part[4 * j + 1], fg), as.y, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(scaled(part[4 * j + 2], f8), as.x, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(scaled(part[4 * j + 3], f8), as.y, acc[4 * j + 3]);
  }
}

// A fragment's rows g (c0, c1) times fg, rows g + 8 (c2, c3) times f8.
template <int kN>
__device__ __forceinline__ void scale_rows(float (&acc)[kN], float fg, float f8) {
#pragma unroll
  for (int i = 0; i < kN; ++i) acc[i] *= (i & 2) ? f8 : fg;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// bf16x2 multipliers for the 4 scale bytes of a lane's block (byte 0: (g, s0), 1: (g, s1),
// 2: (g+8, s0), 3: (g+8, s1)). Narrow (every byte <= 128): m1 = 2^(s-1) (the 2^126 decode bias
// folded in). Wide: m1 = 2^(min(s,128)-1), m2 = 2^(max(s,128)-128), NaN for byte 255.
template <bool kWide>
__device__ __forceinline__ void bf16_multipliers(uint32_t sc, uint32_t (&m1)[4],
                                                 uint32_t (&m2)[4]) {
  const uint32_t lo = (kWide ? __vminu4(sc, 0x80808080u) : sc) + 0x7E7E7E7Eu;  // s + 126
#pragma unroll
  for (int i = 0; i < 4; ++i) m1[i] = __byte_perm(lo, 0u, 0x4040u | (i * 0x0101u)) << 7;
  if constexpr (kWide) {
    const uint32_t hi = __vmaxu4(sc, 0x80808080u) - 0x01010101u;  // max(s,128) - 1
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t b = (sc >> (8 * i)) & 0xffu;
      m2[i] = b == 0xffu ? 0x7FC07FC0u : __byte_perm(hi, 0u, 0x4040u | (i * 0x0101u)) << 7;
    }
  }
}

// ---- one pipeline stage of one warp ------------------------------------------------------------
// A warp's byte offsets into a ring slot, fixed for the kernel (worked out once: the stage loop
// then addresses shared memory as the slot plus these plus immediates).
struct StageOffsets {
  uint32_t w;   // its strip's packed words: warp_n * wn strips in, lane * 16
  uint32_t sc;  // the strip's scale bytes of rows g, g + 8: + 512 + g * 4
  uint32_t a;   // token row warp_m * wt * 8 + g of the activations, column 4 t (bf16)
  template <class C>
  __device__ static StageOffsets of(int lane, int warp_n, int warp_m) {
    const int g = lane >> 2, t = lane & 3;
    const uint32_t strip = static_cast<uint32_t>(warp_n * C::wn * kStripStage);
    StageOffsets o{strip + lane * 16, strip + 512 + g * 4,
                   static_cast<uint32_t>(C::w_bytes + (warp_m * C::wt * 8 + g) * C::a_pitch +
                                         8 * t)};
    // Opaque to the compiler, so it keeps them in registers instead of re-deriving them from the
    // thread index every stage (~7 instructions a stage in the tiny tile otherwise).
    asm volatile("" : "+r"(o.w), "+r"(o.sc), "+r"(o.a));
    return o;
  }
};

// acc[i][j]: strip i (16 weight rows) x token step j (8 tokens), C-fragment order
// (c0: row g, token 2t; c1: row g, token 2t+1; c2: row g+8, token 2t; c3: row g+8, token 2t+1).
// kNJ > 0: exactly kNJ token steps are live (compile time); kNJ == 0: `nj` of them (run time).
template <class C, bool kWide, int kNJ>
__device__ __forceinline__ void compute_stage(const uint8_t* __restrict__ st,
                                              const StageOffsets& o, int nj_dyn,
                                              float (&acc)[C::wn][C::wt][4]) {
  const int nj = kNJ > 0 ? kNJ : nj_dyn;
#pragma unroll
  for (int kb = 0; kb < 2; ++kb) {
    uint4 wq[C::wn];
    uint32_t m1[C::wn][4], m2[C::wn][4];
#pragma unroll
    for (int i = 0; i < C::wn; ++i) {
      const uint8_t* blk = st + i * kStripStage + kb * kBlk;
      wq[i] = *reinterpret_cast<const uint4*>(blk + o.w);
      bf16_multipliers<kWide>(*reinterpret_cast<const uint32_t*>(blk + o.sc), m1[i], m2[i]);
    }
    // The block's four k16 steps decoded first, as four independent chains, then their MMAs in
    // the same order as ever (bitwise the same sums).
    uint32_t a[4][C::wn][4];
#pragma unroll
    for (int sh = 0; sh < 4; ++sh) {
#pragma unroll
      for (int i = 0; i < C::wn; ++i)
        decode_bf16_scaled<kWide>(word_of(wq[i], 2 * (sh >> 1)), word_of(wq[i], 2 * (sh >> 1) + 1),
                                  sh & 1, m1[i], m2[i], sh >> 1, a[sh][i]);
    }
    // (Opaque to the compiler: it would otherwise sink each decode next to its MMAs again.)
#pragma unroll
    for (int sh = 0; sh < 4; ++sh)
#pragma unroll
      for (int i = 0; i < C::wn; ++i)
        asm volatile("" : "+r"(a[sh][i][0]), "+r"(a[sh][i][1]), "+r"(a[sh][i][2]),
                     "+r"(a[sh][i][3]));
#pragma unroll
    for (int sh = 0; sh < 4; ++sh) {
      const int koff = (kb * 64 + 16 * sh) * 2;  // step sh = 2 s + h: k 32 s + 16 h, bf16 bytes
      uint32_t b[C::wt][2];
#pragma unroll
      for (int j = 0; j < C::wt; ++j) {
        if (j < nj) {
          const uint2 v = *reinterpret_cast<const uint2*>(st + o.a + j * 8 * C::a_pitch + koff);
          b[j][0] = v.x;
          b[j][1] = v.y;
        }
      }
#pragma unroll
      for (int i = 0; i < C::wn; ++i) {
#pragma unroll
        for (int j = 0; j < C::wt; ++j) {
          if (j < nj) mma_bf16(acc[i][j], a[sh][i], b[j][0], b[j][1]);
        }
      }
    }
  }
}

// ---- the decode tiles' stage loop ---------------------------------------------------------------
// Stages kt = 0 .. kt_total - 1 as body(checked, r, kt), kU stages an iteration (r = kt % kU, a
// compile-time constant in the unrolled body: the callers' ring slots), end_iteration() after
// each iteration. The stages of whole iterations before kt_main get checked = std::false_type,
// the rest std::true_type: the callers test there (a refill past the end, the last k block) what
// the main loop need not.
template <int kU, class Body, class End>
__device__ __forceinline__ void for_stages(int kt_total, int kt_main, Body&& body,
                                           End&& end_iteration) {
  int kt0 = 0;
#pragma unroll 1
  for (; kt0 + kU <= kt_main; kt0 += kU) {
#pragma unroll
    for (int r = 0; r < kU; ++r) body(std::false_type{}, r, kt0 + r);
    end_iteration();
  }
#pragma unroll 1
  for (; kt0 < kt_total; kt0 += kU) {
#pragma unroll
    for (int r = 0; r < kU; ++r) {
      if (kt0 + r >= kt_total) break;
      body(std::true_type{}, r, kt0 + r);
    }
    end_iteration();
  }
}

// ---- programmatic launch ------------------------------------------------------------------------
// Every launch of these kernels is programmatic (launch_variant, launch.cuh), so a CTA may be
// resident while the kernel before it in the stream (the previous tier, the gate/up GEMM before
// the down one, the dispatch) still runs: its launch and shared-memory set-up (the e4m3 tables,
// the mbarriers) hide behind that kernel's tail. Each kernel calls await_earlier_kernels before
// anything touches global memory: the schedule, which reads the routing, comes first.

// ---- device-side schedule ----------------------------------------------------------------------
// prefix[e] = tiles of the experts before e (bm rows per tile); prefix[E] = total tiles.
template <class C>
__device__ void build_schedule(const Mxfp4CudaGemmParams& p, int* prefix, int* row0, int* cnt) {
  const int E = static_cast<int>(p.num_experts);
  const int tid = threadIdx.x;
  const int per = (E + C::threads - 1) / C::threads;
  const int e0 = min(E, tid * per), e1 = min(E, e0 + per);
  int sum = 0;
  for (int e = e0; e < e1; ++e) {
    int r0, c;
    if (p.masked_m != nullptr) {
      r0 = e * static_cast<int>(p.cap);
      c = min(max(p.masked_m[e], 0), static_cast<int>(p.cap));
    } else {
      const int m = static_cast<int>(p.m);
      const int lo = min(max(p.expert_offsets[e], 0), m);
      const int hi = min(max(p.expert_offsets[e + 1], lo), m);
      r0 = lo;
      c = p.expert_counts != nullptr ? min(max(p.expert_counts[e], 0), hi - lo) : hi - lo;
    }
    if (c < p.rows_lo || c >= p.rows_hi) c = 0;  // another launch of a split plan has e
    row0[e] = r0;
    cnt[e] = c;
    sum += (c + C::bm - 1) / C::bm;
  }
  int total;
  int before = block_exclusive_scan(sum, &total);
  for (int e = e0; e < e1; ++e) {
    prefix[e] = before;
    before += (cnt[e] + C::bm - 1) / C::bm;
  }
  if (tid == 0) prefix[E] = total;
  __syncthreads();
}

// The routed layout (Mxfp4CudaGemmParams::route_ids): cnt[e] from the ids (shared-memory atomics:
// a count does not depend on the order they land in), row0 / prefix from one scan of both sums,
// then rowmap[v] = the output row at place v of the row order, the rows sorted stably by expert:
// warp 0 walks the ids 32 at a time in row order, __match_any_sync ranking equal experts, so
// every CTA builds the same map (the CPU twin's `order`; a tile's rows must be the same rows in
// each CTA that runs one of its column tiles). Warp 0 loads its ids first, before the counts, so
// they are in registers when the walk starts.
template <class C>
__device__ void build_routed_schedule(const Mxfp4CudaGemmParams& p, int* prefix, int* row0,
                                      int* cnt, uint16_t* rowmap) {
  constexpr int kChunks = static_cast<int>(kMxfp4RoutedMaxRows / 32);
  const int E = static_cast<int>(p.num_experts), m = static_cast<int>(p.m);
  const int tid = threadIdx.x, lane = tid & 31;
  auto expert_at = [&](int i) {
    const int e = i < m ? p.route_ids[i] : -1;
    return e >= 0 && e < E ? e : -1;
  };
  int ids[kChunks];
  if (tid < 32) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) ids[c] = expert_at(c * 32 + lane);
  }
  for (int e = tid; e < E; e += C::threads) cnt[e] = 0;
  __syncthreads();
  for (int i = tid; i < m; i += C::threads) {
    const int e = expert_at(i);
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  // Rows (high 16 bits) and tiles (low) of the thread's experts, scanned together: both <= m.
  static_assert(kMxfp4RoutedMaxRows < (1 << 15), "rows and tiles share one int");
  const int per = (E + C::threads - 1) / C::threads;
  const int e0 = min(E, tid * per), e1 = min(E, e0 + per);
  int sum = 0;
  for (int e = e0; e < e1; ++e) {
    int c = cnt[e];
    if (c < p.rows_lo || c >= p.rows_hi) cnt[e] = c = 0;  // another launch of a split plan has e
    sum += c << 16 | (c + C::bm - 1) / C::bm;
  }
  int total;
  const int before = block_exclusive_scan(sum, &total);
  int rows = before >> 16, tiles = before & 0xffff;
  for (int e = e0; e < e1; ++e) {
    row0[e] = rows;
    prefix[e] = tiles;
    rows += cnt[e];
    tiles += (cnt[e] + C::bm - 1) / C::bm;
  }
  if (tid == 0) prefix[E] = total & 0xffff;
  __syncthreads();
  if (tid < 32) {  // row0[e] serves as expert e's cursor, and ends cnt[e] further on
    const unsigned below = (1u << lane) - 1u;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (c * 32 >= m) break;
      const int e = ids[c] >= 0 && cnt[ids[c]] > 0 ? ids[c] : -1;
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      const int base = e >= 0 ? row0[e] : 0;
      if (e >= 0) rowmap[base + __popc(peers & below)] = static_cast<uint16_t>(c * 32 + lane);
      __syncwarp();
      if (e >= 0 && (peers & below) == 0) row0[e] = base + __popc(peers);
      __syncwarp();
    }
  }
  __syncthreads();
  for (int e = e0; e < e1; ++e) row0[e] -= cnt[e];
  __syncthreads();
}

// The device-side schedule in shared memory (after the pipeline: `sched`) and the work item
// a CTA runs: (tile slot, N tile) -> its expert's rows and weight strips.
struct ItemTile {
  int tile_row0, tile_rows;  // first row of a / out of the tile, rows in it (>= 1)
  int strip0, strips_valid;  // first packed 16-row strip, strips of the tile that exist
  const uint8_t* wtile;      // the packed weights of its first 64-row group
  const uint8_t* row_base;   // their W4A8 row bases (Mxfp4CudaGemmParams::row_base) or nullptr
};

// Stage 0 of strip `strip` of a tile whose weights start at `wtile` (a 64-row group's start:
// every tile is 4 or 8 strips from a multiple of its width); its stage kt is kt * kGroupStage on.
__device__ __forceinline__ const uint8_t* strip_stages(const uint8_t* wtile, int strip,
                                                       int64_t kb_total) {
  return wtile + static_cast<int64_t>(strip & ~(kMxfp4GroupStrips - 1)) * kb_total * kBlk +
         (strip & (kMxfp4GroupStrips - 1)) * kStripStage;
}

// kRouted: the routed layout; the tiles' rows are then places of the row order, rowmap[place] the
// output row (the activation row is that / route_div).
template <class C, bool kRouted = false>
struct Schedule {
  int E, strips_total, n_tiles;
  int64_t kb_total, items;
  int *prefix, *row0, *cnt;
  uint16_t* rowmap;

  __device__ Schedule(const Mxfp4CudaGemmParams& p, uint8_t* sched) {
    E = static_cast<int>(p.num_experts);
    prefix = reinterpret_cast<int*>(sched);
    row0 = prefix + (E + 1);
    cnt = row0 + E;
    rowmap = reinterpret_cast<uint16_t*>(cnt + E);
    if constexpr (kRouted)
      build_routed_schedule<C>(p, prefix, row0, cnt, rowmap);
    else
      build_schedule<C>(p, prefix, row0, cnt);
    strips_total = static_cast<int>(p.n_pad / 16);
    n_tiles = (strips_total + C::strips - 1) / C::strips;
    kb_total = p.k_pad / 64;
    items = static_cast<int64_t>(prefix[E]) * n_tiles;
  }

  // The largest e with prefix[e] <= slot (the expert that owns tile slot `slot`), found by the
  // whole warp 32 ways at a time: lane l tests the first expert of the l-th of 32 groups of the
  // candidates, a ballot picks the last group that starts at or before the slot (prefix is
  // non-decreasing, prefix[0] = 0), and the search narrows to it: two rounds at 256 experts, each
  // one shared-memory load, instead of eight dependent ones of a binary search (the item
  // prologue's largest stall in Nsight Compute, session 12). Every lane of the warp must call it.
  __device__ int expert_of(int slot) const {
    const int lane = threadIdx.x & 31;
    int lo = 0, hi = E;  // the answer lies in [lo, hi); prefix[lo] <= slot
    while (hi - lo > 1) {
      const int stride = (hi - lo + 31) >> 5;
      const int e = lo + lane * stride;
      const unsigned ok = __ballot_sync(0xffffffffu, e < hi && prefix[e] <= slot);
      lo += (31 - __clz(ok)) * stride;
      hi = min(hi, lo + stride);
    }
    return lo;
  }

  __device__ ItemTile tile_of(const Mxfp4CudaGemmParams& p, int64_t it) const {
    const int slot = static_cast<int>(it / n_tiles);
    const int nt = static_cast<int>(it - static_cast<int64_t>(slot) * n_tiles);
    // (The wgmma kernels keep the binary search: with the warp search ptxas allocated their
    // float8 stage loops differently, +4 SASS instructions a stage, and they measured 1-2.4%
    // slower, while the mma.sync kernels gained 1-2%; session 12.)
    int e;
    if constexpr (C::wgmma) {
      int lo = 0, hi = E - 1;  // largest e with prefix[e] <= slot (it owns >= 1 tile)
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (prefix[mid] <= slot)
          lo = mid;
        else
          hi = mid - 1;
      }
      e = lo;
    } else {
      e = expert_of(slot);
    }
    const int mt = slot - prefix[e];
    ItemTile w;
    w.tile_row0 = row0[e] + mt * C::bm;
    w.tile_rows = min(C::bm, cnt[e] - mt * C::bm);
    w.strip0 = nt * C::strips;
    w.strips_valid = min(C::strips, strips_total - w.strip0);
    // (a group holds kMxfp4GroupStrips strips' bytes, so strip0 * a strip's bytes is its start)
    static_assert(C::strips % kMxfp4GroupStrips == 0, "tiles are whole 64-row groups");
    w.wtile = p.w_packed + (static_cast<int64_t>(e) * strips_total + w.strip0) * kb_total * kBlk;
    w.row_base = p.row_base != nullptr
                     ? p.row_base + (static_cast<int64_t>(e) * strips_total + w.strip0) * 16
                     : nullptr;
    return w;
  }
};

__device__ __forceinline__ void store_out(void* out, bool bf16, int64_t idx, float v) {
  if (bf16)
    static_cast<__nv_bfloat16*>(out)[idx] = __float2bfloat16_rn(v);
  else
    static_cast<float*>(out)[idx] = v;
}

// The SwiGLU clip of a call: its limit, or +inf without one (the clip's selects then keep every
// value, so one branch-free code path serves both).
__device__ __forceinline__ float swiglu_limit(const Mxfp4CudaGemmParams& p) {
  return p.has_swiglu_limit ? p.swiglu_limit : INFINITY;
}

// V4 clipped SwiGLU, NaN-propagating like the reference (x > NaN is false). Selects, not a branch
// on whether there is a limit: with the branch, ptxas made every SwiGLU of the unrolled epilogues
// its own basic block, so none overlapped another's MUFU latency.
__device__ __forceinline__ float swiglu(float gt, float up, float lim) {
  gt = gt > lim ? lim : gt;
  up = up > lim ? lim : (up < -lim ? -lim : up);
  // MUFU ex2 / rcp (__expf, __fdividef: a few ulp of float32 before the bf16 rounding) instead of
  // the IEEE expf and division: those were ~16% of the float8 wide tile's consumer time (its
  // epilogue, where neither warpgroup feeds the tensor cores; Nsight Compute, session 17). For
  // gt < -87 the quotient flushes to 0 (the exact value is < 1e-36).
  return __fdividef(gt, 1.f + __expf(-gt)) * up;
}

// The outputs of one C fragment (16 weight rows of packed strip `strip` x tile-local tokens tok,
// tok + 1; c0 / c1: row g, c2 / c3: row g + 8): put(token, column, value) for each, as SwiGLU pairs
// (gate row g, up row g + 8 of a gate/up-interleaved strip) or plain rows. The one place that
// knows the fragment -> output mapping.
template <class Put>
__device__ __forceinline__ void fragment_outputs(const Mxfp4CudaGemmParams& p, int strip, int g,
                                                 int tok, const float* c, Put&& put) {
  if (p.fuse_swiglu) {
    const float lim = swiglu_limit(p);
#pragma unroll
    for (int u = 0; u < 2; ++u)
      put(tok + u, strip * 8 + g, [&] { return swiglu(c[u], c[2 + u], lim); });
  } else {
#pragma unroll
    for (int x = 0; x < 4; ++x)
      put(tok + (x & 1), strip * 16 + g + (x >> 1) * 8, [&] { return c[x]; });
  }
}

// One C fragment to the output; rows past n_out and tokens past tile_rows dropped. rowmap: the
// routed layout's row order (the output row of tile row tile_row0 + tk), nullptr: the identity.
__device__ __forceinline__ void store_fragment(const Mxfp4CudaGemmParams& p, bool out_bf16,
                                               int n_out, int strip, int g, int tok,
                                               int tile_row0, int tile_rows, const uint16_t* rowmap,
                                               const float* c) {
  fragment_outputs(p, strip, g, tok, c, [&](int tk, int col, auto value) {
    if (col < n_out && tk < tile_rows) {
      const int row = rowmap != nullptr ? rowmap[tile_row0 + tk] : tile_row0 + tk;
      store_out(p.out, out_bf16, static_cast<int64_t>(row) * n_out + col, value());
    }
  });
}

// ---- the kernel --------------------------------------------------------------------------------
// kWide: some scale byte exceeds 128 (Mxfp4CudaGemmParams::wide_scales), so the bf16 decode
// multiplies twice; a template parameter so the narrow decode is straight-line code. kRouted: the
// routed layout (route_ids): each activation row is gathered through the schedule's row map and
// each output row scattered through it; the copies are otherwise the same.
template <class C, bool kWide, bool kRouted>
__global__ void __launch_bounds__(C::threads, C::min_blocks)
    mxfp4_moe_kernel(const __grid_constant__ Mxfp4CudaGemmParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  await_earlier_kernels();  // (the schedule reads offsets / counts or ids: earlier outputs)
  const Schedule<C, kRouted> sch(p, smem + C::pipe_bytes);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_n = warp % C::warps_n, warp_m = warp / C::warps_n;
  const int g = lane >> 2, t = lane & 3;
  const int64_t items = sch.items;
  const int k = static_cast<int>(p.k);
  const int kt_total = static_cast<int>(p.k_pad / kBK);
  const int64_t kb_total = sch.kb_total;
  const bool out_bf16 = p.out_dtype == DType::kBFloat16;
  constexpr int kEsize = 2;  // bf16
  const int n_out = static_cast<int>(p.fuse_swiglu ? p.n / 2 : p.n);

#pragma unroll 1
  for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    // (row_base: float8 only)
    const auto [tile_row0, tile_rows, strip0, strips_valid, wtile, row_base] = sch.tile_of(p, it);
    const int warp_tok0 = warp_m * C::wt * 8;
    const int nj = min(max((tile_rows - warp_tok0 + 7) / 8, 0), C::wt);
    const bool warp_active = nj > 0 && warp_n * C::wn < strips_valid;

    // (routed: row 0, the base the gathered rows' offsets add to)
    const uint8_t* atile = static_cast<const uint8_t*>(p.a) +
                           (kRouted ? 0 : static_cast<int64_t>(tile_row0) * k * kEsize);

    // Warp w copies its own strip's stage, chunks lane + 32 u of the strip's contiguous
    // kStripStage bytes, so a chunk's addresses are one add from the stage's. A warp whose strip
    // is past the weight rows (an edge tile) copies strip 0 again into its own slot, unread: no
    // branch in the stage loop.
    const uint8_t* w_src =
        strip_stages(wtile, warp < strips_valid ? warp : 0, kb_total) + lane * 16;
    const uint32_t w_dst = static_cast<uint32_t>(warp * kStripStage + lane * 16);

    // Activation chunks: thread tid copies 16-byte chunk a_cc of rows a_r0 + u * kRowStep; the
    // row / column split is computed once per item.
    constexpr int kRowStep = C::threads / C::chunks_per_row;
    static_assert(C::threads % C::chunks_per_row == 0, "a thread's chunks share one column");
    constexpr int kAChunks = (C::bm + kRowStep - 1) / kRowStep;
    const int a_r0 = tid / C::chunks_per_row, a_cc = tid - a_r0 * C::chunks_per_row;
    const int64_t a_off0 = (static_cast<int64_t>(a_r0) * k + a_cc * (16 / kEsize)) * kEsize;
    const uint32_t a_dst0 = static_cast<uint32_t>(C::w_bytes + a_r0 * C::a_pitch + a_cc * 16);
    // The warp's offsets into a ring slot (the same for every item).
    const StageOffsets so = StageOffsets::of<C>(lane, warp_n, warp_m);
    // Per item: the thread's first source chunk, how many of its rows the tile holds, and the
    // stages whose k block still covers its column (later ones zero-fill: k % kBK != 0).
    // (A thread whose first row is past the tile names row 0's chunk instead, zero-filled: a
    // valid address, a_rows = 0.)
    const uint8_t* a_src = atile + (!kRouted && tile_rows > a_r0 ? a_off0 : a_cc * 16);
    const int a_rows = tile_rows > a_r0 ? (tile_rows - a_r0 + kRowStep - 1) / kRowStep : 0;
    const int a_col = a_cc * (16 / kEsize);
    const int a_kt_end = k > a_col ? (k - a_col + kBK - 1) / kBK : 0;
    const int64_t a_row_step = static_cast<int64_t>(kRowStep) * k * kEsize;
    // Routed: the byte offset of each of the thread's rows from a_src (its activation row through
    // the row map; 0 past the tile). Contiguous: u * a_row_step.
    uint32_t a_gather[kRouted ? kAChunks : 1] = {};
    if constexpr (kRouted) {
      const int div = static_cast<int>(p.route_div);
#pragma unroll
      for (int u = 0; u < kAChunks; ++u) {
        if (u < a_rows)
          a_gather[u] = static_cast<uint32_t>(sch.rowmap[tile_row0 + a_r0 + u * kRowStep] / div) *
                        static_cast<uint32_t>(k * kEsize);
      }
    }
    auto a_row_off = [&](int u) -> int64_t {
      if constexpr (kRouted)
        return a_gather[u];
      else
        return u * a_row_step;
    };

    // The copies of one stage into the ring slot at shared address `slot`: the weights from
    // w_src (this lane's first chunk of the stage), the tokens from a_src (its first row's chunk),
    // zero-filled past k (a_live false; the rows then read nothing, from a valid address).
    // The stage loop below only advances these addresses (a constant step a stage), so a stage's
    // bookkeeping is a few adds.
    const bool w_last = lane + 64 < kStripChunks;  // the third chunk of the lane (68 chunks)
    static_assert(kStripChunks > 64 && kStripChunks <= 96, "three chunks a lane a stage");
    auto load_stage = [&](uint32_t slot, const uint8_t* ws, const uint8_t* as, bool a_live) {
      const uint32_t wd = slot + w_dst;
      cp_async16(wd, ws, true);
      cp_async16(wd + 512, ws + 512, true);
      cp_async16_if(wd + 1024, ws + 1024, w_last);
      // (Rows past the tile are zero-filled rather than skipped: no branch; their token columns
      // are never stored. A zero-fill still names a valid address: a row past the tile names
      // row 0's chunk, a stage past k the tile's first byte.)
      const uint32_t ad = slot + a_dst0;
#pragma unroll
      for (int u = 0; u < kAChunks; ++u) {
        const bool live = a_live && u < a_rows;
        const uint8_t* src = a_live ? as + (u < a_rows ? a_row_off(u) : 0) : atile;
        cp_async16(ad + u * kRowStep * C::a_pitch, src, live);
      }
    };

    float acc[C::wn][C::wt][4];
#pragma unroll
    for (int i = 0; i < C::wn; ++i)
#pragma unroll
      for (int j = 0; j < C::wt; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

    const uint32_t ring = smem_u32(smem);
#pragma unroll 1
    for (int s = 0; s < C::stages - 1; ++s) {
      if (s < kt_total)
        load_stage(ring + s * C::stage_bytes, w_src + s * kGroupStage, a_src + s * (kBK * kEsize),
                   s < a_kt_end);
      cp_async_commit();
    }
    // Stage kt is read from slot kt % stages; stage nk = kt + stages - 1 is copied at stage kt
    // into slot (kt - 1) % stages, the one stage kt - 1 was read from (every warp is past it: the
    // barrier). The tiny tile's loop runs `stages` stages an iteration, so its slot addresses are
    // the ring's plus constants and the sources advance once an iteration (with the untested main
    // loop and the branch-free copies, SASS a stage 207 -> 156). The small tile's loop stays
    // rolled: its stage holds four token-step variants, and unrolled it is no leaner a stage
    // (moe_gemm_NOTES.md, session 11).
    constexpr int kU = C::wt == 1 ? C::stages : 1;  // stages an iteration
    const uint8_t* w_next = w_src + (C::stages - 1) * kGroupStage;
    const uint8_t* a_next = a_src + (C::stages - 1) * (kBK * kEsize);
    int slot0 = 0;  // the slot of the iteration's first stage (always 0 when kU == stages)
    // One stage: r its place in the iteration. kChecked: the copy it issues (stage kt + stages
    // - 1) may be past the end or hold the partial last k block; the main loop's stages copy
    // whole in-range blocks only, so they carry neither test.
    auto stage = [&](auto checked, int r, int kt) {
      constexpr bool kChecked = decltype(checked)::value;
      const int rs = kU == C::stages ? r : slot0;
      const int ws = rs == 0 ? C::stages - 1 : rs - 1;
      cp_async_wait<C::stages - 2>();
      __syncthreads();
      const int nk = kt + C::stages - 1;
      if (!kChecked || nk < kt_total)
        load_stage(ring + ws * C::stage_bytes, w_next + r * kGroupStage,
                   a_next + r * (kBK * kEsize), !kChecked || nk < a_kt_end);
      cp_async_commit();
      const uint8_t* st = smem + rs * C::stage_bytes;
      if (warp_active) {
        if constexpr (C::wt == 1) {  // tiny decode tile: one live token step
          compute_stage<C, kWide, 1>(st, so, nj, acc);
        } else {  // small decode tile: one variant per live token-step count
          static_assert(C::wt == 4, "the mma.sync tiles are 8 or 32 tokens wide");
          if (nj == 1)
            compute_stage<C, kWide, 1>(st, so, nj, acc);
          else if (nj == 2)
            compute_stage<C, kWide, 2>(st, so, nj, acc);
          else if (nj == 3)
            compute_stage<C, kWide, 3>(st, so, nj, acc);
          else
            compute_stage<C, kWide, 4>(st, so, nj, acc);
        }
      }
    };
    auto next_iteration = [&] {
      w_next += kU * kGroupStage;
      a_next += kU * (kBK * kEsize);
      if constexpr (kU != C::stages) slot0 = slot0 == C::stages - 1 ? 0 : slot0 + 1;
    };
    // Main loop: every stage it copies (up to kt + stages - 1) is a whole k block.
    for_stages<kU>(kt_total, min(kt_total, k / kBK) - (C::stages - 1), stage, next_iteration);
    cp_async_wait<0>();
    __syncthreads();  // the next item's prologue overwrites every stage

    if (warp_active) {
#pragma unroll
      for (int i = 0; i < C::wn; ++i) {
#pragma unroll
        for (int j = 0; j < C::wt; ++j) {
          if (j < nj)  // tile-local tokens warp_tok0 + 8 j + 2 t (+1)
            store_fragment(p, out_bf16, n_out, strip0 + warp_n * C::wn + i, g,
                           warp_tok0 + j * 8 + 2 * t, tile_row0, tile_rows,
                           kRouted ? sch.rowmap : nullptr, acc[i][j]);
        }
      }
    }
  }
}

// Named barrier `id` over `n` threads: wait for them all / arrive without waiting.
__device__ __forceinline__ void bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// The wgmma tiles' output: the tile's C fragments go through shared memory (the drained ring) as
// a [token][column] tile of the output dtype, then leave as 16-byte row chunks: the fragments'
// own stores would be 2-4-byte scatters (swap-AB puts tokens across lanes). Rows past tile_rows
// and columns past n_out are not written; a misaligned output takes element stores.
template <class C>
__device__ __forceinline__ void store_tile_staged(const Mxfp4CudaGemmParams& p, bool out_bf16,
                                                  int n_out, uint8_t* smem, int strip0,
                                                  int tile_row0, int tile_rows,
                                                  bool strip_active, const float* acc) {
  constexpr int kCols = C::strips * 16;  // plain output columns of a tile (SwiGLU: half)
  const int tid = threadIdx.x, lane = tid & 31, sidx = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int esize = out_bf16 ? 2 : 4;
  const int cols = p.fuse_swiglu ? kCols / 2 : kCols;
  const int col0 = strip0 * (p.fuse_swiglu ? 8 : 16);
  // +16 bytes a row: the 4 token rows a warp's store touches fall in different banks.
  const int pitch = cols * esize + 16;
  auto put = [&](int tok, int col, float v) {
    uint8_t* d = smem + tok * pitch + col * esize;
    if (out_bf16)
      *reinterpret_cast<__nv_bfloat16*>(d) = __float2bfloat16_rn(v);
    else
      *reinterpret_cast<float*>(d) = v;
  };
  if (strip_active) {
    const int nj = (tile_rows + 7) / 8;
#pragma unroll
    for (int j = 0; j < C::bm / 8; ++j) {
      if (j < nj)  // (tile-local columns: the strip's index within the tile)
        fragment_outputs(p, sidx, g, j * 8 + 2 * t, acc + 4 * j,
                         [&](int tok, int col, auto value) { put(tok, col, value()); });
    }
  }
  __syncthreads();
  const int cols_here = min(cols, n_out - col0);  // > 0: the tile has a valid strip
  const int chunks = cols * esize / 16;           // 16-byte chunks of a token row
  const bool vec = (reinterpret_cast<uintptr_t>(p.out) & 15) == 0 && (n_out * esize) % 16 == 0;
  uint8_t* out = static_cast<uint8_t*>(p.out);
  for (int i = tid; i < tile_rows * chunks; i += C::threads) {
    const int r = i / chunks, ch = i - r * chunks;
    const int c = ch * (16 / esize);  // first column of the chunk
    if (c >= cols_here) continue;
    const uint8_t* src = smem + r * pitch + ch * 16;
    uint8_t* dst = out + (static_cast<int64_t>(tile_row0 + r) * n_out + col0 + c) * esize;
    if (vec && c + 16 / esize <= cols_here) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < 16 / esize && c + e < cols_here; ++e) {
        if (out_bf16)
          reinterpret_cast<uint16_t*>(dst)[e] = reinterpret_cast<const uint16_t*>(src)[e];
        else
          reinterpret_cast<uint32_t*>(dst)[e] = reinterpret_cast<const uint32_t*>(src)[e];
      }
    }
  }
  __syncthreads();  // the next item's prologue overwrites the ring
}

// ---- the wgmma tile ----------------------------------------------------------------------------

template <class C, bool kWide>
__global__ void __launch_bounds__(C::threads, C::min_blocks)
    mxfp4_moe_wgmma_kernel(const __grid_constant__ Mxfp4CudaGemmParams p) {
  // The 128-byte swizzle needs the ring 1024-byte aligned: declared, so that no stage loop
  // carries the padding arithmetic (checked once, below).
  // (Its own name: the kernels' extern arrays are one symbol per name, alignment included.)
  extern __shared__ __align__(1024) uint8_t wg_smem[];
  uint8_t* smem = wg_smem;
  // float8: the e4m3 byte tables (their barrier is the schedule's).
  __shared__ uint2 luts[C::fp8 ? kE4m3Luts : 1];
  if constexpr (C::fp8) e4m3_lut_init(reinterpret_cast<uint8_t*>(luts));
  if (threadIdx.x == 0 && (smem_u32(smem) & 1023u) != 0) __trap();
  await_earlier_kernels();
  // The schedule arrays sit after the pipeline.
  const Schedule<C> sch(p, smem + C::pipe_bytes);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sidx = warp;  // warpgroup cw = warp / 4 owns strips 4 cw .. 4 cw + 3
  const int g = lane >> 2, t = lane & 3;
  const int64_t items = sch.items;
  const int k = static_cast<int>(p.k);
  const int kt_total = static_cast<int>(p.k_pad / kBK);
  const int64_t kb_total = sch.kb_total;
  const bool out_bf16 = p.out_dtype == DType::kBFloat16;
  const int n_out = static_cast<int>(p.fuse_swiglu ? p.n / 2 : p.n);
  // B tile copies: thread tid owns 16-byte chunk bc of a token's k block (16 chunks in two
  // 64-k panels for bf16, 8 in one for e4m3) of token rows brow + kBRowStep u; the swizzled
  // position of the chunk is the same in each of them (row % 8 is fixed).
  constexpr int kEsize = C::fp8 ? 1 : 2;
  constexpr int kChunksPerRow = C::b_row_bytes / 16;
  const int bc = tid % kChunksPerRow, brow = tid / kChunksPerRow;
  constexpr int kBRowStep = C::threads / kChunksPerRow;
  constexpr int kBUnits = (C::bm + kBRowStep - 1) / kBRowStep;  // rows past bm are never copied
  static_assert(kBRowStep % 8 == 0, "a thread's rows share row % 8");
  const uint32_t b_dst0 =
      (bc >> 3) * (C::bm * 128) + brow * 128 + (((bc & 7) ^ (brow & 7)) << 4);
  // bf16 reads the k-slot copy of the activations, e4m3 the activations themselves.
  const uint8_t* b_act = static_cast<const uint8_t*>(C::fp8 ? p.a : p.a_kslot);
  const int64_t b_row_step = static_cast<int64_t>(kBRowStep) * k * kEsize;  // a thread's rows

#pragma unroll 1
  for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const auto [tile_row0, tile_rows, strip0, strips_valid, wtile, row_base] = sch.tile_of(p, it);
    const bool strip_active = sidx < strips_valid;
    // float8: the W4A8 row bases of rows g (byte 0) and g + 8 (byte 2) of the warp's strip
    // (Mxfp4CudaGemmParams::row_base), read early, and whether the warpgroup runs the row-base
    // stage loop: iff the first row of its 64 has a base (a 64-row group's rows all have one or
    // none). One decision for the warpgroup whatever the values (its wgmma chains must be one
    // code path; strip_active is uniform over it, see WgCfg); the vote tells the compiler that
    // the decision is warp-uniform.
    uint32_t rb = 0;
    bool row_based = false;
    if constexpr (C::fp8) {
      if (row_base != nullptr && strip_active) {
        rb = row_base[sidx * 16 + g] | uint32_t{row_base[sidx * 16 + g + 8]} << 16;
        row_based = row_base[(sidx & ~3) * 16] != 0;
      }
      row_based = __all_sync(0xffffffffu, row_based);
    }
    // Stage kt of the ring slot: the weights of this tile's strips, the B tile (rows past the
    // tile are zero-filled, not read: they only feed output columns that are discarded; k past
    // the end is zero-filled too, since it would feed every column) and, for e4m3, the tokens'
    // a_scale column.
    // (A thread whose B rows are all past the tile names the tile's first row instead: its
    // copies are zero-fills, from a valid address.)
    int b_rows = 0;  // this thread's B rows in the tile
#pragma unroll
    for (int u = 0; u < kBUnits; ++u) b_rows += brow + u * kBRowStep < tile_rows ? 1 : 0;
    const uint8_t* b_src0 =
        b_act + (static_cast<int64_t>(tile_row0) + (b_rows > 0 ? brow : 0)) * k * kEsize +
        bc * 16;
    // Warp w copies its own strip's stage (68 16-byte chunks, lanes + 32 u): addresses are one
    // add per chunk. A warp whose strip is past the weights (the second warpgroup of an edge
    // tile) copies strip 0 again into its own slot, unread: no branch around the copies.
    // The stage loop copies stages in order, so the sources advance by a constant a stage (a
    // stage's bookkeeping is a few adds, not 64-bit index arithmetic).
    const uint8_t* w_next = strip_stages(wtile, strip_active ? sidx : 0, kb_total) + lane * 16;
    const uint32_t w_dst = static_cast<uint32_t>(C::b_ring + sidx * kStripStage + lane * 16);
    const bool w_last = lane + 64 < kStripChunks;  // the lane's third chunk (68 chunks)
    static_assert(kStripChunks > 64 && kStripChunks <= 96, "three chunks a lane a stage");
    const uint8_t* b_next = b_src0;
    // float8: thread tid < bm copies token tid's scale (zero-filled past the tile, from the
    // first scale: a valid address).
    const bool s_row = C::fp8 && tid < tile_rows;
    const float* s_next =
        p.a_scale +
        (s_row ? static_cast<int64_t>(tile_row0 + tid) * p.a_scale_row_stride : 0);
    const int64_t s_kstep = p.a_scale_k_stride;
    auto load_stage = [&](int slot_idx, int kt) {
      const uint32_t dst = smem_u32(smem) + w_dst + slot_idx * C::ws_bytes;
      cp_async16(dst, w_next, true);
      cp_async16(dst + 512, w_next + 512, true);
      cp_async16_if(dst + 1024, w_next + 1024, w_last);
      w_next += kGroupStage;
      uint8_t* ws = smem + C::b_ring + slot_idx * C::ws_bytes;
      // (k past the end, bf16 only: zero-filled from a valid dummy address, the same for every
      // row; float8 has k % 128 == 0.)
      const bool kvalid = C::fp8 || kt * kBK + bc * (16 / kEsize) < k;
      const uint32_t bdst = smem_u32(smem + slot_idx * C::b_bytes) + b_dst0;
      const uint8_t* bsrc = kvalid ? b_next : b_act;
      const int64_t bstep = kvalid ? b_row_step : 0;
#pragma unroll
      for (int u = 0; u < kBUnits; ++u) {  // rows past bm: not issued; past the tile: zeros
        const bool live = kvalid && u < b_rows;
        const void* src = bsrc + (u < b_rows ? u * bstep : 0);
        if constexpr (C::bm % kBRowStep == 0)
          cp_async16(bdst + u * kBRowStep * 128, src, live);
        else
          cp_async16_if(bdst + u * kBRowStep * 128, src, brow + u * kBRowStep < C::bm, live);
      }
      b_next += C::b_row_bytes;
      if constexpr (C::fp8) {  // k % 128 == 0 for e4m3: every stage is whole
        cp_async4_if(smem_u32(ws + C::w_bytes + tid * 4), s_next, tid < C::bm, s_row);
        s_next += s_kstep;
      }
    };
    float acc[C::acc_regs];
#pragma unroll
    for (int i = 0; i < C::acc_regs; ++i) acc[i] = 0.f;

    // Prologue: stages 0 .. ahead-1 in flight.
#pragma unroll 1
    for (int st = 0; st < C::ahead; ++st) {
      if (st < kt_total) load_stage(st, st);
      cp_async_commit();
    }

    // This thread's copies of the oldest pending stage landed -> visible to the tensor cores'
    // async proxy, then everyone's (the barrier, which also orders every warp's last reads of the
    // slot refilled next).
    auto stage_landed = [&]() {
      cp_async_wait<C::ahead - 1>();
      wgmma::fence_proxy_async();
      __syncthreads();
    };
    if constexpr (!C::fp8) {
      int rd_slot = 0, wr_slot = C::ahead;
      // One k stage: 8 k16 steps, one wgmma group each; step s's A fragment is decoded
      // (SIMT) into register set s & 1 while step s-1's wgmma runs; wait<1> after each issue
      // retires the group that read the set the next decode overwrites (and, at a stage's last
      // step, every group of the stage before); the wgmma of a stage's last step is still running
      // when the next stage starts.
      uint32_t a[2][4];
#pragma unroll 1
      for (int kt = 0; kt < kt_total; ++kt) {
        // (The refill below reuses the slot of stage kt-1: its last wgmma group retired here or,
        // with fewer stages ahead, at the stage before.)
        if constexpr (C::ahead == C::stages - 1) wgmma::wait<0>();
        stage_landed();  // stage kt
        const int nk = kt + C::ahead;
        if (nk < kt_total) load_stage(wr_slot, nk);
        cp_async_commit();
        const uint8_t* ws = smem + C::b_ring + rd_slot * C::ws_bytes;  // weights, a_scale
        const uint8_t* wst = ws + sidx * kStripStage;
        const uint64_t b_desc = wgmma::desc_sw128(smem_u32(smem + rd_slot * C::b_bytes), 16, 1024);
        wr_slot = wr_slot == C::stages - 1 ? 0 : wr_slot + 1;
        rd_slot = rd_slot == C::stages - 1 ? 0 : rd_slot + 1;

        uint4 wq[2];
        uint32_t m1[2][4], m2[2][4];
#pragma unroll
        for (int kb = 0; kb < 2; ++kb) {
          const uint8_t* blk = wst + kb * kBlk;
          wq[kb] = *reinterpret_cast<const uint4*>(blk + lane * 16);
          bf16_multipliers<kWide>(*reinterpret_cast<const uint32_t*>(blk + 512 + g * 4), m1[kb],
                                  m2[kb]);
          // A strip past the weight rows decodes stale shared memory: its output rows are
          // discarded, and a zero multiplier keeps them finite.
#pragma unroll
          for (int i = 0; i < 4; ++i) m1[kb][i] = strip_active ? m1[kb][i] : 0u;
        }
#pragma unroll
        for (int step = 0; step < 8; ++step) {  // step = real 16-k group of the stage
          const int kb = step >> 2, s2 = (step >> 1) & 1, h = step & 1;
          uint32_t(&f)[4] = a[step & 1];
          decode_bf16_scaled<kWide>(word_of(wq[kb], 2 * s2), word_of(wq[kb], 2 * s2 + 1), h,
                                    m1[kb], m2[kb], s2, f);
          // (The stage's descriptor plus the step's byte offset >> 4 in the address field.)
          uint64_t desc[1] = {b_desc + (((step >> 2) * (C::bm * 128) + (step & 3) * 32) >> 4)};
          wgmma::fence_operands(f);
          wgmma::fence_operands(desc);
          wgmma::fence();
          wgmma::wgmma_bf16_rs<C::bm>(acc, f, desc[0]);
          wgmma::commit();
          wgmma::wait<1>();
        }
      }
    } else {
      // e4m3, W4A8: per row, base b = the largest of its 4 scale bytes in the stage; the weights
      // decoded to e4m3 through the byte table of e = s - b + 6; the 4 k32 groups as one wgmma
      // chain; one promotion acc = fma(partial * 2^(b - 133), a_scale, acc). With row bases
      // (Mxfp4CudaGemmParams::row_base: bitwise the same results) b is the row's base B at
      // every stage, the promotion acc = fma(partial, a_scale, acc), and the accumulators are
      // multiplied by 2^(B - 133) once, after the last stage. The prefill tiles and the tiny
      // tile (C::skew) run the loop skewed by one stage: the chain of stage kt runs on the
      // tensor cores while the warps wait for stage kt+1 (cp.async wait and the CTA barrier),
      // refill the ring and read kt+1's weights and scale bytes; only the promotion waits for
      // the chain. Two stages are then live at a refill (kt: its token scales, kt+1), so loads
      // run ahead <= stages - 2. (Measured on the H200: +8-15% with 64- and 128-token tiles;
      // -4 to -9% with the 8- and 32-token decode tiles then (session 7). Since the decode
      // loops lost their per-stage bookkeeping the 8-token tile gains from it: WgFp8TinyCfg,
      // session 34.) Issuing each k32 group's wgmma right after its decode instead was 1-7%
      // slower on every float8 tile (a wgmma.fence a group).
      static_assert(C::ahead <= C::stages - 1 - (C::skew ? 1 : 0),
                    "float8: the stages live at a refill stay out of its slot");
      // (The token scales are re-read from shared memory rather than held: at 64 tokens 16 more
      // registers would not fit two CTAs an SM.)
      uint4 wq[2];
      uint32_t sc[2];
      // The warp's offsets into a ring slot (its strip's words, rows g / g + 8's scale bytes),
      // opaque to the compiler so that it holds them instead of re-deriving them from the thread
      // index every stage.
      uint32_t w_off = static_cast<uint32_t>(C::b_ring + sidx * kStripStage + lane * 16);
      uint32_t sc_off = static_cast<uint32_t>(C::b_ring + sidx * kStripStage + 512 + g * 4);
      asm volatile("" : "+r"(w_off), "+r"(sc_off));
      // Stage st (in slot st_slot) in: wait for it (the barrier also retires the promotion of
      // stage st-2's reads of its token scales, whose slot is refilled next), refill slot wr
      // with stage st + ahead (kChecked: if there is one), read st's weight words and scale
      // bytes into registers.
      auto next_stage = [&](auto checked, int st, int st_slot, int wr) {
        stage_landed();
        if (!decltype(checked)::value || st + C::ahead < kt_total) load_stage(wr, st + C::ahead);
        cp_async_commit();
        const uint8_t* slot = smem + st_slot * C::ws_bytes;
        wq[0] = *reinterpret_cast<const uint4*>(slot + w_off);
        wq[1] = *reinterpret_cast<const uint4*>(slot + w_off + kBlk);
        sc[0] = *reinterpret_cast<const uint32_t*>(slot + sc_off);
        sc[1] = *reinterpret_cast<const uint32_t*>(slot + sc_off + kBlk);
      };
      // One stage's decode: the words and scale bytes in registers (next_stage) into the four
      // k32 groups' e4m3 A fragments `f`, and the promotion factors of its rows (per-stage bases).
      auto decode_stage = [&](auto row_based_c, uint32_t(&f)[4][4], float& fg, float& f8) {
        constexpr bool kRowBased = decltype(row_based_c)::value;
        // A row's four scale bytes (groups q = 0..3), its base b (the stage's largest byte, or
        // the row base, the row's largest) and the byte differences b - s (no borrows: no byte
        // exceeds b), which index the byte tables.
        const uint32_t sg = __byte_perm(sc[0], sc[1], 0x5410u);  // row g
        const uint32_t s8 = __byte_perm(sc[0], sc[1], 0x7632u);  // row g + 8
        const uint32_t bg = kRowBased ? rb & 0xffu : max_byte(sg);
        const uint32_t b8 = kRowBased ? rb >> 16 : max_byte(s8);
        const uint32_t dg = bg * 0x01010101u - sg, d8 = b8 * 0x01010101u - s8;
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // k32 group q = 2 kb + s2 of the stage
          const int kb = q >> 1, s2 = q & 1;
          const uint2 lg = luts[(dg >> (8 * q)) & 0xffu];
          const uint2 l8 = luts[(d8 >> (8 * q)) & 0xffu];
#pragma unroll
          for (int h = 0; h < 2; ++h)  // a0 / a2: row g, a1 / a3: row g + 8
            decode_e4m3_lut(word_of(wq[kb], 2 * s2 + h), lg, l8, f[q][2 * h], f[q][2 * h + 1]);
          wgmma::fence_operands(f[q]);
        }
        fg = exp2_b_minus_133(bg);  // (unused with row bases)
        f8 = exp2_b_minus_133(b8);
      };
      // A decoded stage on the B tile of slot `cur`: the wgmma chain, then `between` (the skewed
      // loops bring in the next stage there, under the chain), then the promotion.
      auto chain_stage = [&](auto row_based_c, uint32_t(&f)[4][4], float fg, float f8, int cur,
                             auto&& between) {
        constexpr bool kRowBased = decltype(row_based_c)::value;
        // (No zeroing: the chain's first wgmma, accumulate = false, ignores the registers.)
        float part[C::acc_regs];
        // The k32 groups' descriptors: the stage's plus q * 32 bytes in the address field (>> 4).
        const uint64_t desc0 = wgmma::desc_sw128(smem_u32(smem + cur * C::b_bytes), 16, 1024);
        wgmma::fence();
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint64_t desc[1] = {desc0 + 2 * q};
          wgmma::fence_operands(desc);
          wgmma::wgmma_e4m3_rs<C::bm>(part, f[q], desc[0], q > 0);
        }
        wgmma::commit();
        between();
        wgmma::wait<0>();
        wgmma::fence_operands(part);
        const float* sst =
            reinterpret_cast<const float*>(smem + C::b_ring + cur * C::ws_bytes + C::w_bytes);
        promote_stage<kRowBased>(acc, part, sst, t, fg, f8);
      };
      // Decode, then the chain.
      auto run_stage = [&](auto row_based_c, int cur, auto&& between) {
        uint32_t f[4][4];
        float fg, f8;
        decode_stage(row_based_c, f, fg, f8);
        chain_stage(row_based_c, f, fg, f8, cur, between);
      };
      // The stage loop once per base rule (chosen per item), so that each is straight-line code.
      auto stage_loop = [&](auto row_based_c) {
        if constexpr (C::skew) {
          // Skewed: while the chain of stage kt runs, stage kt+1 in and a later stage's copies
          // out. Slots as run-time indices (a stage is long: its bookkeeping is a small share).
          int rd_slot = 0, wr_slot = C::ahead;
          auto next_stage_rt = [&](int st, int st_slot) {
            next_stage(std::true_type{}, st, st_slot, wr_slot);
            wr_slot = wr_slot == C::stages - 1 ? 0 : wr_slot + 1;
          };
          next_stage_rt(0, 0);
#pragma unroll 1
          for (int kt = 0; kt < kt_total; ++kt) {
            const int nxt = rd_slot == C::stages - 1 ? 0 : rd_slot + 1;
            run_stage(row_based_c, rd_slot, [&] {
              if (kt + 1 < kt_total) next_stage_rt(kt + 1, nxt);
            });
            rd_slot = nxt;
          }
        } else {
          // The decode tiles: `stages` stages an iteration, stage kt in slot kt % stages, its
          // refill (stage kt + ahead) into slot (kt + ahead) % stages: constant slot addresses.
          // The main loop's refills all exist; the tail checks.
          for_stages<C::stages>(
              kt_total, kt_total - C::ahead,
              [&](auto checked, int r, int kt) {
                next_stage(checked, kt, r, (r + C::ahead) % C::stages);
                run_stage(row_based_c, r, [] {});
              },
              [] {});
        }
      };
      if (row_based)
        stage_loop(std::true_type{});
      else
        stage_loop(std::false_type{});
      // (The accumulators ran at 2^(133-B) times the per-stage ones: back, exactly. A branch of
      // its own: fewer instructions in both loops than inside the first branch, by the static
      // counts of bench/sass_stage_loop.py.)
      if (row_based) scale_rows(acc, exp2_b_minus_133(rb & 0xffu), exp2_b_minus_133(rb >> 16));
    }
    wgmma::wait<0>();
    wgmma::fence_operands(acc);
    cp_async_wait<0>();
    __syncthreads();  // every stage read: the ring holds the output tile next
    store_tile_staged<C>(p, out_bf16, n_out, smem, strip0, tile_row0, tile_rows, strip_active,
                         acc);
  }
}

// ---- the warp-specialised float8 wide tile (tokens as M) ---------------------------------------
// The kernel's parameters: the GEMM's, and the token tile's tensor map (a __grid_constant__
// parameter, so that every launch carries its own and the TMA reads it from parameter space).
struct WsFp8Params {
  Mxfp4CudaGemmParams p;
  // a (e4m3 as uint8) [rows, k]: boxes of 128 k x 256 rows, 128-byte swizzle (64-byte aligned
  // by its type, as the TMA needs)
  CUtensorMap tokens;
  // w_packed as [E x groups][stages][4 strips][kStripStage bytes]: a stage of 2 groups a box
  CUtensorMap weights;
};

// A 4 x 4 transpose of 32-bit words within each quad of lanes (t = lane % 4): lane t's a[k]
// becomes lane k's out[t], i.e. out[s] = lane s's a[t]. Two butterfly rounds (xor 2, xor 1) of two
// shuffles each; the selects only place words. Every lane of the warp must call it.
__device__ __forceinline__ void quad_transpose(const uint32_t (&a)[4], int t, uint32_t (&out)[4]) {
  const bool b1 = t & 2, b0 = t & 1;
  // Round 1 (partner t ^ 2): keep the groups whose bit 1 is t's, send the others.
  uint32_t keep[2], recv[2];
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    keep[b] = b1 ? a[b + 2] : a[b];
    recv[b] = __shfl_xor_sync(0xffffffffu, b1 ? a[b] : a[b + 2], 2);
  }
  // Now keep[b] / recv[b] are lanes t / t ^ 2 of group 2 b1 + b. Round 2 (partner t ^ 1): keep
  // group t (b = b0), send the other one.
  const uint32_t mine0 = b0 ? keep[1] : keep[0], mine2 = b0 ? recv[1] : recv[0];
  const uint32_t from1 = __shfl_xor_sync(0xffffffffu, b0 ? keep[0] : keep[1], 1);
  const uint32_t from3 = __shfl_xor_sync(0xffffffffu, b0 ? recv[0] : recv[1], 1);
  // x[i] is lane t ^ i's word of group t: out[s] = x[s ^ t].
  const uint32_t x[4] = {mine0, from1, mine2, from3};
  uint32_t y[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) y[i] = b0 ? x[i ^ 1] : x[i];
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = b1 ? y[i ^ 2] : y[i];
}

// The wide float8 tile's outputs straight from the accumulators (tokens as M: acc[64 h + 4 j + x]
// is token 128 cw + 64 h + 16 wq + g + 8 (x / 2), weight row 8 j + 2 t + x % 2 of the tile, i.e.
// strip j / 2, in-strip row 8 (j % 2) + 2 t + x % 2: the SwiGLU gate for j even, its up in j + 1).
// No shared-memory staging: the ring is the producer's as soon as the last chain retired. Tokens
// past tile_rows and columns past n_out are not written. `warm` >= 0 is the kernel's warm-up pass
// of consumer warp `warm`: nothing is stored, and the warp runs one half of the bf16 path (the
// pairs' path not at all) - see the kernel.
// bf16 outputs (the engine's case) go as 16-byte stores: a quad's lanes hold two adjacent columns
// of each 8-column group of a row; a quad transpose of four groups gives each lane one whole
// group, so a warp's store writes 8 rows x 64 contiguous bytes (whole sectors) - 4x fewer stores
// than the pairs below (half a sector each). Measured against the pairs (session 17): down
// +27-38%, gate_up +6-10% at 512-8192 rows an expert. The pairs remain for float32 outputs and
// widths that are not a multiple of 8.
__device__ __forceinline__ void store_tokens_m(const Mxfp4CudaGemmParams& p, int strip0,
                                               int tile_row0, int tile_rows, int cw, int wq, int g,
                                               int t, const float* acc, int warm = -1) {
  const bool bf16 = p.out_dtype == DType::kBFloat16;
  const int n_out = static_cast<int>(p.fuse_swiglu ? p.n / 2 : p.n);
  const int col0 = strip0 * (p.fuse_swiglu ? 8 : 16);
  const float lim = swiglu_limit(p);
  if (bf16 && n_out % 8 == 0 && (reinterpret_cast<uintptr_t>(p.out) & 15) == 0) {
    // (col0 % 8 == 0: an 8-column group lies wholly inside or outside n_out)
    auto groups16 = [&](auto fuse) {
      constexpr bool kFuse = decltype(fuse)::value;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // (warp-uniform; the warm-up's even warps run half h = 1, the odd ones h = 0, so that
        // they fetch the two halves of the cold code at once: no branch but this one's)
        if (cw * 128 + 64 * h + 16 * wq >= tile_rows || (warm >= 0 && h == (warm & 1))) continue;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int tok = cw * 128 + 64 * h + 16 * wq + g + 8 * r;
          __nv_bfloat16* row = static_cast<__nv_bfloat16*>(p.out) +
                               static_cast<int64_t>(tile_row0 + tok) * n_out;
#pragma unroll
          for (int q = 0; q < (kFuse ? 2 : 4); ++q) {
            uint32_t a[4], o[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const int grp = 4 * q + k;  // the 8-column output group
              float v0, v1;
              if constexpr (kFuse) {
                const float* c = acc + 64 * h + 8 * grp + 2 * r;  // gate j = 2 grp, up j + 1
                v0 = swiglu(c[0], c[4], lim);
                v1 = swiglu(c[1], c[5], lim);
              } else {
                const float* c = acc + 64 * h + 4 * grp + 2 * r;
                v0 = c[0];
                v1 = c[1];
              }
              const __nv_bfloat162 v = __floats2bfloat162_rn(v0, v1);
              a[k] = *reinterpret_cast<const uint32_t*>(&v);
            }
            quad_transpose(a, t, o);
            const int col = col0 + 8 * (4 * q + t);
            if (warm < 0 && tok < tile_rows && col < n_out)
              *reinterpret_cast<uint4*>(row + col) = make_uint4(o[0], o[1], o[2], o[3]);
          }
        }
      }
    };
    if (p.fuse_swiglu)
      groups16(std::true_type{});
    else
      groups16(std::false_type{});
    return;
  }
  // (col0 and the pair's first column are even: a pair is one aligned store when n_out is even)
  const bool vec = n_out % 2 == 0 && (reinterpret_cast<uintptr_t>(p.out) & 7) == 0;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int tok = cw * 128 + 64 * h + 16 * wq + g + 8 * r;
      if (warm >= 0 || tok >= tile_rows) continue;
      const int64_t row = static_cast<int64_t>(tile_row0 + tok) * n_out;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        if (p.fuse_swiglu && j % 2 == 1) continue;  // (the up half of j - 1)
        const float* c = acc + 64 * h + 4 * j + 2 * r;
        float v0 = c[0], v1 = c[1];
        int col = col0 + 8 * j + 2 * t;
        if (p.fuse_swiglu) {
          v0 = swiglu(c[0], c[4], lim);
          v1 = swiglu(c[1], c[5], lim);
          col = col0 + (j / 2) * 8 + 2 * t;
        }
        if (vec && col + 1 < n_out) {
          if (bf16)
            *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.out) + row + col) =
                __floats2bfloat162_rn(v0, v1);
          else
            *reinterpret_cast<float2*>(static_cast<float*>(p.out) + row + col) =
                make_float2(v0, v1);
        } else {
          if (col < n_out) store_out(p.out, bf16, row + col, v0);
          if (col + 1 < n_out) store_out(p.out, bf16, row + col + 1, v1);
        }
      }
    }
}

// WsFp8Cfg's tile. Producer (warpgroup 2), per 128-k stage, `ahead` stages before its decode: the
// 8 strips' packed words and scale bytes and the token tile by one 2-D tensor copy each (thread 0;
// each completes on its own mbarrier of the copy slot), the tokens' a_scale by cp.async; then,
// once the decoded buffer is free, it decodes its strips (warp p: strips 2p, 2p + 1) to e4m3 with
// the byte tables into the buffer's B tile, at row 16 strip + r (K-major, 128-byte swizzle; a row
// is a weight row, so the tile is wgmma's B as stored), waits for the token tile and hands the
// stage over. The CTA's items run as one stream of stages (see WsFp8Cfg), and the consumers store
// their outputs from registers (store_tokens_m), so nothing waits for an item's epilogue but the
// warpgroup that runs it. Consumers (warpgroups 0, 1): per stage, for each of
// their two 64-token halves, wgmma m64n128k32 x 4 (A: the token rows, B: the decoded weights) from
// zero, retired (wait<0>) and promoted: acc = fma(partial [x 2^(b - 133) of the column's weight
// row, per-stage bases], a_scale of the row's token, acc). One base rule for the whole tile (row
// bases only where both 64-row groups have them): the rules give the same results, bitwise.
// The e4m3 values, the wgmma k32 chains and the promotion order are those of every other float8
// tile, so the results are bitwise theirs (tested).
// Stages are handed over by the named barriers full[s][cw] (the producer arrives once its decode
// is stored and fenced and the token tile landed; see WsFp8Cfg for the turn the consumers pass)
// and given back by the mbarriers empty[s] (every consumer thread arrives after its last read of
// copy slot s; the producer waits before refilling it) and dfree[d] (the same for decoded buffer
// d; a row-based item's last one after the epilogue read its factors): only for the refills that
// exist, so both sides count the same arrivals. The give-backs were named barriers too (consumers
// bar.arrive, producer bar.sync); compute-sanitizer's racecheck reports every read before such an
// arrive against the producer's later writes (session 21: thousands of hazards on the a_scale and
// factor reads, with or without a fence.acq_rel before the arrive), while an mbarrier arrive
// (release) and wait (acquire) is a hand-off it follows. The price: 0.6-1.7% of kernel time (A/B
// on an H100, W4A8 512-8192 rows an expert). One lane a warp arriving after a __syncwarp was as
// fast as the named barrier (dfree, measured), but racecheck does not follow that hand-off.
__global__ void __launch_bounds__(WsFp8Cfg::threads, 1)
    mxfp4_moe_fp8_ws_kernel(const __grid_constant__ WsFp8Params prm) {
  using C = WsFp8Cfg;
  const Mxfp4CudaGemmParams& p = prm.p;
  extern __shared__ __align__(1024) uint8_t ws_smem[];
  uint8_t* smem = ws_smem;
  __shared__ uint2 luts[kE4m3Luts];
  __shared__ __align__(8) uint64_t tokens_mb[C::stages];   // the token tiles' TMA completions
  __shared__ __align__(8) uint64_t weights_mb[C::stages];  // the packed weights' ones
  __shared__ __align__(8) uint64_t empty_mb[C::stages];   // copy slot s released (consumers)
  __shared__ __align__(8) uint64_t dfree_mb[2];           // decoded buffer d released (consumers)
  e4m3_lut_init(reinterpret_cast<uint8_t*>(luts));
  if (threadIdx.x == 0) {
    if ((smem_u32(smem) & 1023u) != 0) __trap();
    for (int i = 0; i < C::stages; ++i) {
      mbar_init(smem_u32(&tokens_mb[i]), 1);
      mbar_init(smem_u32(&weights_mb[i]), 1);
      mbar_init(smem_u32(&empty_mb[i]), C::consumers);
    }
    for (int d = 0; d < 2; ++d) mbar_init(smem_u32(&dfree_mb[d]), C::consumers);
    mbar_init_fence();
  }
  await_earlier_kernels();
  const Schedule<C> sch(p, smem + C::pipe_bytes);  // (its barrier publishes the above)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t items = sch.items;
  const int kt_total = static_cast<int>(p.k_pad / kBK);
  const int64_t kb_total = sch.kb_total;
  // Row bases for the whole tile: both 64-row groups have them (a group's first row marks it).
  auto tile_row_based = [](const ItemTile& w) {
    return w.row_base != nullptr && w.row_base[0] != 0 &&
           (w.strips_valid <= 4 || w.row_base[64] != 0);
  };

  if (tid >= C::consumers) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(C::producer_regs));
    const int ptid = tid - C::consumers, pw = ptid >> 5;
    constexpr int kS = C::warp_strips;
    uint32_t phases = 0;  // the parity each slot's mbarrier completes next
    // The CTA's items run as one stream of stages through the ring: `filled` stages filled so
    // far, the next into fill_slot; the next decoded from `slot`.
    int filled = 0, fill_slot = 0, slot = 0, decoded = 0;
#pragma unroll 1
    for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
      const ItemTile w = sch.tile_of(p, it);
      const bool row_based = tile_row_based(w);
      // Copies: thread 0 the stage's packed weights and its token tile by TMA; thread ptid the
      // a_scale of tokens ptid and ptid + 128 (zero past the tile). w_group: the tile's first
      // 64-row group as a coordinate of the weights' tensor map.
      const int w_group =
          static_cast<int>((w.wtile - p.w_packed) / (kMxfp4GroupStrips * kb_total * kBlk));
      uint32_t rb[kS];  // rows g, g + 8 of strip kS pw + h: their row bases (low / high half)
#pragma unroll
      for (int h = 0; h < kS; ++h) {
        const int strip = kS * pw + h;
        const bool valid = strip < w.strips_valid;
        rb[h] = row_based && valid
                    ? w.row_base[strip * 16 + g] | uint32_t{w.row_base[strip * 16 + g + 8]} << 16
                    : 0u;
      }
      const bool s_row0 = ptid < w.tile_rows, s_row1 = ptid + 128 < w.tile_rows;
      const float* s_next =
          p.a_scale + (s_row0 ? static_cast<int64_t>(w.tile_row0 + ptid) * p.a_scale_row_stride
                              : 0);
      const int64_t s_step1 = s_row1 ? 128 * p.a_scale_row_stride : 0;
      const int64_t s_kstep = p.a_scale_k_stride;
      auto copy_stage = [&](int kt, int slot) {
        const uint32_t base = smem_u32(smem);
        if (ptid == 0) {
          // the weights first (the decode waits for them; the tokens only the consumers)
          const uint32_t wbar = smem_u32(&weights_mb[slot]);
          mbar_arrive_expect_tx(wbar, C::w_bytes);
          tma_load_4d(base + C::w_off(slot), &prm.weights, 0, 0, kt, w_group, wbar);
          const uint32_t bar = smem_u32(&tokens_mb[slot]);
          mbar_arrive_expect_tx(bar, C::b_bytes);
          tma_load_2d(base + C::tok_off(slot), &prm.tokens, kt * kBK, w.tile_row0, bar);
        }
        cp_async4_if(base + C::s_off(slot) + ptid * 4, s_next, true, s_row0);
        cp_async4_if(base + C::s_off(slot) + (ptid + 128) * 4, s_next + s_step1, true, s_row1);
        s_next += s_kstep;
      };
      // Strip kS pw + h of the stage in `slot`: its words and scale bytes -> e4m3 rows 16 strip +
      // g (+ 8), k 32 q + 16 hh + 4 t (the places the A fragments of the register tiles hold), a
      // strip at a time (72 registers); per-stage bases also leave the rows' factors 2^(b - 133),
      // and so do row bases at an item's last stage (rows_f: the consumers' epilogue scale).
      bool rows_f = false;
      auto decode_strip = [&](int slot, int buf, int h) {
        const int strip = kS * pw + h;
        const uint8_t* ws = smem + C::w_off(slot) + strip * kStripStage;
        const uint4 wq0 = *reinterpret_cast<const uint4*>(ws + lane * 16);
        const uint4 wq1 = *reinterpret_cast<const uint4*>(ws + kBlk + lane * 16);
        const uint32_t sc0 = *reinterpret_cast<const uint32_t*>(ws + 512 + g * 4);
        const uint32_t sc1 = *reinterpret_cast<const uint32_t*>(ws + kBlk + 512 + g * 4);
        const uint32_t sg = __byte_perm(sc0, sc1, 0x5410u);  // row g
        const uint32_t s8 = __byte_perm(sc0, sc1, 0x7632u);  // row g + 8
        const uint32_t bg = row_based ? rb[h] & 0xffu : max_byte(sg);
        const uint32_t b8 = row_based ? rb[h] >> 16 : max_byte(s8);
        if ((!row_based || rows_f) && t == 0) {
          float* f = reinterpret_cast<float*>(smem + C::f_off(buf)) + strip * 16 + g;
          f[0] = exp2_b_minus_133(bg);
          f[8] = exp2_b_minus_133(b8);
        }
        const uint32_t dg = bg * 0x01010101u - sg, d8 = b8 * 0x01010101u - s8;
        uint2 lg[4], l8[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          lg[q] = luts[(dg >> (8 * q)) & 0xffu];
          l8[q] = luts[(d8 >> (8 * q)) & 0xffu];
        }
        uint8_t* row = smem + C::dec_off(buf) + (strip * 16 + g) * 128 + 4 * t;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            uint32_t rg, r8;
            decode_e4m3_lut(word_of(q < 2 ? wq0 : wq1, 2 * (q & 1) + hh), lg[q], l8[q], rg, r8);
            const int chunk = ((2 * q + hh) ^ g) << 4;  // rows g and g + 8: row % 8 = g
            *reinterpret_cast<uint32_t*>(row + chunk) = rg;
            *reinterpret_cast<uint32_t*>(row + 8 * 128 + chunk) = r8;
          }
        }
      };
      // Stage kt of this item into the next slot of the CTA's stream (once the consumers
      // released the stage `stages` before it in the stream).
      auto fill = [&](int kt) {
        // (the k-th wait on a slot, k = filled / stages - 1, is for its phase of parity k & 1)
        if (filled >= C::stages)
          mbar_wait(smem_u32(&empty_mb[fill_slot]), ((filled / C::stages) & 1) ^ 1);
        copy_stage(kt, fill_slot);
        ++filled;
        fill_slot = fill_slot == C::stages - 1 ? 0 : fill_slot + 1;
      };
#pragma unroll 1
      for (int st = 0; st < C::ahead; ++st) {
        if (st < kt_total) fill(st);
        cp_async_commit();
      }
#pragma unroll 1
      for (int kt = 0; kt < kt_total; ++kt) {
        if (kt + C::ahead < kt_total) fill(kt + C::ahead);
        cp_async_commit();
        mbar_wait(smem_u32(&weights_mb[slot]), (phases >> slot) & 1u);  // the packed weights
        // decoded buffer decoded % 2: stage decoded - 2 released
        // (the same count for buffer d: k = decoded / 2 - 1)
        if (decoded >= 2) mbar_wait(smem_u32(&dfree_mb[decoded & 1]), ((decoded >> 1) & 1) ^ 1);
        rows_f = kt == kt_total - 1;
#pragma unroll
        for (int h = 0; h < kS; ++h) decode_strip(slot, decoded & 1, h);
        ++decoded;
        cp_async_wait<C::ahead>();   // this thread's a_scale copies of stage kt
        wgmma::fence_proxy_async();  // decoded stores and cp.async data -> the tensor cores' reads
        mbar_wait(smem_u32(&tokens_mb[slot]), (phases >> slot) & 1u);  // the token tile landed
        phases ^= 1u << slot;
        bar_arrive(C::bar_full + 2 * slot, C::full0_count);  // warpgroup 0 (1 follows it)
        slot = slot == C::stages - 1 ? 0 : slot + 1;
      }
      // (No wait for the consumers' epilogue: it stores from registers, so the next item's
      // first stages fill the ring under it.)
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(C::consumer_regs));
  const int cw = warp >> 2;
  auto release_decoded = [&](int d) { mbar_arrive(smem_u32(&dfree_mb[d])); };
  // The stream's stages: `total` for this CTA, `taken` so far, the next in `slot`.
  const int my_items =
      items > blockIdx.x ? static_cast<int>((items - 1 - blockIdx.x) / gridDim.x) + 1 : 0;
  const int total = my_items * kt_total;
  int taken = 0, slot = 0;
  // Warpgroup 0 issues the kernel's first chain: the turn for it is given up front.
  if (cw == 1 && total > 0) bar_arrive(C::bar_full, C::full0_count);
  // The item's tile and base rule; the next item's are worked out before this one's epilogue, so
  // that their loads (the row-base bytes, from L2) land under it, not before the next stage loop
  // (the first item's under the warm-up's).
  ItemTile w{};
  bool row_based = false;
  // The loop's first pass is a warm-up (`warm`): no stage loop, and the epilogue runs with its
  // stores switched off, so that its ~2,000 instructions are in the SM's instruction cache before
  // the first real epilogue. The consumers would otherwise only wait at their first full barrier
  // for the producer's ramp (schedule, first copies and decode: ~9.5 us), and the first item's
  // epilogue took ~5-9 us longer than the later ones with its code cold (fetched line by line from
  // HBM after the benchmark's L2 flush). (One epilogue in the code: the same instructions warm
  // up.) The warm-up starts right after the schedule, and each consumer warp runs one half of the
  // epilogue (store_tokens_m's `warm`), so that the halves' code is fetched at once: run whole by
  // every warp after the first item's tile lookup, the warm-up of gate_up's SwiGLU path ended ~6
  // us after the ramp and held the first stage back (clock stamps, moe_gemm_NOTES.md session 23;
  // this form: gate_up -3.7% at 512 rows an expert on an H100, the rest -1.6% to +0.3%; the
  // halves cut again by r, or the blocks spread over all eight warps: no better, or slower).
#pragma unroll 1
  for (int64_t it = static_cast<int64_t>(blockIdx.x) - gridDim.x; it < items; it += gridDim.x) {
    // it < 0, opaque to the compiler (so that it does not peel the warm-up into a second copy of
    // the epilogue), worked out where needed (a flag kept across the stage loop costs it a spill)
    auto warm_pass = [&] {
      int f = it < 0;
      asm volatile("" : "+r"(f));
      return f != 0;
    };
    float acc[C::acc_regs];
#pragma unroll
    for (int i = 0; i < C::acc_regs; ++i) acc[i] = 0.f;
    auto stage_loop = [&](auto row_based_c) {
      constexpr bool kRowBased = decltype(row_based_c)::value;
      auto next = [](int slot) { return slot == C::stages - 1 ? 0 : slot + 1; };
      // Half h (tokens 128 cw + 64 h ..) of the stage in `slot`: its chain into `part`.
      auto chain = [&](const uint8_t* base, int h, float(&part)[64]) {
        const uint64_t da = wgmma::desc_sw128(smem_u32(base + (cw * 128 + 64 * h) * 128), 16, 1024);
        const uint64_t db = wgmma::desc_sw128(smem_u32(smem + C::dec_off(taken & 1)), 16, 1024);
        wgmma::chain_m64n128k128_e4m3_ss(part, da, db);
      };
      // Half h's retired partials into the accumulators: rows g, g + 8 of this warp's 16 tokens,
      // columns (weight rows) 8 j + 2 t, +1.
      auto promote = [&](int h, const float(&part)[64]) {
        const float* sst = reinterpret_cast<const float*>(smem + C::s_off(slot)) + cw * 128 +
                           64 * h + (warp & 3) * 16 + g;
        const float sg = sst[0], s8 = sst[8];
        const float* fcol = reinterpret_cast<const float*>(smem + C::f_off(taken & 1)) + 2 * t;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          float2 f = make_float2(1.f, 1.f);
          if constexpr (!kRowBased) f = *reinterpret_cast<const float2*>(fcol + 8 * j);
          auto sc = [](float x, float y) { return kRowBased ? x : x * y; };
          float* a = acc + 64 * h + 4 * j;
          a[0] = fmaf(sc(part[4 * j + 0], f.x), sg, a[0]);
          a[1] = fmaf(sc(part[4 * j + 1], f.y), sg, a[1]);
          a[2] = fmaf(sc(part[4 * j + 2], f.x), s8, a[2]);
          a[3] = fmaf(sc(part[4 * j + 3], f.y), s8, a[3]);
        }
      };
#pragma unroll 1
      for (const int stop = taken + (warm_pass() ? 0 : kt_total); taken < stop;) {  // (one counter)
        bar_sync(C::bar_full + 2 * slot + cw, cw == 0 ? C::full0_count : C::full1_count);
        const uint8_t* base = smem + C::tok_off(slot);
        float part[64];
        chain(base, 0, part);
        // The turn passes to the other warpgroup: 1 may issue this slot's chain; 0 the next
        // stage's (perhaps the next item's first; none after the CTA's last chain).
        if (cw == 0)
          bar_arrive(C::bar_full + 2 * slot + 1, C::full1_count);
        else if (taken + 1 < total)
          bar_arrive(C::bar_full + 2 * next(slot), C::full0_count);
        wgmma::wait<0>();
        wgmma::fence_operands(part);
        promote(0, part);
        chain(base, 1, part);  // (the first half's partials are promoted: the same registers)
        wgmma::wait<0>();
        wgmma::fence_operands(part);
        promote(1, part);
        if (taken + C::stages < total) mbar_arrive(smem_u32(&empty_mb[slot]));  // refilled
        // (redecoded; a row-based item's last stage releases it after the epilogue's factors)
        if (taken + 2 < total && (!kRowBased || taken + 1 < stop))
          release_decoded(taken & 1);
        ++taken;
        slot = next(slot);
      }
    };
    if (row_based && !warm_pass()) {
      stage_loop(std::true_type{});
      // The columns' (weight rows') 2^(B - 133), which the producer left in the last stage's
      // decoded buffer (rows past the tile's strips: never stored); then that buffer is released.
      const float* fr = reinterpret_cast<const float*>(smem + C::f_off((taken - 1) & 1)) + 2 * t;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 f2 = *reinterpret_cast<const float2*>(fr + 8 * j);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const float f = 8 * j + 2 * t + u < 16 * w.strips_valid ? (u ? f2.y : f2.x) : 0.f;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            acc[64 * h + 4 * j + u] *= f;
            acc[64 * h + 4 * j + 2 + u] *= f;
          }
        }
      }
      if (taken + 1 < total) release_decoded((taken - 1) & 1);
    } else {
      stage_loop(std::false_type{});  // (no stages in the warm-up pass)
    }
    ItemTile wn = w;
    bool rbn = false;
    const bool warm = warm_pass();
    if (it + gridDim.x < items) {  // (the warm-up's next is the first item)
      wn = sch.tile_of(p, it + gridDim.x);
      rbn = tile_row_based(wn);
    }
    // (the warm-up: every row, this warp's half of the code, no stores)
    store_tokens_m(p, w.strip0, w.tile_row0, warm ? C::bm : w.tile_rows, cw, warp & 3, g, t, acc,
                   warm ? warp : -1);
    w = wn;
    row_based = rbn;
  }
}

// ---- host side ---------------------------------------------------------------------------------
constexpr int kMaxDevices = 64;

// prefix, row0, cnt (int32), then the routed layout's row map (uint16, routed_rows of them).
int64_t schedule_smem_bytes(int64_t num_experts, int64_t routed_rows = 0) {
  return (3 * num_experts + 1) * 4 + (routed_rows * 2 + 3) / 4 * 4;
}

// A 2-D tensor map over global memory (dims / box innermost first, strides in bytes), encoded
// through the runtime's driver entry point, so that the extension needs no libcuda link.
CUtensorMap encode_tensor_map(CUtensorMapDataType dtype, int rank, const void* base,
                              const cuuint64_t* dims, const cuuint64_t* strides,
                              const cuuint32_t* box, CUtensorMapSwizzle swizzle, const char* what) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                              const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                              const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                              CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    ZI_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                   cudaEnableDefault, &q));
    ZI_CHECK(q == cudaDriverEntryPointSuccess && fn != nullptr,
             "cuTensorMapEncodeTiled not found in the CUDA driver");
    return reinterpret_cast<Encode>(fn);
  }();
  CUtensorMap map{};
  const cuuint32_t estr[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode(&map, dtype, rank, const_cast<void*>(base), dims, strides, box, estr,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  ZI_CHECK(r == CUDA_SUCCESS, std::string("cuTensorMapEncodeTiled failed for ") + what);
  return map;
}

// The float8 token rows a ([m, k], or [num_experts, cap, k] masked: p.m is ignored there) with
// boxes of 128 k x `box_rows` rows and the 128-byte swizzle (wgmma's K-major layout); rows past
// the tensor read as zeros.
CUtensorMap token_tensor_map(const Mxfp4CudaGemmParams& p, int box_rows) {
  const int64_t rows = p.masked_m != nullptr ? p.num_experts * p.cap : p.m;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(p.k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(p.k)};  // bytes (e4m3)
  const cuuint32_t box[2] = {kBK, static_cast<cuuint32_t>(box_rows)};
  return encode_tensor_map(CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, p.a, dims, strides, box,
                           CU_TENSOR_MAP_SWIZZLE_128B, "the float8 token rows");
}

// The packed weights (zeroinfer/moe_gemm.h: per expert, 64-row group and 128-k stage, the
// group's 4 strips of kStripStage bytes) as a 4-D tensor map of 8-byte elements: {a strip's
// stage, 4 strips, kt_total stages, E x groups}, boxes of one stage x `box_strips` / 4 groups, no
// swizzle: one copy lands a stage's strips in the copy slot as the decode reads them (kStripStage
// bytes a strip, in strip order).
CUtensorMap weight_tensor_map(const Mxfp4CudaGemmParams& p, int box_strips) {
  static_assert(kStripStage % 16 == 0 && kStripStage / 8 <= 256, "a strip's stage is one box row");
  const int64_t stages = p.k_pad / kBK;
  const cuuint64_t dims[4] = {kStripStage / 8, kMxfp4GroupStrips, static_cast<cuuint64_t>(stages),
                              static_cast<cuuint64_t>(p.num_experts * (p.n_pad / 64))};
  const cuuint64_t strides[3] = {kStripStage, kGroupStage,
                                 static_cast<cuuint64_t>(stages * kGroupStage)};  // bytes
  const cuuint32_t box[4] = {kStripStage / 8, kMxfp4GroupStrips, 1,
                             static_cast<cuuint32_t>(box_strips / kMxfp4GroupStrips)};
  return encode_tensor_map(CU_TENSOR_MAP_DATA_TYPE_UINT64, 4, p.w_packed, dims, strides, box,
                           CU_TENSOR_MAP_SWIZZLE_NONE, "the packed weights");
}

// One launch of config C; kWide as in mxfp4_moe_kernel (float8 has one variant: its decode
// takes the scales through the byte tables); kRouted: the routed layout (mma.sync tiles only).
template <class C, bool kWide, bool kRouted>
void launch_variant(const Mxfp4CudaGemmParams& p, cudaStream_t stream) {
  constexpr bool kWs = std::is_same_v<C, WsFp8Cfg>;
  using Params = std::conditional_t<kWs, WsFp8Params, Mxfp4CudaGemmParams>;
  void (*kernel)(const Params);
  if constexpr (kWs)
    kernel = mxfp4_moe_fp8_ws_kernel;
  else if constexpr (C::wgmma)
    kernel = mxfp4_moe_wgmma_kernel<C, kWide>;
  else
    kernel = mxfp4_moe_kernel<C, kWide, kRouted>;
  const int64_t E = p.num_experts;
  const int64_t routed_rows = kRouted ? p.m : 0;
  const int64_t n_tiles = (p.n_pad / 16 + C::strips - 1) / C::strips;
  const int64_t tiles_bound = p.masked_m != nullptr
                                  ? E * ((p.cap + C::bm - 1) / C::bm)
                                  : (p.m + C::bm - 1) / C::bm + std::min<int64_t>(E, p.m);
  const int64_t items_bound = tiles_bound * n_tiles;
  if (items_bound <= 0) return;

  int dev = 0;
  ZI_CUDA_CHECK(cudaGetDevice(&dev));
  ZI_CHECK(dev >= 0 && dev < kMaxDevices, "device index out of range");
  const int smem = static_cast<int>(C::pipe_bytes + schedule_smem_bytes(E, routed_rows));
  // The occupancy's key: E + 1 and the row map's rows (0: not computed yet).
  const int64_t key = (E + 1) | routed_rows << 20;
  static_assert(kMxfp4CudaMaxExperts < (1 << 20), "the key's expert field");
  static std::mutex mu;
  static int sm_count[kMaxDevices] = {};
  static int64_t occ_key[kMaxDevices] = {};
  static int occ_val[kMaxDevices] = {};
  int blocks_per_sm = 0, sms = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (sm_count[dev] == 0) {
      ZI_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count[dev], cudaDevAttrMultiProcessorCount, dev));
      const int max_smem = static_cast<int>(
          C::pipe_bytes + schedule_smem_bytes(kMxfp4CudaMaxExperts, kRouted ? kMxfp4RoutedMaxRows
                                                                            : 0));
      ZI_CUDA_CHECK(cudaFuncSetAttribute(kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem));
    }
    if (occ_key[dev] != key) {
      ZI_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &occ_val[dev], kernel, C::threads, smem));
      occ_key[dev] = key;
    }
    blocks_per_sm = std::max(occ_val[dev], 1);
    sms = sm_count[dev];
  }
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(items_bound,
                                                              int64_t{sms} * blocks_per_sm));
  // Programmatic: the CTAs may start under the previous kernel's tail (await_earlier_kernels).
  const dim3 g(static_cast<unsigned>(grid)), b(C::threads);
  if constexpr (kWs) {
    const WsFp8Params prm{p, token_tensor_map(p, C::bm), weight_tensor_map(p, C::strips)};
    launch_programmatic(kernel, g, b, static_cast<size_t>(smem), stream, prm);
  } else {
    launch_programmatic(kernel, g, b, static_cast<size_t>(smem), stream, p);
  }
  ZI_CUDA_CHECK_LAUNCH("mxfp4_moe_kernel");
}

template <class C>
constexpr bool kIsFp8 = [] {
  if constexpr (C::wgmma)
    return C::fp8;
  else
    return false;
}();

template <class C>
void launch(const Mxfp4CudaGemmParams& p, cudaStream_t stream) {
  if constexpr (kIsFp8<C>) {
    launch_variant<C, false, false>(p, stream);
  } else if constexpr (C::wgmma) {
    if (p.wide_scales)
      launch_variant<C, true, false>(p, stream);
    else
      launch_variant<C, false, false>(p, stream);
  } else {  // the mma.sync tiles: also the routed layout
    const bool routed = p.route_ids != nullptr;
    if (p.wide_scales && routed)
      launch_variant<C, true, true>(p, stream);
    else if (p.wide_scales)
      launch_variant<C, true, false>(p, stream);
    else if (routed)
      launch_variant<C, false, true>(p, stream);
    else
      launch_variant<C, false, false>(p, stream);
  }
}

// Tile number (Mxfp4CudaGemmParams::tile) -> config: 1 small, 2 wide, 3 tiny, 4 wgmma.
template <class Small, class Wide, class Tiny, class Wgmma>
void launch_tile(int tile, const Mxfp4CudaGemmParams& p, cudaStream_t stream) {
  if (tile == 4)
    launch<Wgmma>(p, stream);
  else if (tile == 2)
    launch<Wide>(p, stream);
  else if (tile == 3)
    launch<Tiny>(p, stream);
  else
    launch<Small>(p, stream);
}

}  // namespace

// Whether the float8 tiny tile runs its plain loop (3 stages ahead) rather than the skewed one
// (2 ahead) on the current device: where the HBM bandwidth per SM is high (the H200: ~37 GB/s an
// SM; the H100 SXM ~25) a CTA needs the third stage of loads in flight more than it gains from
// hiding its short wgmma chain (cuda::peak_memory_bytes_per_s; cached per device).
bool mxfp4_fp8_tiny_plain_loop(int requested) {
  if (requested != 0) return requested == 1;
  constexpr int kMaxDevices = 64;
  static std::atomic<int8_t> cached[kMaxDevices] = {};  // 0 unknown, 1 plain, 2 skewed
  int dev = 0;
  ZI_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < kMaxDevices && cached[dev].load(std::memory_order_relaxed) != 0)
    return cached[dev].load(std::memory_order_relaxed) == 1;
  int sms = 0;
  ZI_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const bool plain = sms > 0 && cuda::peak_memory_bytes_per_s(dev) / sms >= 30e9;
  if (dev < kMaxDevices) cached[dev].store(plain ? 1 : 2, std::memory_order_relaxed);
  return plain;
}

void mxfp4_grouped_gemm_cuda(const Mxfp4CudaGemmParams& p, void* stream) {
  const bool masked = p.masked_m != nullptr, routed = p.route_ids != nullptr;
  ZI_CHECK(int{masked} + int{routed} + int{p.expert_offsets != nullptr} == 1,
           "exactly one of expert_offsets / masked_m / route_ids must be given");
  ZI_CHECK(!routed || (p.a_dtype == DType::kBFloat16 && p.m <= kMxfp4RoutedMaxRows &&
                       p.route_div >= 1 && p.m % p.route_div == 0 &&
                       (p.tile == 0 || p.tile == 1 || p.tile == 3)),
           "the routed layout takes bfloat16 activations, m <= kMxfp4RoutedMaxRows rows, a "
           "route_div dividing m and the decode tiles (0, 1, 3)");
  ZI_CHECK(!(masked && p.expert_counts != nullptr), "expert_counts only with expert_offsets");
  ZI_CHECK(p.num_experts >= 1 && p.num_experts <= kMxfp4CudaMaxExperts,
           "num_experts out of the CUDA kernel's range");
  ZI_CHECK(p.a_dtype == DType::kBFloat16 || p.a_dtype == DType::kFloat8E4M3,
           "CUDA kernel activations must be bfloat16 or float8_e4m3fn");
  ZI_CHECK((p.a_dtype == DType::kFloat8E4M3) == (p.a_scale != nullptr),
           "a_scale is required exactly for float8 activations");
  ZI_CHECK(p.a_scale == nullptr || (p.a_scale_row_stride >= 0 && p.a_scale_k_stride >= 0),
           "a_scale_row_stride / a_scale_k_stride must be set (row-major a_scale: k/128, 1)");
  ZI_CHECK(p.out_dtype == DType::kBFloat16 || p.out_dtype == DType::kFloat32,
           "output dtype must be bfloat16 or float32");
  ZI_CHECK(p.k >= 32 && p.k % 32 == 0, "k must be a positive multiple of 32");
  ZI_CHECK(p.a_dtype != DType::kFloat8E4M3 || p.k % 128 == 0, "float8 needs k % 128 == 0");
  ZI_CHECK(p.k_pad >= p.k && p.k_pad % kMxfp4PackK == 0 && p.k_pad - p.k < kMxfp4PackK,
           "k_pad must be k rounded up to kMxfp4PackK");
  ZI_CHECK(p.n >= 1 && p.n_pad % kMxfp4PackRows == 0, "n_pad must be a multiple of kMxfp4PackRows");
  ZI_CHECK(p.k_pad <= (int64_t{1} << 22), "k too large for the kernel's 32-bit weight offsets");
  ZI_CHECK(p.fp8_layout == (p.a_dtype == DType::kFloat8E4M3),
           "packed weights' bit layout does not match the activation dtype");
  ZI_CHECK(p.row_base == nullptr || p.a_dtype == DType::kFloat8E4M3,
           "row_base (W4A8 row bases) goes with float8 activations only");
  ZI_CHECK(p.gate_up_interleaved == p.fuse_swiglu,
           "fuse_swiglu needs gate/up-interleaved packed weights (and only then)");
  ZI_CHECK(!p.fuse_swiglu || (p.n % 2 == 0 && p.n_pad >= 2 * ((p.n / 2 + 7) / 8 * 8)),
           "packed rows too few for n");
  ZI_CHECK(p.fuse_swiglu || p.n_pad >= p.n, "packed rows too few for n");
  ZI_CHECK(masked ? (p.cap >= 0 && p.num_experts * p.cap < (int64_t{1} << 31))
                  : (p.m >= 0 && p.m < (int64_t{1} << 31)),
           "row count out of the CUDA kernel's int32 range");
  ZI_CHECK(p.fp8_tiny_loop >= 0 && p.fp8_tiny_loop <= 2,
           "fp8_tiny_loop must be 0 (by the device), 1 (plain) or 2 (skewed)");
  ZI_CHECK(p.tile >= 0 && p.tile <= 4,
           "tile must be 0 (auto), 1 (small), 2 (wide), 3 (tiny) or 4 (wgmma)");
  const Mxfp4CudaPlan plan = mxfp4_cuda_plan(p.a_dtype == DType::kFloat8E4M3, masked, p.m,
                                             p.num_experts, p.cap, p.tile, routed);
  ZI_CHECK((p.a_kslot != nullptr) == (p.a_dtype == DType::kBFloat16 &&
                                      (mxfp4_plan_uses(plan, 4) || mxfp4_plan_uses(plan, 2))),
           "a_kslot (the activations in k-slot order) goes with the bf16 wgmma tiles (2, 4), and "
           "only with them");
  auto s = static_cast<cudaStream_t>(stream);
  auto run = [&](int tile, int32_t rows_lo, int32_t rows_hi) {
    Mxfp4CudaGemmParams q = p;
    q.rows_lo = rows_lo;
    q.rows_hi = rows_hi;
    const bool fp8 = q.a_dtype == DType::kFloat8E4M3;  // (wgmma at every size, see WgCfg)
    if (tile == 1 && rows_lo == 0) {  // the small tile as the base: many waves of items
      if (fp8)
        launch<WgFp8SmallBaseCfg>(q, s);
      else
        launch<SmallBaseCfg>(q, s);
    } else if (fp8 && tile == 3 && mxfp4_fp8_tiny_plain_loop(q.fp8_tiny_loop)) {
      launch<WgFp8TinyPlainCfg>(q, s);
    } else if (fp8) {
      launch_tile<WgFp8SmallCfg, WsFp8Cfg, WgFp8TinyCfg, WgFp8Cfg>(tile, q, s);
    } else {
      launch_tile<SmallCfg, WgBf16WideCfg, TinyCfg, WgBf16Cfg>(tile, q, s);
    }
  };
  for (int i = 0; i < plan.launches; ++i) {
    const int64_t hi = i + 1 < plan.launches ? plan.from_rows[i + 1] : INT32_MAX;
    run(plan.tile[i], static_cast<int32_t>(std::min<int64_t>(plan.from_rows[i], INT32_MAX)),
        static_cast<int32_t>(std::min<int64_t>(hi, INT32_MAX)));
  }
}

}  // namespace zi

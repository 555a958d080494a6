// Forward prep of the chunked gated delta rule (gdn.h; docs/kernels.md, "Forward
// stages"): per (chunk slot, q/k head) K K^T (of the L2-normalised keys when asked: the
// raw product scaled by the row norms in fp32) and the log2 inverse norms of the q and k
// rows for the walk, and per value head gcum (of g floored at kGdnGateFloor), the chunk's
// certified log decay (chunk_decay), beta per row (chunk_beta) and the WY inverse A. No
// normalised copy of q or k goes through HBM: the walk loads them raw and applies the
// norms in fp32 (fwd_walk_loads.cuh). The backward's recompute runs this same prep.
//
// Why it is as it is:
// - Bytes: per (slot, q/k head) the CTA reads k (16 KB), with use_qk_l2norm q (16 KB, for
//   its norms only: straight into registers) and writes one 8 KB tile of A and 256 bytes
//   of beta per value head and 512 bytes of norms. The norms are formed here, once per q/k head, not
//   in the walk (whose aux work lies on the path from a chunk's landing to the state
//   warpgroups) and not as normalised bf16 copies (more bytes). k is requested up front
//   with cp.async (no registers held while it flies), q and the gates are loaded under
//   it; K K^T is parked in shared memory between value heads; <= 80 registers (raw keys:
//   96) and 29 KB of shared memory give 6 CTAs (raw keys: 5) per SM, so other CTAs' loads
//   stay in flight while one CTA inverts. The prep's time is issue and the inverse's
//   round barriers, not load latency or the chunk lookup (docs/experiments.md).
// - K K^T (64x64x128, bf16 tensor cores) is formed once per q/k head and reused by the
//   G value heads; only the gating, beta and the inverse are per value head.
// - The inverse A = (I + L)^-1 is blocked 16x16, warp w owning block row w (the rows of
//   its K K^T accumulators). Phase 0, all warps at once and without shared memory: L_ww
//   from K K^T and the gates, then A_ww by right-looking substitution in fp32, in the
//   mma accumulator layout (a lane holds rows gid, gid + 8, four columns; step q takes row
//   q of A and column q of L by shuffle, 4 FMAs a lane). Then
//   A_wJ = -A_ww sum_{K=J}^{w-1} L_wK A_KJ: term (J, K) needs tile A_KJ of warp K, ready
//   after round K - J, so three rounds (a CTA barrier each) finish rows 1, 2, 3 in turn
//   while the later rows sum the terms they already can; a row is stored as soon as it
//   is done. The exchanged tiles are written once per head and read before the barrier
//   that precedes their next write, so one buffer serves all value heads.
// - The merges run on tensor cores (mma.m16n8k8 tf32) with every operand kept in the
//   accumulator layout: products are taken transposed,
//   (A_wJ)^T = -(sum_K (A_KJ)^T L_wK^T) A_ww^T, so the left operand is an accumulator
//   (the A fragment up to a permutation of k, which the B fragment then repeats) and the
//   right operand's transpose is one (L_wK, A_ww as they are). Tiles cross warps lane for
//   lane; only diagonal blocks are read back transposed (row stride 20 words: conflict-free
//   both ways). Output rows go through stmatrix (.trans for the transposed blocks) into
//   padded staging rows, then out as 16-byte stores, four whole rows per instruction.
// - Precision (docs/contract.md, "Accuracy"): the diagonal solves are fp32 FMA. The merges
//   are 3xTF32 for raw keys (x = xb + xs, xy = xb yb + xb ys + xs yb, fp32 accumulate):
//   plain TF32 of un-normalised keys errs above bf16's 2^-8; for unit keys
//   (use_qk_l2norm) one TF32 product of operands rounded to nearest, whose error is far
//   under the rounding of A to the bf16 that the walk consumes. A keeps the fp32 range
//   (un-normalised keys can make it large) and is rounded once, to bf16. beta is not
//   folded in: the walks scale the rows that A multiplies by it (fwd_walk_state.cuh,
//   fwd_walk_reverse.cuh), so the one tile serves them and the backward's dbeta, which
//   needs A itself (A diag(beta) cannot give A back where beta is 0).
// - L in log2 units (gl = gcum log2(e) staged once per head, not a multiply an element)
//   and the strictly-lower mask in the diagonal block's form_l only: the registers that
//   let unit keys run 6 CTAs an SM without spills.
// - Exponents are differences of chunk-local cumsums, clamped to <= 0, so strong decay
//   (gcum down to 64 kGdnGateFloor in a chunk) underflows to 0, never to 0 * inf; the
//   floor keeps a reset (g = -inf) from making them -inf - (-inf).
// - Deterministic, bitwise run to run: fixed-order scans and sums, no atomics.

#include <cuda_bf16.h>

#include "common/mma_sm80.cuh"
#include "common/scan.cuh"
#include "common/swizzle.cuh"
#include "gdn/chunks.cuh"
#include "gdn/gdn.h"
#include "gdn/plan.h"

namespace cake {
namespace {

constexpr int kPrepThreads = 128;  // 4 warps; warp w owns rows 16w .. 16w+15 of the chunk
// CTAs per SM: 6 (<= 80 registers a thread) for unit keys, 5 (<= 96) for raw keys, whose
// 3xTF32 merges spill at 80; ~29 KB of shared memory a CTA.
constexpr int prep_ctas_per_sm(bool unit_keys) { return unit_keys ? 6 : 5; }
constexpr int kGateHeads = 4;      // value heads whose gates are staged at once: one scan per warp

// Shared memory of the prep CTA (bytes). The k tile (bf16 64x128, swizzled) lives until
// K K^T is formed; K K^T has its own space (warps park theirs while others still read k);
// then the k tile's space holds the tiles exchanged by the inverse and each warp's output
// staging.
constexpr int kTileBytes = kGdnChunk * kGdnHeadDim * 2;
constexpr int kKTile = 0;
constexpr int kFragBytes = 32 * 8 * 4;                 // one 16x16 fp32 tile, lane for lane
constexpr int kKK = kTileBytes;                        // K K^T, block lower triangle: 10 tiles
constexpr int kSmemBytes = kKK + 10 * kFragBytes;
constexpr int kDiagLd = 20;                            // fp32 row stride of an exchanged diagonal block
constexpr int kDiagBytes = 16 * kDiagLd * 4;
constexpr int kDiag = kKTile;                          // A_00, A_11, A_22
constexpr int kOff = kDiag + 3 * kDiagBytes;           // (A_10)^T, (A_20)^T, (A_21)^T
constexpr int kStageLd = 144;                          // bytes a staging row: 64 bf16 + 16 (conflict-free)
constexpr int kStageBytes = 16 * kStageLd;             // per warp: its 16 rows of the bf16 output
constexpr int kStage = kOff + 3 * kFragBytes;
static_assert(kStage + 4 * kStageBytes <= kKTile + kTileBytes, "exchange and staging fit the k tile");
static_assert(kOff % 16 == 0 && kStage % 16 == 0, "16-byte fragments and staging chunks");

// A 16x16 fp32 tile in the accumulator layout of mma.m16n8k8 as two 16x8 halves: t[h][e]
// is (row gid + 8 (e >> 1), column 8 h + 2 t4 + (e & 1)), lane = 4 gid + t4.
using Tile = float[2][4];

// ---------------------------------------------------------------------------------
// Small PTX helpers not in mma_sm80.cuh.


// This thread's lane, read anew at each use: the per-lane addresses and constants derived
// from it are then recomputed per value head instead of being hoisted out of the head loop
// and pinned in registers (or spilled) across the inverses.
__device__ __forceinline__ int lane_id() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
  return lane;
}

// x rounded to tf32 (13 low bits zero), to nearest with ties away, as cvt.rna.tf32 but
// without its inf/NaN guard, which the bit trick does not need.
__device__ __forceinline__ uint32_t round_tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

// x = big + small, both tf32: big = round_tf32(x), small the exact remainder x - big
// truncated, so |x - big - small| <= 2^-21 |x|.
__device__ __forceinline__ void split_tf32(float x, uint32_t& big, uint32_t& small) {
  big = round_tf32(x);
  small = __float_as_uint(x - __uint_as_float(big)) & 0xffffe000u;
}



// ---------------------------------------------------------------------------------
// 16x16 tile algebra in the accumulator layout (one warp).

// d += x y, x in the accumulator layout, y given by y^T in the accumulator layout. In k step
// kt the A fragment's k slot t4 is column 8 kt + 2 t4 of x and slot t4 + 4 column
// 8 kt + 2 t4 + 1: x's accumulator registers as they are, and then the B fragment (k
// slots t4, t4 + 4 at n = gid) is exactly y^T's. 3xTF32 for raw keys, one rounded TF32
// product for unit keys (see the file comment).
template <bool kUnitKeys>
__device__ __forceinline__ void mma_tile(Tile& d, const Tile& x, const Tile& yt) {
#pragma unroll
  for (int kt = 0; kt < 2; ++kt) {
    uint32_t xb[4], xs[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {  // a0 .. a3
      const float xe = x[kt][(s & 1) * 2 + (s >> 1)];
      if constexpr (kUnitKeys) xb[s] = round_tf32(xe);
      else split_tf32(xe, xb[s], xs[s]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      if constexpr (kUnitKeys) {
        mma::mma_tf32(d[nt], xb, round_tf32(yt[kt][2 * nt]), round_tf32(yt[kt][2 * nt + 1]));
      } else {
        uint32_t yb0, ys0, yb1, ys1;
        split_tf32(yt[kt][2 * nt], yb0, ys0);
        split_tf32(yt[kt][2 * nt + 1], yb1, ys1);
        mma::mma_tf32(d[nt], xs, yb0, yb1);
        mma::mma_tf32(d[nt], xb, ys0, ys1);
        mma::mma_tf32(d[nt], xb, yb0, yb1);
      }
    }
  }
}

// a = (I + l)^-1 for a strictly lower 16x16 l (zeros on and above the diagonal), fp32.
// Right-looking: once rows < q are done, row q of A is final and is subtracted, times
// l[r][q], from every row r > q. A lane needs row q only in its own 4 columns (held by the
// lane of the same t4 in row group q & 7) and l[r][q] for its rows (held in its own row
// group). Rows r <= q meet l[r][q] = 0 and stay as they are.
__device__ __forceinline__ void invert_unit_lower(const Tile& l, Tile& a, int lane) {
  const int gid = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[h][e] = gid + 8 * (e >> 1) == 8 * h + 2 * t4 + (e & 1) ? 1.f : 0.f;
#pragma unroll
  for (int q = 0; q < 15; ++q) {
    const int qh = q >> 3;                      // column half holding column q; row q's row half
    const int l_src = 4 * gid + ((q & 7) >> 1);  // the lane holding l[gid][q], l[gid + 8][q]
    const int a_src = 4 * (q & 7) + t4;         // the lane holding row q in this lane's columns
    const float l_hi = __shfl_sync(0xffffffffu, l[qh][2 + (q & 1)], l_src);
    const float l_lo = qh == 0 ? __shfl_sync(0xffffffffu, l[qh][q & 1], l_src) : 0.f;  // rows < 8 < q: 0
#pragma unroll
    for (int h = 0; h <= qh; ++h) {  // row q is zero right of column q
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float a_q = __shfl_sync(0xffffffffu, a[h][2 * qh + c], a_src);
        a[h][2 + c] = fmaf(-l_hi, a_q, a[h][2 + c]);
        if (qh == 0) a[h][c] = fmaf(-l_lo, a_q, a[h][c]);
      }
    }
  }
}

// Exchange through shared memory. Off-diagonal tiles go lane for lane (16-byte
// fragments, conflict-free); a diagonal block is stored row-major and read back
// transposed (row stride 20 words: conflict-free both ways).
__device__ __forceinline__ void store_frag(float4* t, const Tile& f, int lane) {
  t[lane] = make_float4(f[0][0], f[0][1], f[0][2], f[0][3]);
  t[32 + lane] = make_float4(f[1][0], f[1][1], f[1][2], f[1][3]);
}

__device__ __forceinline__ void load_frag(const float4* t, Tile& f, int lane) {
  const float4 u = t[lane], v = t[32 + lane];
  f[0][0] = u.x, f[0][1] = u.y, f[0][2] = u.z, f[0][3] = u.w;
  f[1][0] = v.x, f[1][1] = v.y, f[1][2] = v.z, f[1][3] = v.w;
}

__device__ __forceinline__ void store_diag(float* t, const Tile& a, int lane) {
  const int gid = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int v = 0; v < 2; ++v)
      *reinterpret_cast<float2*>(t + (gid + 8 * v) * kDiagLd + 8 * h + 2 * t4) =
          make_float2(a[h][2 * v], a[h][2 * v + 1]);
}

// x = a^T in the accumulator layout, a stored by store_diag.
__device__ __forceinline__ void load_diag_transposed(const float* t, Tile& x, int lane) {
  const int gid = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[h][e] = t[(8 * h + 2 * t4 + (e & 1)) * kDiagLd + gid + 8 * (e >> 1)];
}

// Output staging: the warp's 16 rows x 64 columns of A in bf16, rows padded to 144 bytes:
// the 8 rows of an stmatrix matrix fall in distinct bank quads, row reads take the
// minimum wavefronts, and every address is a lane term plus a constant.

// Block (W, W): a = A_WW.
__device__ __forceinline__ void stage_diag(uint32_t stage, const Tile& a, int W, int lane) {
  const int m = lane >> 3;
  uint32_t r[4];  // matrix 2h + v: rows 8v.., columns 8h.. of the block
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int v = 0; v < 2; ++v) r[2 * h + v] = mma::pack_bf16(a[h][2 * v], a[h][2 * v + 1]);
  mma::stmatrix_x4(stage + (8 * (m & 1) + (lane & 7)) * kStageLd + (2 * W + (m >> 1)) * 16, r);
}

// Block (W, J), J < W, from at = (A_WJ)^T: stored transposed.
__device__ __forceinline__ void stage_transposed(uint32_t stage, const Tile& at, int J, int lane) {
  const int m = lane >> 3;
  uint32_t r[4];  // matrix 2h + v: rows 8v.., columns 8h.. of (A_WJ)^T
#pragma unroll
  for (int v = 0; v < 2; ++v)
#pragma unroll
    for (int h = 0; h < 2; ++h) r[2 * h + v] = mma::pack_bf16(at[h][2 * v], at[h][2 * v + 1]);
  mma::stmatrix_x4_trans(stage + (8 * (m >> 1) + (lane & 7)) * kStageLd + (2 * J + (m & 1)) * 16, r);
}

// Rows 16W .. 16W+15 of the 64x64 output: staged blocks J <= W, zeros right of them;
// each store instruction writes four whole 128-byte rows.
__device__ __forceinline__ void store_rows(const unsigned char* stage, __nv_bfloat16* a_out, int W, int lane) {
  __syncwarp();
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int row = 4 * it + (lane >> 3), chunk = lane & 7;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (chunk < 2 * W + 2) v = *reinterpret_cast<const uint4*>(stage + row * kStageLd + chunk * 16);
    *reinterpret_cast<uint4*>(a_out + (16 * W + row) * kGdnChunk + chunk * 8) = v;
  }
  __syncwarp();  // the staging is rewritten by the next value head
}

struct InverseSmem {
  const float4* kk;  // K K^T tiles, lane for lane: block row w's tiles from w (w + 1) / 2
  float* diag;
  float4* off;       // (A_KJ)^T for (J, K) = (0, 1), (0, 2), (1, 2) at J + K - 1
  unsigned char* stage;
};

// Tile L_WK = beta_i 2^min(gl_i - gl_j, 0) (K K^T)_ij of block row W, gl = gcum log2(e),
// from the parked K K^T and this head's gates; kDiag: K = W, strictly lower (the mask is
// the diagonal block's alone). Formed where used rather than kept across the rounds'
// barriers: a few exponentials buy back the registers.
template <bool kDiag>
__device__ __forceinline__ void form_l(const float4* s_kk, const float* gl, const float* beta, int W, int K, Tile& l,
                                       int lane) {
  const int gid = lane >> 2, t4 = lane & 3;
  const int i0 = 16 * W + gid;
  const float gl_i[2] = {gl[i0], gl[i0 + 8]}, beta_i[2] = {beta[i0], beta[i0 + 8]};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float4 kk4 = s_kk[((W * (W + 1) / 2 + K) * 2 + h) * 32 + lane];
    const float kk[4] = {kk4.x, kk4.y, kk4.z, kk4.w};
    const float2 gl_j = *reinterpret_cast<const float2*>(gl + 16 * K + 8 * h + 2 * t4);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v = e >> 1, c = e & 1;
      const float d = mma::exp2_ftz(fminf(gl_i[v] - (c ? gl_j.y : gl_j.x), 0.f));
      const bool lower = !kDiag || 8 * h + 2 * t4 + c < gid + 8 * v;
      l[h][e] = lower ? beta_i[v] * d * kk[e] : 0.f;
    }
  }
}

// One value head, block row W = this warp of the chunk; see the file comment. gl, beta: this head's
// 64 gcum log2(e) and beta values (shared memory). W is a runtime value and the rounds a loop, so
// that the four warps run one copy of the code: a copy per block row stalls on
// instruction-cache misses (docs/experiments.md).
template <bool kUnitKeys>
__device__ __forceinline__ void invert_block_row(const InverseSmem& s, const float* gl, const float* beta,
                                                 __nv_bfloat16* a_out, int W) {
  const int lane = lane_id();
  unsigned char* stage_ptr = s.stage + W * kStageBytes;
  const uint32_t stage = mma::smem_addr(stage_ptr);

  // Phase 0: the diagonal block A_WW = (I + L_WW)^-1.
  float l[2][4];
  form_l<true>(s.kk, gl, beta, W, W, l, lane);
  float a[2][4];  // A_WW
  invert_unit_lower(l, a, lane);
  if (W < 3) store_diag(s.diag + W * 16 * kDiagLd, a, lane);
  stage_diag(stage, a, W, lane);

  // Rounds 1..3: T^T_J = sum_{K=J}^{W-1} (A_KJ)^T L_WK^T, term (J, K) in round K - J + 1;
  // when complete (round W - J), (A_WJ)^T = -T^T_J A_WW^T. J is unrolled (tt stays in
  // registers); rows with fewer terms skip theirs (W is the same for the whole warp).
  float tt[3][2][4] = {};
#pragma unroll 1
  for (int round = 1; round <= 3; ++round) {
    if (round == W + 1) store_rows(stage_ptr, a_out, W, lane);  // row W is complete
    mma::cta_barrier();  // the warps reach it from different code: the non-.aligned form
#pragma unroll
    for (int J = 2; J >= 0; --J) {
      const int K = J + round - 1;
      if (J >= W || K >= W) continue;
      float x[2][4];
      if (K == J) load_diag_transposed(s.diag + J * 16 * kDiagLd, x, lane);
      else load_frag(s.off + (J + K - 1) * 64, x, lane);
      form_l<false>(s.kk, gl, beta, W, K, l, lane);
      mma_tile<kUnitKeys>(tt[J], x, l);
      if (K == W - 1) {
        float at[2][4] = {};
        mma_tile<kUnitKeys>(at, tt[J], a);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e) at[h][e] = -at[h][e];
        if (W < 3) store_frag(s.off + (J + W - 1) * 64, at, lane);
        stage_transposed(stage, at, J, lane);
      }
    }
  }
  if (W == 3) store_rows(stage_ptr, a_out, W, lane);  // (W = 3: no zeros right of it)
}

// ---------------------------------------------------------------------------------
// Loads and the L2 norm.

__device__ __forceinline__ float load_beta(const void* beta, DType dtype, int64_t i) {
  if (dtype == DType::kBFloat16) return __bfloat162float(static_cast<const __nv_bfloat16*>(beta)[i]);
  return static_cast<const float*>(beta)[i];
}

// The chunk's 64 rows of x [T, H, 128] (bf16, H heads a token row) for head h into the swizzled tile, zeros
// past the document end. Threads: 16 per row, 8 rows per pass.
__device__ __forceinline__ void copy_rows(const __nv_bfloat16* __restrict__ x, unsigned char* tile,
                                          const ChunkPos& pos, int64_t H, int h) {
  const int tid = threadIdx.x, c = tid & 15;
#pragma unroll
  for (int it = 0; it < 8; ++it) {
    const int r = it * 8 + (tid >> 4);
    const bool real = r < pos.len;
    const __nv_bfloat16* src = x + ((pos.t0 + (real ? r : 0)) * H + h) * kGdnHeadDim + c * 8;
    mma::cp_async_16(mma::smem_addr(tile + swizzle_rows_offset<16>(r, c)), src, real);
  }
}

// Rows of a 64x128 bf16 tile in the norms' layout: 16 lanes a row (16 bytes each), 8 rows
// a pass; raw[it] is row 8 it + tid / 16.
using RowChunks = uint4[8];

__device__ __forceinline__ void rows_from_smem(const unsigned char* tile, RowChunks& raw) {
  const int tid = threadIdx.x, c = tid & 15;
#pragma unroll
  for (int it = 0; it < 8; ++it)
    raw[it] = *reinterpret_cast<const uint4*>(tile + swizzle_rows_offset<16>(it * 8 + (tid >> 4), c));
}

// Straight from global memory (pad rows: zeros): q is read only for its norms.
__device__ __forceinline__ void rows_from_global(const __nv_bfloat16* __restrict__ x, RowChunks& raw,
                                                 const ChunkPos& pos, int64_t H, int h) {
  const int tid = threadIdx.x, c = tid & 15;
#pragma unroll
  for (int it = 0; it < 8; ++it) {
    const int r = it * 8 + (tid >> 4);
    raw[it] = r < pos.len ? __ldg(reinterpret_cast<const uint4*>(x + ((pos.t0 + r) * H + h) * kGdnHeadDim + c * 8))
                          : make_uint4(0u, 0u, 0u, 0u);
  }
}

// This lane's part of |x_r|^2 for row 8 it + tid / 16: its 8 values (fp32 FMAs of the bf16 values).
__device__ __forceinline__ float lane_sumsq(const uint4& w) {
  const float2 f[4] = {mma::unpack_bf16(w.x), mma::unpack_bf16(w.y), mma::unpack_bf16(w.z), mma::unpack_bf16(w.w)};
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    ss = fmaf(f[e].x, f[e].x, ss);
    ss = fmaf(f[e].y, f[e].y, ss);
  }
  return ss;
}

// The tile's 64 rows: lrn[r] = log2(1 / sqrt(|x_r|^2 + eps)) (global, for the walk) and,
// if rstd, rstd[r] = 1 / sqrt(|x_r|^2 + eps) (shared, for K K^T).
// The 16 lanes of a half-warp (one aligned half) hold rows 8 it + tid / 16, it = 0..7,
// in 16 parts each. A transposing butterfly sums them: at xor 8, 4 and 2 each lane keeps
// half of its rows and adds its partner's parts of them, then xor 1 adds the last pair,
// leaving row it = l / 2 in lanes l and l + 1 of the half: 8 shuffles and one log and
// rsqrt a lane, where a reduction per row took 32 and eight.
__device__ __forceinline__ void row_norms(const RowChunks& raw, float* lrn, float* rstd) {
  const int tid = threadIdx.x, l = tid & 15;
  float v[8];
#pragma unroll
  for (int it = 0; it < 8; ++it) v[it] = lane_sumsq(raw[it]);
#pragma unroll
  for (int o = 8, n = 4; o > 1; o >>= 1, n >>= 1) {  // keep rows with bit o of it set where bit o of l is
    const bool upper = (l & o) != 0;
#pragma unroll
    for (int j = 0; j < n; ++j) {
      const float keep = upper ? v[j + n] : v[j], give = upper ? v[j] : v[j + n];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, give, o);
    }
  }
  const float ss = v[0] + __shfl_xor_sync(0xffffffffu, v[0], 1) + kL2NormEps;
  if ((l & 1) == 0) {
    const int r = (l >> 1) * 8 + (tid >> 4);
    lrn[r] = -0.5f * __log2f(ss);
    if (rstd != nullptr) rstd[r] = rsqrtf(ss);
  }
}

// gcum and beta of value heads hv0 .. hv0 + n - 1 (n <= kGateHeads), warp w taking head
// hv0 + w: the chunk-local inclusive cumsum of g floored at kGdnGateFloor (pads have
// g = 0, so they repeat the last value) to p.gcum, and in log2 units (gl = gcum log2(e), what the exponentials of L take)
// to shared memory with its last value as it is (the chunk's decay); beta (0 on pads) to
// shared memory and to p.chunk_beta (the walks scale the rows A multiplies by it).
__device__ __forceinline__ void load_gates(const GdnFwdArgs& p, const ChunkPos& pos, int64_t slot, int64_t hv0,
                                           int n, float (*s_gl)[kGdnChunk], float* s_gc_last, float (*s_beta)[kGdnChunk]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp >= n) return;
  const int64_t hv = hv0 + warp;
  float x[2], b[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int i = 32 * s + lane;
    const int64_t idx = (pos.t0 + i) * p.HV_stride + hv;
    const float gi = i < pos.len ? p.g[idx] : 0.f;
    x[s] = gi < kGdnGateFloor ? kGdnGateFloor : gi;  // the floor (gdn.h); not fmaxf, which would drop NaN
    b[s] = i < pos.len ? load_beta(p.beta, p.beta_dtype, idx) : 0.f;
  }
  warp_inclusive_scan(x);  // the two halves' scans side by side
  x[1] += __shfl_sync(0xffffffffu, x[0], 31);
  float* gcum = p.gcum + (slot * p.HV + hv) * kGdnChunk;
  float* chunk_beta = p.chunk_beta + (slot * p.HV + hv) * kGdnChunk;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    s_gl[warp][32 * s + lane] = x[s] * mma::kLog2e;
    s_beta[warp][32 * s + lane] = b[s];
    gcum[32 * s + lane] = x[s];
    chunk_beta[32 * s + lane] = b[s];
  }
  if (lane == 31) s_gc_last[warp] = x[1];
}

// chunk_decay (see gdn.h) of one value head, by one warp: the chunk's log decay if
// every token's update I - beta k k^T is a contraction (0 <= beta |k|^2 <= 2; pads have
// beta = 0), else +inf, so that a window holding such a chunk is never truncated. NaN
// fails both tests and gives NaN or +inf: never truncated either.
__device__ __forceinline__ void write_chunk_decay(float* out, const float* gc_last, const float* beta,
                                                  const float* knorm2) {
  const int lane = threadIdx.x & 31;
  bool contraction = true;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const float bk = beta[32 * s + lane] * knorm2[32 * s + lane];
    contraction = contraction && bk >= 0.f && bk <= 2.f;
  }
  contraction = __all_sync(0xffffffffu, contraction);
  if (lane == 0) *out = contraction ? *gc_last : __int_as_float(0x7f800000);
}

// kUnitKeys = p.use_qk_l2norm: q and k rows are normalised here (and in the walk).
template <bool kUnitKeys>
__global__ void __launch_bounds__(kPrepThreads, prep_ctas_per_sm(kUnitKeys))
    gdn_fwd_prep_kernel(const GdnFwdArgs p) {
  __shared__ __align__(128) unsigned char smem[kSmemBytes];
  __shared__ float s_gl[kGateHeads][kGdnChunk];  // gcum log2(e)
  __shared__ float s_gc_last[kGateHeads];  // gcum's last value
  __shared__ float s_beta[kGateHeads][kGdnChunk];
  __shared__ float s_knorm2[kGdnChunk];  // |k_i|^2, the diagonal of K K^T
  __shared__ float s_rk[kGdnChunk];      // 1 / |k_i| (with use_qk_l2norm)

  const int H = static_cast<int>(p.H);  // head counts and the grid fit 32 bits: cheap division
  const int64_t slot = blockIdx.x / H;
  const int h = static_cast<int>(blockIdx.x % H);
  const int64_t NCused = p.chunk_offsets[p.N];
  if (slot >= NCused) return;  // an unused slot: nothing to do (the walk never reads it)
  const CuSeqlens cu{p.cu_seqlens, p.cu_int64};
  const ChunkPos pos = find_chunk(p.chunk_offsets, cu, p.N, slot);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int mi = lane >> 3, r8 = lane & 7;  // ldmatrix: matrix index and row of this lane's address
  const int G = static_cast<int>(p.HV) / H;

  // 1. k in flight, q's rows (for their norms) and the first value heads' gates meanwhile.
  copy_rows(static_cast<const __nv_bfloat16*>(p.k), smem + kKTile, pos, p.H_stride, h);
  mma::cp_async_commit();
  RowChunks raw;
  if constexpr (kUnitKeys) rows_from_global(static_cast<const __nv_bfloat16*>(p.q), raw, pos, p.H_stride, h);
  load_gates(p, pos, slot, static_cast<int64_t>(h) * G, G < kGateHeads ? G : kGateHeads, s_gl, s_gc_last,
             s_beta);

  // 2. The rows' norms, when normalised: q's and k's for the walk; k's also for K K^T
  //    (kn_i . kn_j = rk_i rk_j (k_i . k_j)).
  float* lrn = kUnitKeys ? p.qk_lrn + (slot * p.H + h) * 2 * kGdnChunk : nullptr;
  if constexpr (kUnitKeys) row_norms(raw, lrn, nullptr);
  mma::cp_async_wait_all();
  __syncthreads();
  if constexpr (kUnitKeys) {
    rows_from_smem(smem + kKTile, raw);
    row_norms(raw, lrn + kGdnChunk, s_rk);
    __syncthreads();
  }

  // 3. K K^T, lower block triangle: warp w forms rows 16w.. for columns < 16w + 16,
  //    scales them by the row norms (fp32) and parks them.
  {
    float kk[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) kk[j][0] = kk[j][1] = kk[j][2] = kk[j][3] = 0.f;
    const uint32_t k_base = mma::smem_addr(smem + kKTile);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      uint32_t a[4];
      mma::ldmatrix_x4(a, k_base + swizzle_rows_offset<16>(16 * warp + (mi & 1) * 8 + r8, 2 * ks + (mi >> 1)));
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        if (jp <= warp) {
          uint32_t b[4];
          mma::ldmatrix_x4(b, k_base + swizzle_rows_offset<16>(16 * jp + (mi >> 1) * 8 + r8, 2 * ks + (mi & 1)));
          mma::mma_bf16(kk[2 * jp], a, b[0], b[1]);
          mma::mma_bf16(kk[2 * jp + 1], a, b[2], b[3]);
        }
      }
    }
    if constexpr (kUnitKeys) {
      const int gid = lane >> 2, t4 = lane & 3;
#pragma unroll
      for (int jt = 0; jt < 8; ++jt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if ((jt >> 1) <= warp)
            kk[jt][e] *= s_rk[16 * warp + gid + 8 * (e >> 1)] * s_rk[16 * (jt >> 1) + 8 * (jt & 1) + 2 * t4 + (e & 1)];
    }
    float4* s_kk = reinterpret_cast<float4*>(smem + kKK);
#pragma unroll
    for (int jt = 0; jt < 8; ++jt)
      if ((jt >> 1) <= warp)
        s_kk[((warp * (warp + 1) / 2 + (jt >> 1)) * 2 + (jt & 1)) * 32 + lane] =
            make_float4(kk[jt][0], kk[jt][1], kk[jt][2], kk[jt][3]);
    // The diagonal (row gid + 8 (e >> 1) = column 8 (jt & 1) + 2 t4 + (e & 1) of block jt >> 1 = warp).
    const int gid = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int jt = 0; jt < 8; ++jt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if ((jt >> 1) == warp && gid + 8 * (e >> 1) == 8 * (jt & 1) + 2 * t4 + (e & 1))
          s_knorm2[16 * warp + gid + 8 * (e >> 1)] = kk[jt][e];
  }
  __syncthreads();  // the k tile is free: the inverse's exchange tiles and staging go there

  // 4. Per value head: A, warp w making block row w; gates staged kGateHeads
  //    value heads at a time (the first group above).
  const InverseSmem s{reinterpret_cast<const float4*>(smem + kKK), reinterpret_cast<float*>(smem + kDiag),
                      reinterpret_cast<float4*>(smem + kOff), smem + kStage};
  __nv_bfloat16* a_first =
      static_cast<__nv_bfloat16*>(p.a) + (slot * p.HV + static_cast<int64_t>(h) * G) * kGdnChunk * kGdnChunk;
  for (int g0 = 0; g0 < G; g0 += kGateHeads) {
    const int n = G - g0 < kGateHeads ? G - g0 : kGateHeads;
    if (g0 > 0) {
      __syncthreads();  // the previous group's gates are read
      // The chunk is found again rather than its position held in registers through the inverses.
      load_gates(p, find_chunk(p.chunk_offsets, cu, p.N, slot), slot, static_cast<int64_t>(h) * G + g0, n, s_gl,
                 s_gc_last, s_beta);
      __syncthreads();
    }
    if (warp < n) write_chunk_decay(p.chunk_decay + slot * p.HV + static_cast<int64_t>(h) * G + g0 + warp,
                                    s_gc_last + warp, s_beta[warp], s_knorm2);
    for (int j = 0; j < n; ++j) {
      __nv_bfloat16* a_out = a_first + (g0 + j) * kGdnChunk * kGdnChunk;
      invert_block_row<kUnitKeys>(s, s_gl[j], s_beta[j], a_out, warp);
    }
  }
}

}  // namespace

cudaError_t gdn_fwd_prep_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  if (p.N <= 0 || p.T == 0 || p.H == 0) return cudaSuccess;
  const int64_t blocks = gdn_fwd_chunk_slots(p.T, p.N) * p.H;
  const dim3 grid(static_cast<unsigned>(blocks));
  if (p.use_qk_l2norm) gdn_fwd_prep_kernel<true><<<grid, kPrepThreads, 0, stream>>>(p);
  else gdn_fwd_prep_kernel<false><<<grid, kPrepThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cake

// The GDN backward's reverse walk of the state gradient (bwd_walk.h; the reverse loop of
// cake_ops/pytorch/gdn.py walk_tapes). One CTA of 8 warps per (document, value head).
//
// Layout: the CTA holds dS^T (V rows x K columns, fp32) in registers across the walk, as
// m16n8k16 accumulators: warp w holds value rows 16 w .. 16 w + 15, all 128 head dims;
// s[4 nt + e] is row 16 w + gid + 8 (e >> 1), column 8 nt + 2 t4 + (e & 1) (the forward
// walk's S^T layout, fwd_walk_state.cuh). Per chunk, in the transposed form:
//   dv_new^T = (dS^T K^T) diag(tail) + do^T P          tail_j = e^(gl - gcum_j) / |k_j|
//   X        = (dv_new^T a) diag(decay)                 decay_m = -e^gcum_m / |k_m|
//   dS^T     = e^gl dS^T + (do^T diag(outq)) Q + X K     outq_i = scale e^gcum_i / |q_i|
// (Q, K the raw bf16 rows; X K = -dv_new^T W with W = a diag(e^gcum) k^, associated the
// other way: no W tile, the per-token factors applied in fp32 on the accumulator.)
//
// Why it is as it is (a first, correctness-first version; docs/kernels.md, "Backward"):
// - mma.sync m16n8k16 bf16 -> fp32 only (no wgmma, no warp specialisation). Every
//   product's left operand is either an accumulator repacked in registers (dS^T, dv_new^T,
//   X: the accumulator-to-A-fragment trick of mma_sm80.cuh) or do^T from ldmatrix.trans;
//   every right operand comes from a swizzled shared tile by ldmatrix (.trans where the
//   contraction runs down the tile's rows).
// - Per chunk all warps first form P (bf16, 64 x 64, warp w a 16 x 32 block) and the gate
//   vectors; then each warp runs its 16 value rows' chain alone (no barrier inside it).
// - The chunks are double-buffered with cp.async; rows past the document's end are zero
//   filled (never the next document's values: 0 * inf = NaN), and every per-token factor
//   of a row past the end is selected to 0.
// - Exponents are differences of chunk-local cumsums clamped to <= 0 (masked elements are
//   selected away, never multiplied by 0); absolute ones (e^gcum) are <= 1.
// - The tapes go out through shared staging as 16-byte stores: the dS tape (16 rows of
//   256 bytes a warp), dv_new (the chunk's real token rows x the warp's 32 bytes, in dv's
//   [T, HV, 128] layout: the chunk-local kernel reads it and writes dv over it).
// - The walk over a chunk range with a given start gradient is one function
//   (walk_chunks); the cut walk's three kernels (bwd_walk.h) are made of it: the
//   summaries walk without tapes (and, for M^T, without do: its tile zero-filled), the
//   tape walk from the chained gradients. The chain is plain fp32 FMAs in a fixed order,
//   one CTA per (document, value head, 16 value columns), as the forward's (fwd_chain.cu).

#include <cstdint>

#include <cuda_bf16.h>

#include "common/mma_sm80.cuh"
#include "common/scan.cuh"
#include "common/swizzle.cuh"
#include "common/varlen.cuh"
#include "gdn/bwd_walk.h"
#include "gdn/chunks.cuh"
#include "gdn/gdn.h"

namespace cake {
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kC = kGdnChunk;
constexpr int kD = kGdnHeadDim;

// Shared memory (bytes). Two stages of a chunk's loads, then single buffers.
constexpr int kTile128 = kC * kD * 2;  // 64 rows x 128 bf16 (256-byte rows, swizzle_rows_offset<16>)
constexpr int kTile64 = kC * kC * 2;   // 64 rows x 64 bf16 (128-byte rows, swizzle_rows_offset<8>)
constexpr int kSQ = 0;
constexpr int kSK = kSQ + kTile128;
constexpr int kSDo = kSK + kTile128;
constexpr int kSA = kSDo + kTile128;
constexpr int kSG = kSA + kTile64;   // gcum, 64 floats
constexpr int kSL = kSG + kC * 4;    // log2 inverse norms: q rows, then k rows (128 floats)
constexpr int kStageBytes = kSL + 2 * kC * 4;
constexpr int kP = 2 * kStageBytes;                  // P, 64 x 64 bf16
constexpr int kGv = kP + kTile64;                    // gate vectors (floats)
constexpr int kGvTail = 0, kGvDecay = 64, kGvOutQ = 128, kGvGamma = 192;
constexpr int kStS = kGv + 256 * 4;                  // dS tape staging: 8 warps x 16 rows x 256 bytes
constexpr int kStSWarp = 16 * kD * 2;
constexpr int kStV = kStS + 8 * kStSWarp;            // dv_new tape staging: 64 rows x 128 bf16
constexpr int kSmemBytes = kStV + kTile128;
static_assert(kStageBytes % 128 == 0 && kP % 128 == 0 && kStS % 128 == 0 && kStV % 128 == 0, "tile alignment");
static_assert(kSmemBytes <= 227 * 1024, "shared memory");

__device__ __forceinline__ int swz16(int row, int chunk) { return swizzle_rows_offset<16>(row, chunk); }
__device__ __forceinline__ int swz8(int row, int chunk) { return swizzle_rows_offset<8>(row, chunk); }

__device__ __forceinline__ void cp_async_wait_1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

__device__ __forceinline__ void mma4(float* d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma::mma_bf16(*reinterpret_cast<float(*)[4]>(d), a, b0, b1);
}

// d = A B (16 x 64, fp32), A the bf16 fragments of K k-steps; B's 16 x 16 block (k-step ks,
// columns 16 jp ..) is one ldmatrix_x4 (kTrans: .trans) at b_addr(ks, jp).
template <bool kTrans, int K, class BAddr>
__device__ __forceinline__ void mma_16x64(float (&d)[32], const uint32_t (&a)[K][4], BAddr b_addr) {
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
#pragma unroll
  for (int ks = 0; ks < K; ++ks) {
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
      uint32_t b[4];
      if constexpr (kTrans)
        mma::ldmatrix_x4_trans(b, b_addr(ks, jp));
      else
        mma::ldmatrix_x4(b, b_addr(ks, jp));
      mma4(d + 8 * jp, a[ks], b[0], b[1]);
      mma4(d + 8 * jp + 4, a[ks], b[2], b[3]);
    }
  }
}

// Where a document's chunks are.
struct DocPos {
  int64_t start, end;  // tokens
  int64_t first_slot;
};

// Issue the cp.async loads of chunk c (local index) into stage `st`. Rows past the
// document's end: zeros (the source address is clamped to the chunk's first row); so is
// every row of do without with_do (the walk of a transfer: no output terms).
__device__ __forceinline__ void issue_chunk(const GdnBwdWalkArgs& p, unsigned char* st, const DocPos& d, int c,
                                            int hv, int h, bool with_do) {
  const int tid = threadIdx.x;
  const int64_t t0 = d.start + static_cast<int64_t>(c) * kC;
  const int64_t left = d.end - t0;
  const int len = left < kC ? static_cast<int>(left) : kC;
  const int64_t slot = d.first_slot + c;
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(p.q);
  const __nv_bfloat16* k = static_cast<const __nv_bfloat16*>(p.k);
  const __nv_bfloat16* dout = static_cast<const __nv_bfloat16*>(p.dout);
  const uint32_t sbase = mma::smem_addr(st);
#pragma unroll
  for (int it = 0; it < 4; ++it) {  // 64 rows x 16 chunks, 256 threads
    const int idx = tid + kThreads * it, r = idx >> 4, ch = idx & 15;
    const bool real = r < len;
    const int64_t t = t0 + (real ? r : 0);
    const int off = swz16(r, ch);
    mma::cp_async_16(sbase + kSQ + off, q + (t * p.H_stride + h) * kD + ch * 8, real);
    mma::cp_async_16(sbase + kSK + off, k + (t * p.H_stride + h) * kD + ch * 8, real);
    mma::cp_async_16(sbase + kSDo + off, dout + (t * p.HV_stride + hv) * kD + ch * 8, real && with_do);
  }
  const __nv_bfloat16* a = static_cast<const __nv_bfloat16*>(p.a) + (slot * p.HV + hv) * kC * kC;
#pragma unroll
  for (int it = 0; it < 2; ++it) {  // 64 rows x 8 chunks
    const int idx = tid + kThreads * it, r = idx >> 3, ch = idx & 7;
    mma::cp_async_16(sbase + kSA + swz8(r, ch), a + r * kC + ch * 8, true);
  }
  if (tid < 16) {
    mma::cp_async_16(sbase + kSG + tid * 16, p.gcum + (slot * p.HV + hv) * kC + tid * 4, true);
  } else if (tid < 48 && p.qk_lrn != nullptr) {
    const int i = tid - 16;  // 32 chunks: q's 64 values, then k's
    mma::cp_async_16(sbase + kSL + i * 16, p.qk_lrn + (slot * p.H + h) * 2 * kC + i * 4, true);
  }
}

// Per chunk, by the whole CTA: the gate vectors (threads 0..63) and P (warp w: rows
// 16 (w & 3) .., columns 32 (w >> 2) ..), from the landed stage.
__device__ __forceinline__ void form_chunk(const unsigned char* st, unsigned char* smem, int len, float log2_scale) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3, mi = lane >> 3, r8 = lane & 7;
  const float* gs = reinterpret_cast<const float*>(st + kSG);
  const float* lrq = reinterpret_cast<const float*>(st + kSL);
  const float* lrk = lrq + kC;
  float* gv = reinterpret_cast<float*>(smem + kGv);
  if (tid < kC) {
    const float gj = gs[tid], gl = gs[kC - 1];
    const bool real = tid < len;
    gv[kGvTail + tid] = real ? mma::exp2_ftz(fmaf(fminf(gl - gj, 0.f), mma::kLog2e, lrk[tid])) : 0.f;
    gv[kGvDecay + tid] = real ? -mma::exp2_ftz(fmaf(gj, mma::kLog2e, lrk[tid])) : 0.f;
    gv[kGvOutQ + tid] = real ? mma::exp2_ftz(fmaf(gj, mma::kLog2e, log2_scale + lrq[tid])) : 0.f;
    if (tid == 0) gv[kGvGamma] = mma::exp2_ftz(gl * mma::kLog2e);
  }

  // P = scale tril(q^ k^T * e^(gcum_i - gcum_j)): the raw product times
  // 2^((gcum_i - gcum_j) log2 e + log2 scale + lrq_i + lrk_j), masked by select.
  const int rb = warp & 3, cb = warp >> 2;
  // Blocks wholly above the diagonal (columns 32.. of rows < 32: warps 4, 5) are never
  // read: the product do^T P skips them (chain_chunk, step 3).
  if (cb == 1 && rb <= 1) return;
  const uint32_t sq = mma::smem_addr(st + kSQ), sk = mma::smem_addr(st + kSK);
  float pacc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) pacc[i] = 0.f;
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    uint32_t a[4];
    mma::ldmatrix_x4(a, sq + swz16(16 * rb + 8 * (mi & 1) + r8, 2 * ks + (mi >> 1)));
#pragma unroll
    for (int jp = 0; jp < 2; ++jp) {
      uint32_t b[4];
      mma::ldmatrix_x4(b, sk + swz16(32 * cb + 16 * jp + 8 * (mi >> 1) + r8, 2 * ks + (mi & 1)));
      mma4(pacc + 8 * jp, a, b[0], b[1]);
      mma4(pacc + 8 * jp + 4, a, b[2], b[3]);
    }
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int i = 16 * rb + gid + 8 * hh;
    const float gi = gs[i], rowc = log2_scale + lrq[i];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int j = 32 * cb + 8 * nt + 2 * t4 + c;
        const float f = mma::exp2_ftz(fmaf(fminf(gi - gs[j], 0.f), mma::kLog2e, rowc + lrk[j]));
        float& x = pacc[4 * nt + 2 * hh + c];
        x = j <= i && i < len ? x * f : 0.f;
      }
    }
  }
  const uint32_t sp = mma::smem_addr(smem + kP);
#pragma unroll
  for (int kb = 0; kb < 2; ++kb) {  // 16 x 16 blocks: columns 32 cb + 16 kb ..
    uint32_t r[4];
    mma::to_a_frag(r, pacc, kb);
    mma::stmatrix_x4(sp + swz8(16 * rb + 8 * (mi & 1) + r8, 4 * cb + 2 * kb + (mi >> 1)), r);
  }
}

// One chunk of one warp's chain (value rows 16 warp ..): the tapes of chunk slot `slot`
// (tokens t0 .. t0 + len - 1; kTapes) and s updated to the gradient at the chunk's start.
template <bool kTapes>
__device__ __forceinline__ void chain_chunk(const GdnBwdWalkArgs& p, const unsigned char* st, unsigned char* smem,
                                            float (&s)[64], int64_t slot, int hv, int64_t t0, int len) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t4 = lane & 3, mi = lane >> 3, r8 = lane & 7;
  const uint32_t sq = mma::smem_addr(st + kSQ), sk = mma::smem_addr(st + kSK);
  const uint32_t sdo = mma::smem_addr(st + kSDo), sa = mma::smem_addr(st + kSA);
  const uint32_t sp = mma::smem_addr(smem + kP);
  const float* gv = reinterpret_cast<const float*>(smem + kGv);

  // (1) dS^T in bf16: the A fragments of U = dS^T K^T, and the dS tape (this warp's 16
  //     rows v of [v][k], staged with stmatrix, 16-byte stores of whole 256-byte rows).
  uint32_t sfrag[8][4];
  mma::to_a_frags(sfrag, s);
  if constexpr (kTapes) {
    unsigned char* stage = smem + kStS + warp * kStSWarp;
    const uint32_t sst = mma::smem_addr(stage);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) mma::stmatrix_x4(sst + swz16(8 * (mi & 1) + r8, 2 * ks + (mi >> 1)), sfrag[ks]);
    __syncwarp();
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.dS) + ((slot * p.HV + hv) * kD + 16 * warp) * kD;
#pragma unroll
    for (int it = 0; it < 8; ++it) {
      const int idx = lane + 32 * it, r = idx >> 4, ch = idx & 15;
      const uint4 v = *reinterpret_cast<const uint4*>(stage + swz16(r, ch));
      mma::st_global_16(out + r * kD + ch * 8, v);
    }
  }

  // (2) U = dS^T K^T (16 x 64): B[k][j] = K[j][k], rows j of the K tile (ldmatrix).
  float u[32];
  mma_16x64<false>(u, sfrag,
                   [&](int ks, int jp) { return sk + swz16(16 * jp + 8 * (mi >> 1) + r8, 2 * ks + (mi & 1)); });

  // (3) dv_new^T = U diag(tail) + do^T P. do^T fragments: ldmatrix.trans of the do tile
  //     (rows = tokens i = k of the product, columns = this warp's v); B[i][j] = P[i][j]
  //     by ldmatrix.trans of the P tile.
  uint32_t dofrag[4][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    mma::ldmatrix_x4_trans(dofrag[ks], sdo + swz16(16 * ks + 8 * (mi >> 1) + r8, 2 * warp + (mi & 1)));
  mma::scale_columns(u, gv + kGvTail, t4);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
    for (int jp = 0; jp <= ks; ++jp) {  // P's 16 x 16 block (ks, jp) is zero for jp > ks (not even stored)
      uint32_t b[4];
      mma::ldmatrix_x4_trans(b, sp + swz8(16 * ks + 8 * (mi & 1) + r8, 2 * jp + (mi >> 1)));
      mma4(u + 8 * jp, dofrag[ks], b[0], b[1]);
      mma4(u + 8 * jp + 4, dofrag[ks], b[2], b[3]);
    }
  }

  // (4) dv_new^T in bf16 (tokens past the end are 0: zero rows of k and P, tail = 0):
  //     the A fragments of X, and dv_new ([t][v]: stmatrix.trans into this warp's two
  //     16-byte columns of the staging tile, then the real rows x 32 bytes).
  uint32_t dvfrag[4][4];
  mma::to_a_frags(dvfrag, u);
  if constexpr (kTapes) {
    const uint32_t sv = mma::smem_addr(smem + kStV);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      mma::stmatrix_x4_trans(sv + swz16(16 * ks + 8 * (mi >> 1) + r8, 2 * warp + (mi & 1)), dvfrag[ks]);
    __syncwarp();
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.dv_new) + (t0 * p.HV_stride + hv) * kD;
    uint4 v[4];
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int row = 16 * it + (lane >> 1);
      v[it] = *reinterpret_cast<const uint4*>(smem + kStV + swz16(row, 2 * warp + (lane & 1)));
    }
#pragma unroll
    for (int it = 0; it < 4; ++it) {  // the document's tokens only: the rows after them are the next one's
      const int row = 16 * it + (lane >> 1);
      mma::st_global_16_if(row < len, out + row * p.HV_stride * kD + 16 * warp + 8 * (lane & 1), v[it]);
    }
  }

  // (5) X = (dv_new^T a) diag(decay) (16 x 64): B[j][m] = a[j][m], ldmatrix.trans of the a tile.
  float x[32];
  mma_16x64<true>(x, dvfrag,
                  [&](int ks, int np) { return sa + swz8(16 * ks + 8 * (mi & 1) + r8, 2 * np + (mi >> 1)); });
  mma::scale_columns(x, gv + kGvDecay, t4);
  uint32_t xfrag[4][4];
  mma::to_a_frags(xfrag, x);

  // (6) do^T diag(outq): the do^T fragments scaled per token (fp32, rounded once more).
  //     Register r of dofrag[ks] holds tokens 16 ks + 8 (r >> 1) + 2 t4 (+1).
  mma::scale_token_frags(dofrag, gv + kGvOutQ, t4);

  // (7) dS^T = e^gl dS^T + (do^T diag(outq)) Q + X K: B[i][k] = Q[i][k] (K[m][k]),
  //     ldmatrix.trans of the Q (K) tile.
  const float gamma = gv[kGvGamma];
#pragma unroll
  for (int i = 0; i < 64; ++i) s[i] *= gamma;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
    for (int np = 0; np < 8; ++np) {
      uint32_t b[4];
      const int off = swz16(16 * ks + 8 * (mi & 1) + r8, 2 * np + (mi >> 1));
      mma::ldmatrix_x4_trans(b, sq + off);
      mma4(s + 8 * np, dofrag[ks], b[0], b[1]);
      mma4(s + 8 * np + 4, dofrag[ks], b[2], b[3]);
      mma::ldmatrix_x4_trans(b, sk + off);
      mma4(s + 8 * np, xfrag[ks], b[0], b[1]);
      mma4(s + 8 * np + 4, xfrag[ks], b[2], b[3]);
    }
  }
}

// The reverse walk over chunks c0 .. c1 - 1 of a document (local indices), from the last
// to the first, with s the gradient at chunk c1 - 1's end (in the register layout above);
// leaves s the gradient at chunk c0's start; writes the tapes if kTapes; reads do if
// with_do (else its terms are 0). Every thread of the CTA calls it alike.
template <bool kTapes>
__device__ __forceinline__ void walk_chunks(const GdnBwdWalkArgs& p, unsigned char* smem, const DocPos& d, int c0,
                                            int c1, int hv, int h, float (&s)[64], bool with_do) {
  const float log2_scale = log2f(p.scale);
  if (c1 > c0) issue_chunk(p, smem + ((c1 - 1) & 1) * kStageBytes, d, c1 - 1, hv, h, with_do);
  mma::cp_async_commit();
  for (int c = c1 - 1; c >= c0; --c) {
    unsigned char* st = smem + (c & 1) * kStageBytes;
    if (c > c0) {  // chunk c - 1 into the other stage (freed by the barrier that ended chunk c + 1)
      issue_chunk(p, smem + ((c - 1) & 1) * kStageBytes, d, c - 1, hv, h, with_do);
      mma::cp_async_commit();
      cp_async_wait_1();
    } else {
      mma::cp_async_wait_all();
    }
    __syncthreads();  // chunk c has landed (every thread's copies)
    const int64_t t0 = d.start + static_cast<int64_t>(c) * kC;
    const int len = d.end - t0 < kC ? static_cast<int>(d.end - t0) : kC;
    form_chunk(st, smem, len, log2_scale);
    __syncthreads();  // P and the gate vectors are in
    chain_chunk<kTapes>(p, st, smem, s, d.first_slot + c, hv, t0, len);
    __syncthreads();  // the stage, P, gate vectors and staging are free again
  }
}

// The register layout's element (v, k) is dS[k][v]: s[4 nt + e] holds v = 16 warp + gid +
// 8 (e >> 1), k = 8 nt + 2 t4 + (e & 1). A K x V matrix X as that layout, from and to
// memory as X[k][v] (kByK) or, for a transfer, as X^T[v][k] (stored so that the chain's
// thread k reads a row of X with coalesced loads, as fwd_chain.cu reads M^T).
struct StateLayout {
  int v, t4;
  __device__ StateLayout() : v(16 * (threadIdx.x >> 5) + ((threadIdx.x & 31) >> 2)), t4(threadIdx.x & 3) {}
  __device__ int64_t index(int nt, int e, bool by_k) const {
    const int kd = 8 * nt + 2 * t4 + (e & 1), vv = v + 8 * (e >> 1);
    return by_k ? static_cast<int64_t>(kd) * kD + vv : static_cast<int64_t>(vv) * kD + kd;
  }
};

__device__ __forceinline__ void load_state(float (&s)[64], const float* src) {  // nullptr: zeros
  const StateLayout l;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[4 * nt + e] = src != nullptr ? src[l.index(nt, e, true)] : 0.f;
}

__device__ __forceinline__ void store_state(const float (&s)[64], float* dst, bool by_k) {
  const StateLayout l;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dst[l.index(nt, e, by_k)] = s[4 * nt + e];
}

// Unit norms (no qk_lrn): log2 1 = 0 in both stages, never loaded.
__device__ __forceinline__ void zero_norms(const GdnBwdWalkArgs& p, unsigned char* smem) {
  if (p.qk_lrn != nullptr) return;
  for (int i = threadIdx.x; i < 2 * 2 * kC; i += kThreads)
    reinterpret_cast<float*>(smem + (i >> 7) * kStageBytes + kSL)[i & 127] = 0.f;
}

// Per (cut, value head, part): the summary of the segment after the cut (bwd_walk.h).
// Part 0 walks F (over the truncation window, or the whole segment where the cut is
// exact) and marks the cut; part 1 walks the transfer M^T where the cut is exact and
// returns where it is not. Both take the same window test, so an exact cut's two walks of
// the segment run side by side, on two SMs.
__global__ void __launch_bounds__(kThreads, 1) gdn_bwd_walk_summary_kernel(const GdnBwdWalkArgs p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int HV = static_cast<int>(p.HV);
  const bool transfer = blockIdx.x & 1;
  const int64_t i = (blockIdx.x >> 1) / HV;  // the inner segment before the cut
  const int hv = static_cast<int>((blockIdx.x >> 1) % HV);
  if (i >= p.seg_offsets[p.N] - p.N) return;
  const int h = hv / (HV / static_cast<int>(p.H));
  const CuSeqlens cu{p.cu_seqlens, p.cu_int64};
  const int64_t slot = inner_segment_slot(p.seg_offsets, p.N, i);
  const SegmentPos sp = find_segment(p.seg_offsets, cu, p.N, p.seg_chunks, p.seg_long_max, slot + 1);
  const DocPos d{sp.doc_start, sp.doc_end, p.chunk_offsets[sp.doc]};
  const int64_t mat = (i * p.HV + hv) * kD * kD;
  const int window = window_chunks(p.chunk_decay + (d.first_slot + sp.c0) * p.HV + hv, p.HV, sp.nch);
  if (transfer && window > 0) return;  // a truncated cut needs no transfer
  zero_norms(p, smem);
  float s[64];
  if (!transfer) {
    load_state(s, nullptr);
    walk_chunks<false>(p, smem, d, sp.c0, sp.c0 + (window > 0 ? window : sp.nch), hv, h, s, true);
    store_state(s, p.seg_grad + mat, true);
    if (threadIdx.x == 0) p.seg_exact[i * p.HV + hv] = window > 0 ? 0 : 1;
    return;
  }
  // The transfer: the segment walked from the identity without its outputs.
  const StateLayout l;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[4 * nt + e] = 8 * nt + 2 * l.t4 + (e & 1) == l.v + 8 * (e >> 1) ? 1.f : 0.f;
  walk_chunks<false>(p, smem, d, sp.c0, sp.c0 + sp.nch, hv, h, s, false);
  store_state(s, p.seg_transfer + mat, false);
}

constexpr int kChainCols = 16;                     // value columns per chain CTA: four float4
constexpr int kChainTiles = kD / kChainCols;       // chain CTAs per (document, value head)

// Per (document with cuts, value head, 16 value columns), from its last segment down:
// seg_grad[cut after s] <- dS_end(s) (bwd_walk.h). Launched per inner segment; the CTAs
// of a document's last inner segment run its chain, the others return.
__global__ void __launch_bounds__(kD) gdn_bwd_chain_kernel(const GdnBwdWalkArgs p) {
  constexpr int kQuads = kChainCols / 4;
  __shared__ float4 tile[kD][kQuads];  // dS_end(s + 1) restricted to the CTA's columns
  const int64_t i = blockIdx.x / (p.HV * kChainTiles);
  if (i >= p.seg_offsets[p.N] - p.N) return;
  const int64_t hv = blockIdx.x / kChainTiles % p.HV;
  const int col = static_cast<int>(blockIdx.x % kChainTiles) * kChainCols;
  const int64_t slot = inner_segment_slot(p.seg_offsets, p.N, i);
  const int64_t n = slot - i;  // documents before n have seg_offsets[n] - n inner segments
  const int32_t first = p.seg_offsets[n];
  const int nseg = p.seg_offsets[n + 1] - first;
  if (slot != first + nseg - 2) return;  // not the document's last inner segment

  constexpr int64_t kMat = kD * kD;
  const int k = threadIdx.x;
  const int64_t inner0 = first - n;  // segment 0's inner index
  {
    const float4* e = reinterpret_cast<const float4*>(p.dht + (n * p.HV_stride + hv) * kMat + k * kD + col);
#pragma unroll
    for (int q = 0; q < kQuads; ++q) tile[k][q] = p.dht != nullptr ? e[q] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  for (int s = nseg - 2; s >= 0; --s) {
    const int64_t at = (inner0 + s) * p.HV + hv;
    float4* g = reinterpret_cast<float4*>(p.seg_grad + at * kMat + k * kD + col);
    float4 acc[kQuads];
#pragma unroll
    for (int q = 0; q < kQuads; ++q) acc[q] = g[q];
    if (p.seg_exact[at]) {  // the same flag for the whole CTA
      const float* mt = p.seg_transfer + at * kMat + k;  // row k of M^T's matrix, element j at mt[j D]
      float mrow[kD];
#pragma unroll
      for (int j = 0; j < kD; ++j) mrow[j] = mt[j * kD];
      __syncthreads();  // the tile holds dS_end(s + 1)
#pragma unroll
      for (int j = 0; j < kD; ++j) {
#pragma unroll
        for (int q = 0; q < kQuads; ++q) {
          const float4 t = tile[j][q];
          acc[q].x = fmaf(mrow[j], t.x, acc[q].x);
          acc[q].y = fmaf(mrow[j], t.y, acc[q].y);
          acc[q].z = fmaf(mrow[j], t.z, acc[q].z);
          acc[q].w = fmaf(mrow[j], t.w, acc[q].w);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kQuads; ++q) g[q] = acc[q];
    __syncthreads();  // every thread has read dS_end(s + 1)
#pragma unroll
    for (int q = 0; q < kQuads; ++q) tile[k][q] = acc[q];
  }
}

// Per (segment, value head): the tapes of the segment's chunks, from its end gradient
// (dht at a document's last segment, else the chained seg_grad); segment 0 writes dh0.
__global__ void __launch_bounds__(kThreads, 1) gdn_bwd_walk_kernel(const GdnBwdWalkArgs p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int HV = static_cast<int>(p.HV);
  const int64_t slot = blockIdx.x / HV;
  const int hv = static_cast<int>(blockIdx.x % HV);
  const int h = hv / (HV / static_cast<int>(p.H));
  const CuSeqlens cu{p.cu_seqlens, p.cu_int64};
  SegmentPos sp;
  if (p.seg_offsets != nullptr) {
    if (slot >= p.seg_offsets[p.N]) return;
    sp = find_segment(p.seg_offsets, cu, p.N, p.seg_chunks, p.seg_long_max, slot);
  } else {  // uncut: the document's whole walk
    sp.doc = slot;
    sp.seg = 0;
    sp.nseg = 1;
    sp.doc_start = cu[slot];
    sp.doc_end = cu[slot + 1];
    sp.c0 = 0;
    sp.nch = p.chunk_offsets[slot + 1] - p.chunk_offsets[slot];
  }
  const DocPos d{sp.doc_start, sp.doc_end, p.chunk_offsets[sp.doc]};
  zero_norms(p, smem);

  float s[64];
  const int64_t state = (sp.doc * p.HV_stride + hv) * kD * kD;  // dht, dh0
  if (sp.seg + 1 == sp.nseg) load_state(s, p.dht != nullptr ? p.dht + state : nullptr);
  else load_state(s, p.seg_grad + ((slot - sp.doc) * p.HV + hv) * kD * kD);  // the cut after it: inner index slot - doc

  walk_chunks<true>(p, smem, d, sp.c0, sp.c0 + sp.nch, hv, h, s, true);

  if (sp.seg == 0) store_state(s, p.dh0 + state, true);
}

}  // namespace

cudaError_t gdn_bwd_walk_launch(const GdnBwdWalkArgs& p, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  cudaError_t err = cudaFuncSetAttribute(gdn_bwd_walk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  const bool cut = p.seg_offsets != nullptr && p.inner_slots > 0;
  if (cut) {
    if (p.wgmma_walk) {
      err = gdn_bwd_reverse_summary_launch(p, stream);
    } else {
      err = cudaFuncSetAttribute(gdn_bwd_walk_summary_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 kSmemBytes);
      if (err == cudaSuccess)
        gdn_bwd_walk_summary_kernel<<<static_cast<unsigned>(2 * p.inner_slots * p.HV), kThreads, kSmemBytes,
                                      stream>>>(p);
    }
    if (err != cudaSuccess) return err;
    gdn_bwd_chain_kernel<<<static_cast<unsigned>(p.inner_slots * p.HV * kChainTiles), kD, 0, stream>>>(p);
  }
  if (p.wgmma_walk) return gdn_bwd_reverse_walk_launch(p, stream);
  const int64_t segments = p.seg_offsets != nullptr ? p.segment_slots : p.N;
  gdn_bwd_walk_kernel<<<static_cast<unsigned>(segments * p.HV), kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cake

// Chunk-local gradients of the GDN backward ("B3", bwd_local.h): per (chunk slot, q/k
// head) and each of its G value heads, cake_ops/pytorch/gdn.py local_gradients on the
// tapes of the two walks. Notation (docs/math.md, Chunked form), C = 64 tokens, K = V = 128,
// D_ij = e^(gcum_i - gcum_j) (i >= j, else 0), eg = e^gcum, dte = e^(gl - gcum):
//
//   v_new = A diag(beta) (v - diag(eg) k S)          (formed again from the S^T tape)
//   dq_gated = do S^T (the tape holds S^T: do @ h)   dq += scale eg dq_gated
//   dP = do v_new^T,  P = scale (q k^T o D),  dPs = scale dP o D
//   dq += dPs k,  dk += dPs^T q,  dk_decayed = v_new dS^T,  dk += dte dk_decayed
//   dw = -dv_new S^T,  dA = (dw k^T) diag(beta eg) + (dv_new v^T) diag(beta)
//   dXw = A^T dw,  dXu = A^T dv_new,  dL = -(A^T dA A^T).tril(-1)
//   dkk = dL o beta_i D,  dk += (dkk + dkk^T) k + beta eg dXw,  dv = beta dXu
//   dbeta = rowsum(dL o D o kk) + eg (dXw . k) + (dXu . v)
//   dgcum = scale eg (dq_gated . q) + rowsum - colsum of (dP o P) and of (dL o D o kk beta_i)
//           - dte (dk_decayed . k) + beta eg (dXw . k),  + dgl at the chunk's last token,
//   dgl = sum_i dte_i (dk_decayed . k)_i + e^gl sum(dS o S);  dg = reverse cumsum of dgcum
// then dq, dk summed over the value heads j = 0 .. G-1 in order (in registers) and taken
// through the L2 norm's backward when use_qk_l2norm.
//
// Why it is as it is:
// - One CTA of 8 warps per (slot, q/k head): q, k (normalised once into bf16 in shared
//   memory) are shared by the G value heads, and dq, dk accumulate over the group in
//   registers in a fixed order: no atomics, no partial buffers. q k^T and k k^T are formed
//   again per value head: holding them across the loop would take 32 registers more.
// - dPs and dkk enter dq and dk only through products with q and k, which are the same
//   for every value head of the group: so they are summed over the group in fp32
//   registers, and those four products (dq += dPs k, dk += dPs^T q + dkk k + dkk^T k, 4.2
//   MFLOP) run once a CTA after the head loop instead of once a value head (docs/kernels.md,
//   "Backward"). The sums are rounded to bf16 once, where each head's dPs and dkk were.
// - Warp w = (rb = w & 3, ch = w >> 2) owns rows 16 rb .. 16 rb + 15 of every chunk-row
//   product, columns 64 ch .. of the 64x128 ones (dq, dk, dw, dXw, dXu, ...) and 32 ch .. of
//   the 64x64 ones (dP, dA, dL, q k^T, k k^T): the same rows in both, so row quantities
//   (gates, row sums) line up, and the 64x64 tiles' elementwise work stays in registers.
// - Every bf16 product is a wgmma of its warpgroup (ch) on operands in shared memory:
//   m64n64 for the 64x128 products (its 64 columns), m64n32 for the 64x64 ones, full K
//   (the triangular operands A, dPs, dkk hold zeros above the diagonal). Its accumulator
//   rows are warp rb's 16, so the elementwise code reads them as the mma.sync fragments
//   they are, and moves such fragments to and from the tiles with ldmatrix / stmatrix.
//   The tiles, staged by TMA or stmatrix, are in the SW128 layout (swizzle.cuh),
//   which wgmma reads in both majors: the operand a product needs transposed (A^T, dPs^T,
//   dkk^T on the left; S^T, k, q, dw, dv_new on the right) is read MN-major. Padding
//   tokens are zero-filled, so they contribute 0.
// - dL = -(A^T dA A^T) is two 64x64x64 TF32 products (m16n8k8) on fp32 dA and A^T dA: dA
//   feeds dbeta and dg through A twice, and bf16 there would cost ~2^-8 of them; A is
//   bf16 already, so exact in TF32.
// - v_new is not a tape: two products a value head (k S, then A times beta (v - eg k S))
//   form it from the S^T tape, against 16 KB a chunk and value head the walk would write
//   and this kernel read (docs/kernels.md, "Backward"; its rounding: tools/gdn_bwd_tape_precision.py).
// - Shared memory (221 KB, one CTA an SM): q, k, do, v, v_new, dv_new (16 KB each), S^T,
//   dS^T (32 KB each), A (8 KB), dw / dv (16 KB, in turn), dA^T / A^T dA (fp32, 18 KB, in
//   turn) and row vectors (a block per head parity: a head's dg is formed during the next); after the head loop the group's dPs and dkk over A and dw. The
//   next value head's tiles but A (128 KB) and its gates are requested as soon as the
//   current head's first phases have read them, its A once the current head's dv is
//   stored: into where the current dw was (A and dw trade places from head to head), so it
//   lands under the second half of phase 2 while that still reads the current A (on the
//   last head: the raw q, k rows for the norm's backward).
// - Loads by TMA (common/tma_sm90.cuh), 11 boxes a value head on one mbarrier whose phase
//   flips per head (q and k on one of their own, so that their norm runs under the first
//   head's loads), issued by six warps (head_box_first), rows past a ragged chunk's end zeroed
//   after the wait: issued as per-thread cp.async they cost 7 % of the kernel's issue samples (their
//   address arithmetic, and stalls on the load queue; ncu, docs/experiments.md).
// - Exponents are differences of chunk-local cumsums, selected to 0 above the diagonal
//   (no inf, no NaN); row sums go through fixed shuffle trees and per-warp slots summed in
//   a fixed order: the same bits run to run, and a document's bits do not depend on its
//   neighbours.

#include <cuda_bf16.h>

#include "common/mma_sm80.cuh"
#include "common/scan.cuh"
#include "common/swizzle.cuh"
#include "common/tma_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "gdn/bwd_local.h"
#include "gdn/chunks.cuh"
#include "gdn/gdn.h"
#include "gdn/plan.h"

namespace cake {
namespace {

constexpr int kThreads = 256;
constexpr int C = kGdnChunk;
constexpr int D = kGdnHeadDim;
static_assert(C == 64 && D == 128, "the tiling below is for 64-token chunks and head dim 128");

// Shared memory (bytes): SW128 tiles, 1024-byte aligned.
constexpr int kRowTile = C * D * 2;  // 64 x 128 bf16
constexpr int kQ = 0;
constexpr int kK = kQ + kRowTile;
constexpr int kDo = kK + kRowTile;    // do; on the last head (use_qk_l2norm) the raw q rows
constexpr int kVn = kDo + kRowTile;   // E, then v_new (formed here); then the raw k rows
constexpr int kV = kVn + kRowTile;
constexpr int kDvn = kV + kRowTile;
constexpr int kHT = kDvn + kRowTile;  // S^T 128 x 128
constexpr int kDS = kHT + D * D * 2;  // dS^T 128 x 128
// A (64 x 64) and dw (then dv staging) share 24 KB, placed by the value head's parity j & 1
// (a_at, dw_at below), so that the next head's A lands where the current head's dw was
// while phase 2 still reads the current A.
constexpr int kATile = C * C * 2;
constexpr int kADw = kDS + D * D * 2;
constexpr int kFLd = 72;              // fp32 row stride of dA^T / A^T dA (conflict-free TF32 fragments)
constexpr int kDA = kADw + kATile + kRowTile;
constexpr int kVec = kDA + C * kFLd * 4;

// Where row j (a column of dA) of dA^T starts in the fp32 region: rows of kFLd floats, those
// with j & 4 moved on by 8 floats (row 63 still ends within C * kFLd). kFLd = 8 mod 32 makes
// phase 2's float2 loads (row jb + gid, columns mk + 2 t4: per half-warp rows gid 0..3 at 8
// gid + 2 t4) conflict-free, but would give phase 1b's scalar stores of dA^T (row j0 + 8 nt +
// 2 t4 + c, column m0 + gid + 8 v: rows t4 and t4 + 2 an equal bank, no stride serves both)
// two-way conflicts; the shift puts row j mod 8 at bank 8 ((j + (j >> 2 & 1)) mod 4) + col:
// distinct for j mod 8 = c, 2 + c, 4 + c, 6 + c (the stores) and for 0..3 and 4..7 (the loads).
__host__ __device__ constexpr int dat_row(int j) { return j * kFLd + ((j & 4) << 1); }
static_assert(kFLd % 32 == 8 && dat_row(C - 1) + C <= C * kFLd, "dA^T's rows fit the region, conflict-free");
// X = A^T dA written over it, rows i and i + 8 of each 16-row block interleaved: X[i][m] at
// xpos(i, m). A lane's accumulator quad of n-tile nt (rows i, i + 8, columns m, m + 1) is then
// one float4 {c0, c2, c1, c3}, and so is its A fragment {a0, a1, a2, a3} of phase 2's second
// product (HMMA takes a0 .. a3 in consecutive registers: two row-major float2 would need
// moves). Row pairs kXLd = 144 = 16 mod 32 floats apart: per quarter-warp (lanes gid 2q, 2q + 1,
// t4 0..3 at 16 (gid & 1) + 4 t4) conflict-free.
constexpr int kXLd = 2 * kFLd;
__host__ __device__ constexpr int xpos(int i, int m) { return ((i >> 4) * 8 + (i & 7)) * kXLd + 2 * m + ((i >> 3) & 1); }
static_assert(kXLd % 32 == 16 && xpos(C - 1, C - 1) < C * kFLd, "X's row pairs fit the region, conflict-free");
// Row vectors (floats), a block per value head parity (head j's at vec + (j & 1) *
// kHeadVecFloats): head j's dg is formed during head j + 1 (token_gradients), from its block.
constexpr int kVGl2 = 0;          // gcum log2(e)
constexpr int kVEg = kVGl2 + C;   // e^gcum
constexpr int kVDte = kVEg + C;   // e^(gl - gcum)
constexpr int kVBeta = kVDte + C;
constexpr int kVFloor = kVBeta + C;  // 1: g < kGdnGateFloor
constexpr int kVRowA = kVFloor + C;    // [2][64] partial row sums per column half ch
constexpr int kVRowT = kVRowA + 2 * C;
constexpr int kVRowP = kVRowT + 2 * C;
constexpr int kVRowL = kVRowP + 2 * C;
constexpr int kVRowB = kVRowL + 2 * C;
constexpr int kVRowXw = kVRowB + 2 * C;
constexpr int kVRowXu = kVRowXw + 2 * C;
constexpr int kVColP = kVRowXu + 2 * C;  // [4][64] partial column sums per row block rb
constexpr int kVColL = kVColP + 4 * C;
constexpr int kVDot = kVColL + 4 * C;    // [8] per warp: sum(dS^T o S^T)
constexpr int kVGamma = kVDot + 8;
constexpr int kHeadVecFloats = kVGamma + 8;
// The group's: 1 / |q|, 1 / |k| per row.
constexpr int kVRq = 2 * kHeadVecFloats;
constexpr int kVRk = kVRq + C;
constexpr int kVecFloats = kVRk + C;
constexpr int kBar = kVec + kVecFloats * 4;  // the value heads' loads' mbarrier (8 bytes)
constexpr int kBarQK = kBar + 8;             // q's and k's
constexpr int kSmemBytes = kBarQK + 8;
static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA an SM");
static_assert(kK % 1024 == 0 && kDo % 1024 == 0 && kVn % 1024 == 0 && kV % 1024 == 0 && kDvn % 1024 == 0 &&
                  kHT % 1024 == 0 && kDS % 1024 == 0 && kADw % 1024 == 0 && kATile % 1024 == 0,
              "SW128 tiles start 1024-byte aligned");
static_assert(kDA % 16 == 0 && kVec % 16 == 0 && kBar % 8 == 0 && kBarQK % 8 == 0, "aligned regions");

// Bytes the TMA loads bring: a value head's tiles but A; A; q and k (or their raw rows).
constexpr uint32_t kHeadBytes = 3 * kRowTile + 2 * D * D * 2;
constexpr uint32_t kABytes = kATile;
constexpr uint32_t kQKBytes = 2 * kRowTile;

// Head j's A and dw: even heads A, then dw; odd heads dw, then A (the last 8 KB).
__device__ __forceinline__ int a_at(int j) { return kADw + (j & 1) * 2 * kATile; }
__device__ __forceinline__ int dw_at(int j) { return kADw + (~j & 1) * kATile; }

// Where the dynamic shared memory starts in the CTA's shared window (modulo the 256 KB a
// descriptor addresses): ptxas places it after the 1 KB that sm_90 reserves, and the
// kernel checks it at its start. Known at compile time, the left operands' descriptors are
// immediates (uniform registers without R2UR), and a right operand's is one add of its
// warpgroup's column block: formed from the runtime base, ptxas kept the base in a vector
// register and moved both descriptors of every wgmma to uniform registers (four R2UR).
// (A copy of the head loop per warpgroup made every descriptor an immediate, but twice the
// code ran 1.5x slower: docs/experiments.md.)
constexpr uint32_t kSmemWindow = 0x400;

// Step-0 descriptors (wgmma_sm90.cuh) of the tile at byte offset `off`: K-major from row
// `row` (M or N); MN-major of `rows` K-rows from column block `block`.
__host__ __device__ constexpr uint64_t desc_k(int off, int row = 0) { return wgmma::desc_k_major(kSmemWindow + off + row * 128); }
__host__ __device__ constexpr uint64_t desc_mn(int off, int rows, int block = 0) {
  return wgmma::desc_mn_major(kSmemWindow + off + block * rows * 128, rows);
}
// Head j's A and dw tiles: the descriptor of head 0's advanced by the parity's offset.
__device__ __forceinline__ uint64_t at_parity(uint64_t d0, int j, int delta_bytes) {
  return wgmma::desc_add(d0, static_cast<uint32_t>((j & 1) * (delta_bytes / 16)));  // two's complement: no borrow
}

// x as a value the compiler cannot move out of a loop: what is formed from it is formed
// again where it is used, rather than held in registers across the head loop (at 255
// registers, hoisted addresses and descriptors spill).
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}

__device__ __forceinline__ int opaque_tid() { return static_cast<int>(opaque(threadIdx.x)); }

// A warp's bf16 pairs of a 64-row SW128 tile in the accumulator-fragment layout: frag[nt][v]
// is the pair (low, high half) at row m0 + gid + 8 v, columns c0 + 8 nt + 2 t4 (+ 1), c0 a
// multiple of 8 NT (n0, j0). ldmatrix / stmatrix x4 (not transposed) give each lane exactly
// these pairs of four 8x8 matrices: one x4 moves the 16 x 16 block of nt = 2 b, 2 b + 1, for
// 4 LDS / STS of 32 bits with a swizzled address each. Lane l gives row l & 7 of matrix l >> 3,
// that is row m0 + (l & 15) of 16-byte chunk c0 / 8 + 2 b + (l >> 4); register mi is then
// frag[2 b + (mi >> 1)][mi & 1]. The blocks share a 128-byte line and c0 / 8 % 8 (a multiple
// of NT) has no bit in common with 2 b < NT, so block b's swizzled chunk is block 0's xor 2 b,
// its address block 0's xor 32 b (the tile 1024-byte aligned). Block 0's address is formed at
// each call (opaque_tid).
__device__ __forceinline__ uint32_t frag_addr(const unsigned char* tile, int m0, int c0) {
  const int lane = opaque_tid() & 31;
  return mma::smem_addr(tile + sw128_offset(C, m0 + (lane & 15), (c0 >> 3) + (lane >> 4)));
}

template <int NT>
__device__ __forceinline__ void ld_frag(uint32_t (&frag)[NT][2], const unsigned char* tile, int m0, int c0) {
  const uint32_t addr = frag_addr(tile, m0, c0);
#pragma unroll
  for (int b = 0; b < NT / 2; ++b) {
    uint32_t r[4];
    mma::ldmatrix_x4(r, addr ^ (32 * b));
    frag[2 * b][0] = r[0];
    frag[2 * b][1] = r[1];
    frag[2 * b + 1][0] = r[2];
    frag[2 * b + 1][1] = r[3];
  }
}

template <int NT>
__device__ __forceinline__ void st_frag(unsigned char* tile, int m0, int c0, const uint32_t (&frag)[NT][2]) {
  const uint32_t addr = frag_addr(tile, m0, c0);
#pragma unroll
  for (int b = 0; b < NT / 2; ++b) {
    const uint32_t r[4] = {frag[2 * b][0], frag[2 * b][1], frag[2 * b + 1][0], frag[2 * b + 1][1]};
    mma::stmatrix_x4(addr ^ (32 * b), r);
  }
}

// One bf16 of an SW128 tile of ROWS rows as the bits of an fp32 (exact, hence a TF32
// operand as it is).
template <int ROWS>
__device__ __forceinline__ uint32_t ld_bf16_bits(const unsigned char* tile, int row, int col) {
  const uint32_t w = *reinterpret_cast<const uint16_t*>(tile + sw128_offset(ROWS, row, col >> 3) + (col & 7) * 2);
  return w << 16;
}

// x rounded to TF32 (cvt.rna), as an fp32: stored so, a TF32 operand needs no conversion
// where it is read (each element is read by several warps), with the same bits.
__device__ __forceinline__ float round_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}

// acc (+)= L R, this warpgroup's share: rows 0 .. 63 (warp rb's 16 in its fragments, as an
// mma.sync m16n8 tile per 8 columns), NT * 8 columns; L and R in shared memory through the
// step-0 descriptors da, db of SW128 tiles (k16 step s adds a constant: 64-row K-major
// tiles, R's of kRowsB rows, or kTransA / kTransB = 1 for an operand stored MN-major), kSteps steps;
// overwrite: acc's old values are dropped. It only issues (wgmma::commit closes a group,
// wg_wait waits for it), so the next product runs under this one's elementwise work.
template <int kSteps, int kTransA, int kTransB, int NT, int kRowsB = C>
__device__ __forceinline__ void wg_issue(float (&acc)[NT][4], uint64_t da, uint64_t db, bool overwrite) {
  static_assert(NT == 4 || NT == 8, "m64n32 or m64n64");
  float(&d)[NT * 4] = reinterpret_cast<float(&)[NT * 4]>(acc);
  wgmma::fence();
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int accumulate = overwrite && s == 0 ? 0 : 1;
    const uint64_t a = wgmma::desc_add(da, kTransA ? wgmma::mn_major_step(s) : wgmma::k_major_step(C, s));
    const uint64_t b = wgmma::desc_add(db, kTransB ? wgmma::mn_major_step(s) : wgmma::k_major_step(kRowsB, s));
    if constexpr (NT == 8) wgmma::mma_ss_m64n64k16<kTransA, kTransB>(d, a, b, accumulate);
    else wgmma::mma_ss_m64n32k16<kTransA, kTransB>(d, a, b, accumulate);
  }
}

// acc's product is complete (a wait has covered its group): its registers may be read.
template <int NT>
__device__ __forceinline__ void wg_done(float (&acc)[NT][4]) {
  wgmma::fence_operands(reinterpret_cast<float(&)[NT * 4]>(acc));
}

// Waits until at most kPending of the committed products are still running, acc's not
// among them (the products commit in order).
template <int kPending, int NT>
__device__ __forceinline__ void wg_wait(float (&acc)[NT][4]) {
  wgmma::wait<kPending>();
  wg_done(acc);
}

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
}

// Row sums of this warp's 16 rows (rs[v]: row m0 + gid + 8 v, this lane's columns) to
// dst[row]: the 4 lanes of a row, xor 1 then 2.
__device__ __forceinline__ void store_row_sums(float (&rs)[2], float* dst, int m0, int lane) {
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    rs[v] += __shfl_xor_sync(0xffffffffu, rs[v], 1);
    rs[v] += __shfl_xor_sync(0xffffffffu, rs[v], 2);
  }
  if ((lane & 3) == 0) {
    dst[m0 + (lane >> 2)] = rs[0];
    dst[m0 + (lane >> 2) + 8] = rs[1];
  }
}

// d += f(i) acc on this warp's rows i = m0 + gid + 8 v (columns n0.., 16-chunk tile x alongside), and
// rs[v] = the row's dot acc . x over this lane's columns, times f(i) if kScaleDot.
template <bool kScaleDot, class RowScale>
__device__ __forceinline__ void add_scaled_rows(float (&d)[8][4], const float (&acc)[8][4], const unsigned char* x,
                                                RowScale f, float (&rs)[2], int m0, int n0, int lane) {
  uint32_t xf[8][2];
  ld_frag(xf, x, m0, n0);
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    const int i = m0 + (lane >> 2) + 8 * v;
    const float fi = f(i);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const float2 xp = mma::unpack_bf16(xf[nt][v]);
      rs[v] = fmaf(acc[nt][2 * v], xp.x, fmaf(acc[nt][2 * v + 1], xp.y, rs[v]));
      d[nt][2 * v] = fmaf(fi, acc[nt][2 * v], d[nt][2 * v]);
      d[nt][2 * v + 1] = fmaf(fi, acc[nt][2 * v + 1], d[nt][2 * v + 1]);
    }
    if constexpr (kScaleDot) rs[v] *= fi;
  }
}

// Column sums over this warp's 16 rows (cs[nt][c]: column n0 + 8 nt + 2 t4 + c) to
// dst[column]: the 8 lanes of a column, xor 4, 8, 16.
template <int NT>
__device__ __forceinline__ void store_col_sums(float (&cs)[NT][2], float* dst, int n0, int lane) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float x = cs[n][c];
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      x += __shfl_xor_sync(0xffffffffu, x, 16);
      cs[n][c] = x;
    }
  if (lane < 4) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      dst[n0 + 8 * n + 2 * lane] = cs[n][0];
      dst[n0 + 8 * n + 2 * lane + 1] = cs[n][1];
    }
  }
}

// Rows r < valid of an SW128 64 x 128 bf16 tile to base + r * stride, 16-byte stores.
__device__ __forceinline__ void store_tile(const unsigned char* tile, __nv_bfloat16* base, int64_t stride, int valid) {
  constexpr int kPassRows = kThreads / 16;
  const int tid = opaque_tid();
  const int r0 = tid >> 4, c = tid & 15;
  const unsigned char* src = tile + sw128_offset(C, r0, c);
  __nv_bfloat16* dst = base + r0 * stride + c * 8;
#pragma unroll
  for (int it = 0; it < C / kPassRows; ++it)
    if (r0 + it * kPassRows < valid)
      mma::st_global_16(dst + it * kPassRows * stride, *reinterpret_cast<const uint4*>(src + it * kPassRows * 128));
}

// The tensor maps of the loads (encoded by the launch, bwd_local_maps): the [T, heads, 128]
// inputs as (column, head, token) with 64 x 64 boxes, the tapes as (column, row, tile) with
// boxes of one column block of a tile. Rows past T arrive as zeros.
struct BwdLocalMaps {
  CUtensorMap q, k, dout, v, dv_new, h, ds, a;
};

// One thread's TMA loads of a kRows x 128 tile at `dst` (two 64-column boxes) at the map's
// coordinates (c1, c2): (head, first token) of a [T, heads, 128] tensor, (0, tile) of a tape.
template <int kRows = C>
__device__ __forceinline__ void tma_tile(uint32_t dst, const CUtensorMap* map, int c1, int c2, uint32_t bar) {
  tma::load_box_3d(dst, map, 0, c1, c2, bar);
  tma::load_box_3d(dst + kRows * 128, map, 64, c1, c2, bar);
}

// Box b (0 .. 9) of a value head's tiles but A (do, S^T, dS^T, v, dv_new, two column boxes
// each), onto `bar`: value head hv's rows from token t0, and its tapes' tile `tape`.
constexpr int kHeadBoxes = 10;
__device__ __forceinline__ void load_head_box(const BwdLocalMaps& m, uint32_t s, uint32_t bar, int tape, int hv, int t0,
                                              int b) {
  const int c0 = 64 * (b & 1);
  switch (b >> 1) {
    case 0: tma::load_box_3d(s + kDo + (b & 1) * C * 128, &m.dout, c0, hv, t0, bar); break;
    case 1: tma::load_box_3d(s + kHT + (b & 1) * D * 128, &m.h, c0, 0, tape, bar); break;
    case 2: tma::load_box_3d(s + kDS + (b & 1) * D * 128, &m.ds, c0, 0, tape, bar); break;
    case 3: tma::load_box_3d(s + kV + (b & 1) * C * 128, &m.v, c0, hv, t0, bar); break;
    default: tma::load_box_3d(s + kDvn + (b & 1) * C * 128, &m.dv_new, c0, hv, t0, bar); break;
  }
}

// The boxes [first, last) of a value head that warp w issues (lane 0), under phase 2's X
// product: ten boxes issued by one thread held its warp, and with it every warp at the next
// barrier. They go to the warps of rows 32 .. 63 (rb 2, 3), whose share of X's triangle is
// the smallest. (With the dg work below: the kernel 3 % faster, docs/experiments.md.)
__host__ __device__ constexpr int head_box_first(int w) { return w == 3 ? 0 : w == 7 ? 3 : w == 2 ? 6 : w == 6 ? 8 : 0; }
__host__ __device__ constexpr int head_box_last(int w) { return w == 3 ? 3 : w == 7 ? 6 : w == 2 ? 8 : w == 6 ? 10 : 0; }
static_assert(head_box_first(3) == 0 && head_box_last(3) == head_box_first(7) && head_box_last(7) == head_box_first(2) &&
                  head_box_last(2) == head_box_first(6) && head_box_last(6) == kHeadBoxes,
              "the four warps issue every box of a value head once");

// A ragged chunk (its document's last): the rows r >= len of a 64 x 128 tile came from the
// next document (or are zeros past T); they are zeroed, so that no other document's values
// enter (they would meet only zero weights, but 0 * inf = NaN).
__device__ __forceinline__ void zero_rows(unsigned char* tile, int len) {
  for (int e = threadIdx.x; e < (C - len) * 16; e += kThreads)
    *reinterpret_cast<uint4*>(tile + sw128_offset(C, len + e / 16, e % 16)) = make_uint4(0u, 0u, 0u, 0u);
}

// Token i's gate inputs of a value head, read from global memory a head ahead (by the
// threads i < 64) as raw words and turned into the row vectors at the head's start: a
// compare or conversion right after the load would wait on it there.
struct TokenGates {
  float gcum, gl, g;
  uint32_t beta;  // the bf16's 16 bits, or the fp32's 32; 0 past the document's end
};

__device__ __forceinline__ TokenGates load_gates(const GdnBwdLocalArgs& p, int64_t slot, int64_t hv, int64_t t0,
                                                 int len, int i) {
  const float* gc = p.gcum + (slot * p.HV + hv) * C;
  const int64_t idx = (t0 + i) * p.HV_stride + hv;
  TokenGates t{gc[i], gc[C - 1], 0.f, 0u};
  if (i < len) {
    t.g = p.g[idx];
    t.beta = p.beta_dtype == DType::kBFloat16 ? static_cast<uint32_t>(static_cast<const uint16_t*>(p.beta)[idx])
                                              : static_cast<const uint32_t*>(p.beta)[idx];
  }
  return t;
}

// A value head's d gcum and dbeta per token from its row vectors and sums (hvec, the
// block of its parity), and dg = the reverse cumsum of d gcum, stored: by one warp (lane: its
// tokens lane, lane + 32), while another head's products keep the other warps busy.
__device__ __forceinline__ void token_gradients(const GdnBwdLocalArgs& p, const float* hvec, int64_t t0, int len,
                                                int64_t hv, int lane) {
  const float* eg = hvec + kVEg;
  const float* bet = hvec + kVBeta;
  float dgc[2], dbt[2], tsum = 0.f;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int i = lane + 32 * s;
    const bool real = i < len;
    const float xw = hvec[kVRowXw + i] + hvec[kVRowXw + C + i];
    const float tt = hvec[kVRowT + i] + hvec[kVRowT + C + i];
    const float colp = ((hvec[kVColP + i] + hvec[kVColP + C + i]) + hvec[kVColP + 2 * C + i]) + hvec[kVColP + 3 * C + i];
    const float coll = ((hvec[kVColL + i] + hvec[kVColL + C + i]) + hvec[kVColL + 2 * C + i]) + hvec[kVColL + 3 * C + i];
    float d = hvec[kVRowA + i] + hvec[kVRowA + C + i];
    d += (hvec[kVRowP + i] + hvec[kVRowP + C + i]) - colp;
    d -= tt;
    d += (hvec[kVRowL + i] + hvec[kVRowL + C + i]) - coll;
    d += bet[i] * eg[i] * xw;
    dgc[s] = real ? d : 0.f;
    dbt[s] = (hvec[kVRowB + i] + hvec[kVRowB + C + i]) + eg[i] * xw + (hvec[kVRowXu + i] + hvec[kVRowXu + C + i]);
    tsum += real ? tt : 0.f;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) tsum += __shfl_xor_sync(0xffffffffu, tsum, o);
  float dot = 0.f;
#pragma unroll
  for (int w = 0; w < 8; ++w) dot += hvec[kVDot + w];
  const float dgl = tsum + dot * hvec[kVGamma];
#pragma unroll
  for (int s = 0; s < 2; ++s)
    if (lane + 32 * s == len - 1) dgc[s] += dgl;
  // Suffix sums over the lanes, then the upper half's total onto the lower half's.
  warp_inclusive_scan</*kSuffix=*/true>(dgc);
  dgc[0] += __shfl_sync(0xffffffffu, dgc[1], 0);
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int i = lane + 32 * s;
    if (i < len) {
      const int64_t idx = (t0 + i) * p.HV_stride + hv;
      p.dg[idx] = hvec[kVFloor + i] != 0.f ? 0.f : dgc[s];
      if (p.beta_dtype == DType::kBFloat16) static_cast<__nv_bfloat16*>(p.dbeta)[idx] = __float2bfloat16(dbt[s]);
      else static_cast<float*>(p.dbeta)[idx] = dbt[s];
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    gdn_bwd_local_kernel(const GdnBwdLocalArgs p, const __grid_constant__ BwdLocalMaps maps) {
  extern __shared__ __align__(1024) unsigned char smem[];
  float* vec = reinterpret_cast<float*>(smem + kVec);

  const int H = static_cast<int>(p.H);
  const int slot = static_cast<int>(blockIdx.x / H);
  const int h = static_cast<int>(blockIdx.x % H);
  if (slot >= p.chunk_offsets[p.N]) return;  // an unused slot
  const CuSeqlens cu{p.cu_seqlens, p.cu_int64};
  const ChunkPos pos = find_chunk(p.chunk_offsets, cu, p.N, slot);
  const int t0 = static_cast<int>(pos.t0);  // int32 as the TMA coordinates (below)
  const int len = pos.len;
  const int64_t HV_row = p.HV_stride;  // of the [T, HV, *] tensors and the per-document states
  const int G = static_cast<int>(p.HV / p.H);
  const float scale = p.scale;
  // dg's term e^gl <dS_end, S> where a factor is an fp32 input (see the sum below).
  const uint8_t flags = p.doc_flags != nullptr ? p.doc_flags[pos.doc] : 0;
  const bool exact_h0 =
      p.initial_state != nullptr && slot == p.chunk_offsets[pos.doc] && !(flags & kGdnOpensInside);
  const bool exact_dht =
      p.dht != nullptr && slot == p.chunk_offsets[pos.doc + 1] - 1 && !(flags & kGdnClosesInside);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int rb = warp & 3, ch = warp >> 2;
  const int m0 = 16 * rb;  // this warp's rows
  const int n0 = 64 * ch;  // its columns of the 64 x 128 products
  const int j0 = 32 * ch;  // and of the 64 x 64 ones

  const uint32_t sBase = mma::smem_addr(smem), sQ = sBase + kQ, sK = sBase + kK;
  if (tid == 0 && (sBase & 0x3FFFF) != kSmemWindow) __trap();  // the descriptors' addresses (kSmemWindow)
  float* fA = reinterpret_cast<float*>(smem + kDA);

  // Prologue: q, k and the first value head's tiles and gates in flight, q and k on a
  // barrier of their own so that the norm runs under the head's loads.
  const int hv_first = h * G;
  // The value heads' mbarrier: one phase a head (parity j & 1), thread 0 announcing the
  // phase's bytes; after the last head, phase G brings the raw q, k rows.
  const uint32_t bar = sBase + kBar, bar_qk = sBase + kBarQK;
  // TMA coordinates (int32: T and the tape's tiles are below 2^31): the chunk's first token
  // t0, a value head's tile of the tapes.
  const auto tape_of = [&](int64_t hv) { return static_cast<int>(slot * p.HV + hv); };
  if (tid == 0) {
    tma::mbar_init(bar, 1);
    tma::mbar_init(bar_qk, 1);
    tma::fence_mbar_init();
  }
  __syncthreads();  // initialised before any thread waits on it (the word holds an earlier CTA's state)
  // The 15 boxes spread over five warps as in the head loop (head_box_first; q, k by warp 5's
  // lane 0, A by warp 4's): one thread issuing them all held its warp, and the CTA with it.
  if (tid == 0) {
    tma::mbar_arrive_expect_tx(bar_qk, kQKBytes);
    tma::mbar_arrive_expect_tx(bar, kHeadBytes + kABytes);
  }
  if (lane == 0) {
    if (warp == 5) {
      tma_tile(sQ, &maps.q, h, t0, bar_qk);
      tma_tile(sK, &maps.k, h, t0, bar_qk);
    } else if (warp == 4) {
      tma::load_box_3d(sBase + a_at(0), &maps.a, 0, 0, tape_of(hv_first), bar);
    }
    for (int b = head_box_first(warp); b < head_box_last(warp); ++b)
      load_head_box(maps, sBase, bar, tape_of(hv_first), static_cast<int>(hv_first), t0, b);
  }
  TokenGates gates{};
  if (tid < C) gates = load_gates(p, slot, hv_first, t0, len, tid);

  float dq[8][4], dk[8][4];  // rows m0.., columns n0.., summed over the group
  zero(dq);
  zero(dk);
  // dPs and dkk summed over the group in fp32 (rows m0.., columns j0..): their products with
  // q and k run once after the loop, not once a value head.
  float sdps[4][4], sdkk[4][4];
  zero(sdps);
  zero(sdkk);

  // q and k, under the first head's loads: rows past a ragged chunk's end zeroed (they came
  // from the next document); with the L2 norm, normalised in place (bf16) with 1 / |x| kept
  // per row. Each thread takes a quarter row and zeroes its own, so no barrier separates
  // the two; the head's first barrier orders them before the products.
  tma::mbar_wait(bar_qk, 0);
  if (p.use_qk_l2norm) {
    const int r = tid >> 2, part = tid & 3;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      unsigned char* tile = smem + (t ? kK : kQ);
      uint4 w[4];
      float ss = 0.f;
#pragma unroll
      for (int c4 = 0; c4 < 4; ++c4) {
        w[c4] = r < len ? *reinterpret_cast<const uint4*>(tile + sw128_offset(C, r, 4 * part + c4)) : make_uint4(0u, 0u, 0u, 0u);
        const uint32_t u[4] = {w[c4].x, w[c4].y, w[c4].z, w[c4].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = mma::unpack_bf16(u[e]);
          ss = fmaf(f.x, f.x, ss);
          ss = fmaf(f.y, f.y, ss);
        }
      }
      ss += __shfl_xor_sync(0xffffffffu, ss, 1);
      ss += __shfl_xor_sync(0xffffffffu, ss, 2);
      const float rs = rsqrtf(ss + kL2NormEps);
#pragma unroll
      for (int c4 = 0; c4 < 4; ++c4) {
        uint32_t u[4] = {w[c4].x, w[c4].y, w[c4].z, w[c4].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = mma::unpack_bf16(u[e]);
          u[e] = mma::pack_bf16(f.x * rs, f.y * rs);
        }
        *reinterpret_cast<uint4*>(tile + sw128_offset(C, r, 4 * part + c4)) = make_uint4(u[0], u[1], u[2], u[3]);
      }
      if (part == 0) vec[(t ? kVRk : kVRq) + r] = rs;
    }
  } else if (len < C) {
    zero_rows(smem + kQ, len);
    zero_rows(smem + kK, len);
  }
  wgmma::fence_proxy_async();  // before the wgmma reads (the head's first barrier below)

  for (int j = 0; j < G; ++j) {
    const int hv = hv_first + j;
    const int oA = a_at(j), oDw = dw_at(j);
    // Head j's A and dw tiles (their place alternates; a_at, dw_at).
    const uint64_t dA_mn = at_parity(desc_mn(kADw, C), j, 2 * kATile);
    const uint64_t dDw_k = at_parity(desc_k(kADw + kATile), j, -kATile);
    const uint64_t dDw_mn = at_parity(desc_mn(kADw + kATile, C, ch), j, -kATile);
    float* hvec = vec + (j & 1) * kHeadVecFloats;  // this head's row vectors and sums
    const float* gl2 = hvec + kVGl2;
    const float* eg = hvec + kVEg;
    const float* dte = hvec + kVDte;
    const float* bet = hvec + kVBeta;
    if (tid < C) {  // this head's row vectors
      const int i = tid;
      hvec[kVGl2 + i] = gates.gcum * mma::kLog2e;
      hvec[kVEg + i] = expf(gates.gcum);
      hvec[kVDte + i] = expf(gates.gl - gates.gcum);
      hvec[kVBeta + i] = __uint_as_float(p.beta_dtype == DType::kBFloat16 ? gates.beta << 16 : gates.beta);
      hvec[kVFloor + i] = i < len && gates.g < kGdnGateFloor ? 1.f : 0.f;
      if (i == 0) hvec[kVGamma] = expf(gates.gl);
    }
    tma::mbar_wait(bar, j & 1);
    if (len < C) {  // rows past the document's end
      zero_rows(smem + kDo, len);
      zero_rows(smem + kV, len);
      zero_rows(smem + kDvn, len);
    }
    wgmma::fence_proxy_async();  // the zeros precede the wgmma reads and later TMA writes
    __syncthreads();

    // ---- Phase 1a: v_new, then the products over V (and K) of the staged tiles, each issued
    // under the previous one's elementwise work (two in flight at most: their accumulators
    // are 32 registers each beside dq and dk). v_new = A diag(beta) (v - diag(e^gcum) k S)
    // is formed again from the S^T tape rather than read from a tape of its own (16 KB less
    // a chunk and value head to keep; docs/kernels.md, "Backward"): k S in fp32, its operand
    // E = beta (v - e^gcum k S) and v_new in bf16, staged in kVn, each warpgroup its 64
    // columns; do S^T runs under E's elementwise work, dv_new S^T under v_new's. Rows past a
    // ragged chunk's end come out 0 (k and v zeroed, A's pad rows the identity's).
    float g1[8][4], g2[8][4];
    wg_issue<8, 0, 0, 8, D>(g1, desc_k(kK), desc_k(kHT, n0), true);  // k S: B = the S^T tile's rows n0.., K-major
    wgmma::commit();
    wg_issue<8, 0, 1>(g2, desc_k(kDo), desc_mn(kHT, D, ch), true);  // dq_gated = do S^T
    wgmma::commit();
    wg_wait<1>(g1);
    uint32_t vf[8][2];  // E, then v_new: this warp's rows and columns as bf16 pairs
    ld_frag(vf, smem + kV, m0, n0);
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      const int i = m0 + gid + 8 * v;
      const float b = bet[i], e = eg[i];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float2 x = mma::unpack_bf16(vf[nt][v]);
        vf[nt][v] = mma::pack_bf16(b * fmaf(-e, g1[nt][2 * v], x.x), b * fmaf(-e, g1[nt][2 * v + 1], x.y));
      }
    }
    st_frag(smem + kVn, m0, n0, vf);
    wgmma::fence_proxy_async();
    mma::bar_sync(1 + ch, 128);  // this warpgroup's columns of E staged
    wg_issue<4, 0, 1>(g1, at_parity(desc_k(kADw), j, 2 * kATile), desc_mn(kVn, C, ch), true);  // v_new = A E
    wgmma::commit();
    wg_wait<1>(g2);
    {  // dq += scale eg dq_gated; d gcum += scale eg (dq_gated . q)
      float rs[2] = {0.f, 0.f};
      add_scaled_rows<true>(dq, g2, smem + kQ, [&](int i) { return scale * eg[i]; }, rs, m0, n0, lane);
      store_row_sums(rs, hvec + kVRowA + C * ch, m0, lane);
    }
    wg_issue<8, 0, 1>(g2, desc_k(kDvn), desc_mn(kHT, D, ch), true);  // dv_new S^T = -dw
    wgmma::commit();
    wg_wait<1>(g1);
    mma::bar_sync(1 + ch, 128);  // E read
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int v = 0; v < 2; ++v) vf[nt][v] = mma::pack_bf16(g1[nt][2 * v], g1[nt][2 * v + 1]);
    st_frag(smem + kVn, m0, n0, vf);
    wgmma::fence_proxy_async();
    __syncthreads();  // v_new complete (the products below read all its columns)
    wg_issue<8, 0, 1>(g1, desc_k(kVn), desc_mn(kDS, D, ch), true);  // dk_decayed = v_new dS^T
    wgmma::commit();
    wg_wait<1>(g2);
    {  // dw, to shared memory (bf16)
      uint32_t dw[8][2];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int v = 0; v < 2; ++v) dw[nt][v] = mma::pack_bf16(-g2[nt][2 * v], -g2[nt][2 * v + 1]);
      st_frag(smem + oDw, m0, n0, dw);
    }
    float dpm[4][4], qk[4][4];  // dP = do v_new^T; q k^T, formed again per head (cheaper than
                                // 16 registers held throughout)
    wg_issue<8, 0, 0>(dpm, desc_k(kDo), desc_k(kVn, j0), true);
    wg_issue<8, 0, 0>(qk, desc_k(kQ), desc_k(kK, j0), true);
    wgmma::commit();
    wg_wait<1>(g1);
    {  // dk += dte dk_decayed; t = dte (dk_decayed . k)
      float rs[2] = {0.f, 0.f};
      add_scaled_rows<true>(dk, g1, smem + kK, [&](int i) { return dte[i]; }, rs, m0, n0, lane);
      store_row_sums(rs, hvec + kVRowT + C * ch, m0, lane);
    }
    {  // sum(dS o S) over the K x V entries
      float s = 0.f;
      if (exact_h0 || exact_dht) {
        // A document's first state is the initial state and its last state gradient dht:
        // both fp32 inputs, read as such (index k V + v), the other factor from its tape.
        const int64_t state = (pos.doc * HV_row + hv) * D * D;
        for (int e = tid; e < D * D; e += kThreads) {
          const int kk = e >> 7, vv = e & (D - 1);
          const float sv = exact_h0 ? p.initial_state[state + e] : __uint_as_float(ld_bf16_bits<D>(smem + kHT, vv, kk));
          const float dsv = exact_dht ? p.dht[state + e] : __uint_as_float(ld_bf16_bits<D>(smem + kDS, vv, kk));
          s = fmaf(sv, dsv, s);
        }
      } else {  // both tapes share one layout, so element for element
        const uint4* a = reinterpret_cast<const uint4*>(smem + kHT);
        const uint4* b = reinterpret_cast<const uint4*>(smem + kDS);
        float se[4] = {0.f, 0.f, 0.f, 0.f};  // four chains of 16 FMAs instead of one of 64
#pragma unroll
        for (int it = 0; it < D * D / 8 / kThreads; ++it) {
          const uint4 x = a[it * kThreads + tid], y = b[it * kThreads + tid];
          const uint32_t xu[4] = {x.x, x.y, x.z, x.w}, yu[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 fx = mma::unpack_bf16(xu[e]), fy = mma::unpack_bf16(yu[e]);
            se[e] = fmaf(fx.x, fy.x, fmaf(fx.y, fy.y, se[e]));
          }
        }
        s = (se[0] + se[1]) + (se[2] + se[3]);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) hvec[kVDot + warp] = s;
    }
    wg_wait<0>(dpm);
    wg_done(qk);
    {  // d gcum += rowsum - colsum (dP o P); the group's dPs += scale dP o D
      float rs[2] = {0.f, 0.f}, cs[4][2] = {};
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const int i = m0 + gid + 8 * v;
        const float gi = gl2[i];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int jj = j0 + 8 * nt + 2 * t4 + c;
            const float d = i >= jj ? mma::exp2_ftz(gi - gl2[jj]) : 0.f;
            const float dp = dpm[nt][2 * v + c];
            const float dpp = dp * (scale * qk[nt][2 * v + c] * d);
            rs[v] += dpp;
            cs[nt][c] += dpp;
            sdps[nt][2 * v + c] = fmaf(scale * dp, d, sdps[nt][2 * v + c]);
          }
        }
      }
      store_row_sums(rs, hvec + kVRowP + C * ch, m0, lane);
      store_col_sums<4>(cs, hvec + kVColP + C * rb, j0, lane);
    }
    wgmma::fence_proxy_async();
    __syncthreads();  // dw complete

    // ---- Phase 1b, pipelined as phase 1a.
    float dxu[8][4];  // dXu = A^T dv_new (below)
    {  // dA = beta_j (eg_j (dw k^T) + dv_new v^T), fp32 rounded to TF32 (phase 2's operand)
      float acc[4][4], dvv[4][4];
      wg_issue<8, 0, 0>(acc, dDw_k, desc_k(kK, j0), true);
      wg_issue<8, 0, 0>(dvv, desc_k(kDvn), desc_k(kV, j0), true);
      wgmma::commit();
      wg_wait<0>(acc);
      wg_done(dvv);
      // Stored transposed (dA^T[j][i] at fA[dat_row(j) + i]): phase 2 reads pairs of
      // consecutive i (its k) as one float2.
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int jj = j0 + 8 * nt + 2 * t4;
        const float b0 = bet[jj], b1 = bet[jj + 1], e0 = eg[jj], e1 = eg[jj + 1];
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          const int i = m0 + gid + 8 * v;
          fA[dat_row(jj) + i] = round_tf32(b0 * fmaf(e0, acc[nt][2 * v], dvv[nt][2 * v]));
          fA[dat_row(jj + 1) + i] = round_tf32(b1 * fmaf(e1, acc[nt][2 * v + 1], dvv[nt][2 * v + 1]));
        }
      }
    }
    {  // dXw = A^T dw: dk += beta eg dXw; row sums dXw . k
      float acc[8][4];
      wg_issue<4, 1, 1>(acc, dA_mn, dDw_mn, true);
      wgmma::commit();
      wg_issue<4, 1, 1>(dxu, dA_mn, desc_mn(kDvn, C, ch), true);
      wgmma::commit();
      wg_wait<1>(acc);
      float rs[2] = {0.f, 0.f};
      add_scaled_rows<false>(dk, acc, smem + kK, [&](int i) { return bet[i] * eg[i]; }, rs, m0, n0, lane);
      store_row_sums(rs, hvec + kVRowXw + C * ch, m0, lane);
    }
    // Row sums dXu . v; dv = beta dXu, staged over dw once every warp has read dw (dA
    // above), so held in registers across the barrier.
    wg_wait<0>(dxu);
    {
      float rs[2] = {0.f, 0.f};
      uint32_t vf[8][2];
      ld_frag(vf, smem + kV, m0, n0);
#pragma unroll
      for (int v = 0; v < 2; ++v) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const float2 x = mma::unpack_bf16(vf[nt][v]);
          rs[v] = fmaf(dxu[nt][2 * v], x.x, fmaf(dxu[nt][2 * v + 1], x.y, rs[v]));
        }
      }
      store_row_sums(rs, hvec + kVRowXu + C * ch, m0, lane);
    }
    __syncthreads();  // dA complete; do, v_new, S^T, dS^T, v, dv_new, dw read
    {
      uint32_t dv[8][2];
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const float b = bet[m0 + gid + 8 * v];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) dv[nt][v] = mma::pack_bf16(b * dxu[nt][2 * v], b * dxu[nt][2 * v + 1]);
      }
      st_frag(smem + oDw, m0, n0, dv);
    }

    if (j + 1 < G) {
      // Thread 0 announces the bytes; a box may complete first (the phase still waits for
      // the arrival).
      if (tid == 0) tma::mbar_arrive_expect_tx(bar, kHeadBytes + kABytes);
      if (lane == 0)
        for (int b = head_box_first(warp); b < head_box_last(warp); ++b)
          load_head_box(maps, sBase, bar, tape_of(hv + 1), static_cast<int>(hv + 1), t0, b);
      if (tid < C) gates = load_gates(p, slot, hv + 1, t0, len, tid);
    } else if (p.use_qk_l2norm && tid == 0) {  // the raw rows for the norm's backward
      tma::mbar_arrive_expect_tx(bar, kQKBytes);
      tma_tile(sBase + kDo, &maps.q, h, t0, bar);
      tma_tile(sBase + kVn, &maps.k, h, t0, bar);
    }

    // ---- Phase 2: dL = -(A^T dA A^T).tril(-1), TF32 (m16n8k8: a0 (gid, t4), a1 (gid + 8, t4),
    // a2 (gid, t4 + 4), a3 (gid + 8, t4 + 4); b0 (k = t4, n = gid), b1 (k = t4 + 4, n = gid)).
    // The 8 k of a k8 step are taken permuted (a product's sum does not depend on their order,
    // A and B fragments alike): k = t4 holds index kb + 2 t4, k = t4 + 4 index kb + 2 t4 + 1. So
    // a0 / a2 (a1 / a3, b0 / b1) are a pair of consecutive indices: one float2 of an fp32 tile
    // whose rows run along k, or one ldmatrix register of the bf16 A tile (its two halves).
    float kk[4][4];  // k k^T, formed again per head, under the TF32 products
    wg_issue<8, 0, 0>(kk, desc_k(kK), desc_k(kK, j0), true);
    wgmma::commit();
    {
      float x[4][4];  // X = A^T dA: X_ij = sum_{m >= i} A_mi dA_mj, rows m0.., columns j0..
      zero(x);
      const unsigned char* tA = smem + oA;
      // A operand (i, m) = A[m][i]: ldmatrix .trans of the 8x8 blocks (rows mm + 8 s, columns
      // m0 + 8 h) gives register s + 2 h = the pair A[mm + 8 s + 2 t4 (+1)][m0 + 8 h + gid],
      // a0 / a2 (h = 0) or a1 / a3 (h = 1) of k-step s. Lane l gives row mm + (l & 15) of
      // chunk 2 rb + (l >> 4) (frag_addr); 16 rows on, 2048 bytes on (the same swizzle).
      const uint32_t aT = frag_addr(tA, m0, m0);
      // B operand (m, j) = dA[m][j] = dA^T[j][m]: b0 / b1 of k-step s, n-tile nt the float2 at
      // row j0 + 8 nt + gid, column mm + 8 s + 2 t4 of dA^T.
      // Both addresses step on (16 rows of A, 16 columns of dA^T); the A tile's ends the loop.
      const float* bT = fA + dat_row(j0 + gid) + 2 * t4 + m0;
#pragma unroll 1
      for (uint32_t ad = aT; ad < aT + (C - m0) * 128; ad += 16 * 128, bT += 16) {
        uint32_t r[4];
        mma::ldmatrix_x4_trans(r, ad);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const uint32_t a[4] = {r[s] << 16, r[s + 2] << 16, r[s] & 0xffff0000u, r[s + 2] & 0xffff0000u};
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const float2 b = *reinterpret_cast<const float2*>(bT + 8 * nt * kFLd + 8 * s);
            mma::mma_tf32(x[nt], a, __float_as_uint(b.x), __float_as_uint(b.y));
          }
        }
      }
      __syncthreads();  // dA read by every warp; dv staged
      store_tile(smem + oDw, static_cast<__nv_bfloat16*>(p.dv) + (t0 * HV_row + hv) * D, HV_row * D, len);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
        *reinterpret_cast<float4*>(fA + xpos(m0 + gid, j0 + 8 * nt + 2 * t4)) =
            make_float4(round_tf32(x[nt][0]), round_tf32(x[nt][2]), round_tf32(x[nt][1]), round_tf32(x[nt][3]));
      wgmma::fence_proxy_async();  // dw's and dv's stores precede the next A's TMA write there
      __syncthreads();  // X complete (rounded to TF32, the next product's operand); dv stored
    }
    if (j + 1 < G && tid == 4 * 32)  // the next head's A, where this head's dw was (warp 4: no share of Y)
      tma::load_box_3d(sBase + a_at(j + 1), &maps.a, 0, 0, tape_of(hv + 1), bar);
    {  // Y = X A^T (Y_ij = sum_{m <= j} X_im A_jm), wanted for i > j only: m < min(j, i) + 1
      float y[4][4];
      zero(y);
      const unsigned char* tA = smem + oA;
      const int m_end = j0 < m0 + 16 ? min(j0 + 32, m0 + 16) : 0;  // a multiple of 16
      // A operand (i, m) = X[i][m]: {a0, a1, a2, a3} of k-step s the float4 at xpos(m0 + gid,
      // mm + 8 s + 2 t4) (rows m0 + gid, + 8; columns mm + 8 s + 2 t4, + 1).
      const float* xr = fA + xpos(m0 + gid, 2 * t4);
      // B operand (m, j) = A[j][m]: ldmatrix (not transposed) of the 8x8 blocks (rows j0 + 8 nt,
      // columns mm + 8 s) gives the pair A[j0 + 8 nt + gid][mm + 8 s + 2 t4 (+1)]: x4 number
      // nt >> 1 (rows j0 + 16 (nt >> 1) + (l & 15), chunk mm / 8 + (l >> 4): frag_addr, 2048 bytes
      // on for the second) holds it in register (nt & 1) + 2 s; chunk mm / 8 (even) is the
      // address's xor 32 mm / 16 (ld_frag).
      const uint32_t bA = frag_addr(tA, j0, 0);
#pragma unroll 1
      for (uint32_t c = 0; c < 2 * m_end; c += 32) {  // c = 2 mm: the address's xor (bytes), X's column offset (floats)
        uint32_t r[2][4];
        const uint32_t ad = bA ^ c;
        mma::ldmatrix_x4(r[0], ad);
        mma::ldmatrix_x4(r[1], ad + 16 * 128);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const float4 q = *reinterpret_cast<const float4*>(xr + c + 16 * s);
          const uint32_t a[4] = {__float_as_uint(q.x), __float_as_uint(q.y), __float_as_uint(q.z), __float_as_uint(q.w)};
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const uint32_t w = r[nt >> 1][(nt & 1) + 2 * s];
            mma::mma_tf32(y[nt], a, w << 16, w & 0xffff0000u);
          }
        }
      }
      // dL = -Y below the diagonal: dbeta += rowsum(dL o D o kk); d gcum += rowsum - colsum of
      // that times beta_i; the group's dkk += dL beta_i D.
      wg_wait<0>(kk);
      float rb_s[2] = {0.f, 0.f}, rl_s[2] = {0.f, 0.f}, cs[4][2] = {};
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const int i = m0 + gid + 8 * v;
        const float gi = gl2[i], bi = bet[i];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int jj = j0 + 8 * nt + 2 * t4 + c;
            const bool lower = i > jj;
            const float d = lower ? mma::exp2_ftz(gi - gl2[jj]) : 0.f;
            const float dl = lower ? -y[nt][2 * v + c] : 0.f;
            const float dldk = dl * d * kk[nt][2 * v + c];
            const float dll = dldk * bi;
            rb_s[v] += dldk;
            rl_s[v] += dll;
            cs[nt][c] += dll;
            sdkk[nt][2 * v + c] = fmaf(dl * bi, d, sdkk[nt][2 * v + c]);
          }
        }
      }
      store_row_sums(rb_s, hvec + kVRowB + C * ch, m0, lane);
      store_row_sums(rl_s, hvec + kVRowL + C * ch, m0, lane);
      store_col_sums<4>(cs, hvec + kVColL + C * rb, j0, lane);
    }
    // The previous head's dg and dbeta, by warp 4: its share of Y is empty (rows 0 .. 15,
    // columns 32 .. 63: above the diagonal), while warp 7 runs four k-steps of it. Formed by
    // one warp after the head's last barrier, they held the other seven warps at the next.
    if (warp == 4 && j > 0) token_gradients(p, vec + (~j & 1) * kHeadVecFloats, t0, len, hv - 1, lane);
    __syncthreads();  // the previous head's block read: the next head's vectors go there
  }

  // dq += dPs k, dk += dPs^T q + dkk k + dkk^T k on the group's sums, staged in bf16 in the
  // A / dw region (no load is pending there now).
  {
    uint32_t f[4][2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const float(&x)[4][4] = t ? sdkk : sdps;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int v = 0; v < 2; ++v) f[nt][v] = mma::pack_bf16(x[nt][2 * v], x[nt][2 * v + 1]);
      st_frag(smem + kADw + t * kATile, m0, j0, f);
    }
  }
  wgmma::fence_proxy_async();
  __syncthreads();
  wg_issue<4, 0, 1>(dq, desc_k(kADw), desc_mn(kK, C, ch), false);
  wg_issue<4, 1, 1>(dk, desc_mn(kADw, C), desc_mn(kQ, C, ch), false);
  wg_issue<4, 0, 1>(dk, desc_k(kADw + kATile), desc_mn(kK, C, ch), false);
  wg_issue<4, 1, 1>(dk, desc_mn(kADw + kATile, C), desc_mn(kK, C, ch), false);
  wgmma::commit();
  // The last head's dg and dbeta under these products (warp 4 as in the loop).
  if (warp == 4) token_gradients(p, vec + ((G - 1) & 1) * kHeadVecFloats, t0, len, hv_first + G - 1, lane);
  wg_wait<0>(dq);
  wg_done(dk);

  // dq, dk through the L2 norm's backward: d_raw = (d - x (d . x)) r, x = raw r (fp32).
  if (p.use_qk_l2norm) {
    // Rows past a ragged chunk's end hold the next document's rows: each row's sums are its
    // own and those rows are never stored, so they are not zeroed here.
    tma::mbar_wait(bar, G & 1);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      float(&d)[8][4] = t ? dk : dq;
      const unsigned char* raw = smem + (t ? kVn : kDo);
      const float* r = vec + (t ? kVRk : kVRq);
      float rs[2] = {0.f, 0.f};
      uint32_t xf[8][2];
      ld_frag(xf, raw, m0, n0);
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const float ri = r[m0 + gid + 8 * v];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const float2 x = mma::unpack_bf16(xf[nt][v]);
          rs[v] = fmaf(d[nt][2 * v], x.x * ri, fmaf(d[nt][2 * v + 1], x.y * ri, rs[v]));
        }
      }
      store_row_sums(rs, vec + (G & 1) * kHeadVecFloats + (t ? kVRowT : kVRowA) + C * ch, m0, lane);
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      float(&d)[8][4] = t ? dk : dq;
      const unsigned char* raw = smem + (t ? kVn : kDo);
      const float* r = vec + (t ? kVRk : kVRq);
      const float* dot = vec + (G & 1) * kHeadVecFloats + (t ? kVRowT : kVRowA);
      uint32_t xf[8][2];
      ld_frag(xf, raw, m0, n0);
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const int i = m0 + gid + 8 * v;
        const float ri = r[i], dx = dot[i] + dot[C + i];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const float2 x = mma::unpack_bf16(xf[nt][v]);
          d[nt][2 * v] = (d[nt][2 * v] - x.x * ri * dx) * ri;
          d[nt][2 * v + 1] = (d[nt][2 * v + 1] - x.y * ri * dx) * ri;
        }
      }
    }
  }
  // Stage over q, k (read by no one now) and store.
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const float(&d)[8][4] = t ? dk : dq;
    uint32_t df[8][2];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int v = 0; v < 2; ++v) df[nt][v] = mma::pack_bf16(d[nt][2 * v], d[nt][2 * v + 1]);
    st_frag(smem + (t ? kK : kQ), m0, n0, df);
  }
  __syncthreads();
  store_tile(smem + kQ, static_cast<__nv_bfloat16*>(p.dq) + (t0 * p.H_stride + h) * D, p.H_stride * D, len);
  store_tile(smem + kK, static_cast<__nv_bfloat16*>(p.dk) + (t0 * p.H_stride + h) * D, p.H_stride * D, len);
}

// The loads' tensor maps for p's tensors (BwdLocalMaps): encoded on the host per call and
// passed by value, so a captured CUDA graph replays them with the launch.
cudaError_t bwd_local_maps(const GdnBwdLocalArgs& p, BwdLocalMaps& m) {
  const uint64_t T = static_cast<uint64_t>(p.T), H = static_cast<uint64_t>(p.H), HV = static_cast<uint64_t>(p.HV);
  // A head slice's tensors keep the full token rows' stride (H_stride, HV_stride).
  const uint64_t row = D * 2, H_row = static_cast<uint64_t>(p.H_stride) * row, HV_row = static_cast<uint64_t>(p.HV_stride) * row;
  const uint64_t tiles = static_cast<uint64_t>(gdn_fwd_chunk_slots(p.T, p.N)) * HV;
  cudaError_t err = tma::encode_bf16_3d(&m.q, p.q, D, H, T, row, H_row, 64, 1, C);
  if (err == cudaSuccess) err = tma::encode_bf16_3d(&m.k, p.k, D, H, T, row, H_row, 64, 1, C);
  if (err == cudaSuccess) err = tma::encode_bf16_3d(&m.dout, p.dout, D, HV, T, row, HV_row, 64, 1, C);
  if (err == cudaSuccess) err = tma::encode_bf16_3d(&m.v, p.v, D, HV, T, row, HV_row, 64, 1, C);
  if (err == cudaSuccess) err = tma::encode_bf16_3d(&m.dv_new, p.dv_new, D, HV, T, row, HV_row, 64, 1, C);
  if (err == cudaSuccess) err = tma::encode_bf16_3d(&m.h, p.h, D, D, tiles, row, D * row, 64, D, 1);
  if (err == cudaSuccess) err = tma::encode_bf16_3d(&m.ds, p.ds, D, D, tiles, row, D * row, 64, D, 1);
  if (err == cudaSuccess) err = tma::encode_bf16_3d(&m.a, p.a, C, C, tiles, C * 2, C * C * 2, 64, C, 1);
  return err;
}

}  // namespace

cudaError_t gdn_bwd_local_launch(const GdnBwdLocalArgs& p, cudaStream_t stream) {
  if (p.N <= 0 || p.T == 0 || p.H == 0) return cudaSuccess;
  const int64_t blocks = gdn_fwd_chunk_slots(p.T, p.N) * p.H;
  cudaError_t err = cudaFuncSetAttribute(gdn_bwd_local_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  BwdLocalMaps maps;
  err = bwd_local_maps(p, maps);
  if (err != cudaSuccess) return err;
  gdn_bwd_local_kernel<<<static_cast<unsigned>(blocks), kThreads, kSmemBytes, stream>>>(p, maps);
  return cudaGetLastError();
}

}  // namespace cake

#!/usr/bin/env python
"""The fused backward's register and shared-memory plan as a kernel, and its time a chunk, on a Hopper GPU.

    python tools/gdn_bwd_fused_probe.py [--chunks 1024]      # H200; compile-only: tests/cuda/test_kernel_code.py

Step 1 of the fused backward's build order (docs/fused_backward.md, "The plan"): one CTA per (segment, value head, value half), a cluster pair holding
the two halves of V (the probe launches the CTAs alone, one an SM), four warpgroups in roles with the real accumulators, operand tiles and
hand-overs of the schedule that tools/gdn_bwd_fused_emulation.py checks on the CPU:

- warpgroup 0, the producer (setmaxnreg 24): TMA's role in the kernel; here it only exits
  its registers, since the tiles are constant (no loads: the HBM side is counted apart);
- warpgroup 1, the chain (200): dS^T of the CTA's 64 value rows in fp32 registers;
  per chunk it publishes dS (bf16, the DS tile), forms ``Y = dS^T K^T`` (registers x K),
  ``dv_new^T = Y diag(dte) + do^T P~``, publishes it (the DVN tile), ``X = dv_new^T A``
  (dv staged from its fragments), and updates ``dS^T <- e^gl dS^T + X' K + do'^T Q``, every
  product register-sourced (as today's reverse walk, at half its value rows a warpgroup);
- warpgroup 2, LQ (112): ``P = Q K^T`` (bf16 P~ for the chain), ``K S`` -> E ->
  ``v_new = A E`` (the VN tile), ``dP = do v_new^T`` -> dPs, ``dq = do S^T`` then
  ``+= dPs K``: 64 dq registers a chunk;
- warpgroup 3, LK (176): ``dk = v_new dS^T`` (from the DS tile), ``dw = -dv_new S^T`` in two
  64-column halves (the DW tile), ``dA = dw K^T`` then ``+= dv_new V^T`` on one accumulator
  (fp32 tile), ``dk += diag(beta e^gcum) A^T dw`` (row-scaled A^T fragments),
  ``dL = -(A^T dA A^T)`` in TF32 (mma.sync), ``K K^T``, dkk (bf16 tile), ``dk += dPs^T Q +
  dkk K + dkk^T K``.

Hand-overs are single tiles behind named barriers (ready / free pairs): P~ (LQ -> chain),
DS and DVN (chain -> LK), VN and dPs (LQ -> LK); the inputs the chain reads first (Q, K,
do, A) have two buffers by chunk parity, as the kernel's loads will; h and v one. The
map is checked against 227 KB by static_asserts. It prints ns per chunk per warpgroup for
the whole CTA (``fused``), the chain alone (``chain``: the local warpgroups return at
once) and the local warpgroups alone (``local``: the chain's barriers skipped). The values
are meaningless (constant tiles); only the products' shapes, operands and dependencies are
the schedule's. Not in it: the loads, the cluster pair's fp32 sum of dq, dk (the cluster
probe, tools/gdn_bwd_cluster_probe.py, timed that staging), the global stores.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_inline import PROBE_PRELUDE  # noqa: E402

KERNEL_SRC = PROBE_PRELUDE + r"""
namespace probe {

using namespace cake;

// Shared memory (bytes), SW128 tiles 1024-aligned. A CTA holds its value half (Vh = 64).
constexpr int kRow = 64 * 128 * 2;  // 64 rows x 128 bf16: q, k, S^T, dS^T, dw
constexpr int kSq = 64 * 64 * 2;    // 64 x 64 bf16: do, v, A, P~, dv_new^T, E / v_new, dPs, dkk
// Inputs: two buffers by chunk parity for those the chain reads first.
constexpr int kQ = 0;
constexpr int kK = kQ + 2 * kRow;
constexpr int kDo = kK + 2 * kRow;  // tokens x value half
constexpr int kA = kDo + 2 * kSq;
constexpr int kH = kA + 2 * kSq;    // S^T: value half x keys
constexpr int kV = kH + kRow;       // tokens x value half
// Hand-overs.
constexpr int kPt = kV + kSq;       // P~ (LQ -> chain)
constexpr int kDS = kPt + kSq;      // dS^T bf16 (chain -> LK)
constexpr int kDvn = kDS + kRow;    // dv_new^T: value half x tokens (chain -> LK)
constexpr int kDvSt = kDvn + kSq;   // dv staging (chain)
constexpr int kVn = kDvSt + kSq;    // E, then v_new (LQ -> LK)
constexpr int kDw = kVn + kSq;      // dw: tokens x keys (LK)
constexpr int kDps = kDw + kRow;    // dPs (LQ -> LK)
constexpr int kDkk = kDps + kSq;    // dkk (LK)
constexpr int kFLd = 72;            // fp32 rows of dA, then A^T dA
constexpr int kDA = kDkk + kSq;
constexpr int kVec = kDA + 64 * kFLd * 4;   // [2 parities][8 vectors][64]
constexpr int kSums = kVec + 2 * 8 * 64 * 4;  // row / column sums: [8][64], LQ's 0..1, LK's 2..5
constexpr int kBytes = kSums + 8 * 64 * 4;
constexpr int kSmemRequest = kBytes + 1024;   // + the 1024-byte alignment
static_assert(kSmemRequest <= 227 * 1024, "one CTA an SM: the tile map fits 227 KB");
static_assert(kK % 1024 == 0 && kDo % 1024 == 0 && kA % 1024 == 0 && kH % 1024 == 0 && kV % 1024 == 0 &&
                  kPt % 1024 == 0 && kDS % 1024 == 0 && kDvn % 1024 == 0 && kDvSt % 1024 == 0 && kVn % 1024 == 0 &&
                  kDw % 1024 == 0 && kDps % 1024 == 0 && kDkk % 1024 == 0 && kDA % 1024 == 0,
              "SW128 tiles start 1024-byte aligned");
// Vectors of a chunk (floats at kVec + parity * 512): dte, beta, -beta e^gcum, scale e^gcum,
// e^gcum, beta e^gcum, gcum log2 e, gamma.
enum Vec { kVDte = 0, kVBeta = 64, kVXk = 128, kVOutq = 192, kVEg = 256, kVBEg = 320, kVGl2 = 384, kVGamma = 448 };

// Named barriers (0 is __syncthreads's): ready / free pairs of the single hand-over tiles
// (256 threads: one warpgroup arrives, the other syncs), and one a warpgroup for its own
// tiles before a wgmma reads them (128).
enum Bar { kPtReady = 1, kPtFree, kDsReady, kDsFree, kDvnReady, kDvnFree, kVnReady, kVnFree, kDpsReady, kDpsFree,
           kBarLQ, kBarLK };
constexpr int kPair = 256, kOwn = 128;

__device__ void fill(unsigned char* sm) {
  for (int i = threadIdx.x; i < kVec / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(sm)[i] = mma::pack_bf16(0.01f, -0.01f);
  float* v = reinterpret_cast<float*>(sm + kVec);
  for (int i = threadIdx.x; i < 2 * 8 * 64 + 8 * 64; i += blockDim.x) v[i] = (i & 64) ? 0.5f : -0.01f;
  wgmma::fence_proxy_async();
  __syncthreads();
}

// A fragment rows (16 warp + gid, + 8) times per-row factors f, rounded to bf16 again.
__device__ __forceinline__ void scale_row_frags(uint32_t (&a)[4][4], const float* f, int warp, int gid) {
  const float lo = f[16 * warp + gid], hi = f[16 * warp + gid + 8];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float e = (r & 1) ? hi : lo;
      const uint32_t w = a[ks][r];
      a[ks][r] = mma::pack_bf16(__uint_as_float(w << 16) * e, __uint_as_float(w & 0xffff0000u) * e);
    }
}

// The same, transposed (stmatrix.trans): the accumulator's columns become the tile's rows.
__device__ __forceinline__ void store_frags_trans(const uint32_t (&f)[4][4], uint32_t tile, int warp, int lane) {
  const int mi = lane >> 3, r8 = lane & 7;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    mma::stmatrix_x4_trans(tile + sw128_offset(64, 16 * ks + (mi >> 1) * 8 + r8, 2 * warp + (mi & 1)), f[ks]);
}

// A hand-over tile (the pair's named barriers): from chunk 1 on, once its reader has freed the
// last chunk's, the warpgroup's fragments stored, made visible to the async proxy and
// signalled ready. `paired`: the reader's warpgroup runs in this form of the probe.
template <int kSteps>
__device__ __forceinline__ void hand_over(const uint32_t (&f)[kSteps][4], uint32_t tile, int free_bar, int ready_bar,
                                          bool paired, int c, int warp, int lane) {
  if (paired && c > 0) mma::bar_sync(free_bar, kPair);
  store_frags(f, tile, warp, lane);
  wgmma::fence_proxy_async();
  if (paired) mma::bar_arrive(ready_bar, kPair);
}

// Row sums of an accumulator of N columns (4-lane shuffle tree), added to a slot per row.
template <int N>
__device__ __forceinline__ void add_row_sums(const float (&d)[N], float* slot, int warp, int gid, int t4) {
  float lo = 0.f, hi = 0.f;
#pragma unroll
  for (int i = 0; i < N; i += 4) {
    lo += d[i] + d[i + 1];
    hi += d[i + 2] + d[i + 3];
  }
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    lo += __shfl_xor_sync(0xffffffffu, lo, o);
    hi += __shfl_xor_sync(0xffffffffu, hi, o);
  }
  if (t4 == 0) {
    slot[16 * warp + gid] += lo;
    slot[16 * warp + gid + 8] += hi;
  }
}

// x o y elementwise, y the bf16 pairs of the same rows and columns from a 64-row tile
// (ldmatrix in the accumulator layout), for the products' elementwise terms (A o dA, P, ...).
template <int kSteps>
__device__ __forceinline__ void mul_tile(float (&d)[8 * kSteps], uint32_t tile, int warp, int lane) {
  const int mi = lane >> 3, r8 = lane & 7;
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    uint32_t r[4];
    mma::ldmatrix_x4(r, tile + sw128_offset(64, 16 * warp + (mi & 1) * 8 + r8, 2 * ks + (mi >> 1)));
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 p = mma::unpack_bf16(r[e]);
      d[8 * ks + 2 * e] *= p.x;
      d[8 * ks + 2 * e + 1] *= p.y;
    }
  }
}

// Row sums of d o tile (a copy of d: d itself is kept), added to a slot per row.
template <int kSteps>
__device__ __forceinline__ void add_row_dots(const float (&d)[8 * kSteps], uint32_t tile, float* slot, int warp,
                                             int lane) {
  float t[8 * kSteps];
#pragma unroll
  for (int i = 0; i < 8 * kSteps; ++i) t[i] = d[i];
  mul_tile<kSteps>(t, tile, warp, lane);
  add_row_sums(t, slot, warp, lane >> 2, lane & 3);
}

// Rows 16 warp + gid (+ 8) of an accumulator times per-row factors f.
template <int N>
__device__ __forceinline__ void scale_rows(float (&d)[N], const float* f, int warp, int gid) {
  const float lo = f[16 * warp + gid], hi = f[16 * warp + gid + 8];
#pragma unroll
  for (int i = 0; i < N; ++i) d[i] *= (i & 2) ? hi : lo;
}

template <int kN>
__device__ __forceinline__ void zero(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) d[i] = 0.f;
}

// The chain: warpgroup 1.
template <bool kLocal>
__device__ void chain(unsigned char* sm, int chunks, float& keep) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, t4 = lane & 3;
  const uint32_t base = mma::smem_addr(sm);
  float s[64];
  zero(s);
  for (int c = 0; c < chunks; ++c) {
    const int p = c & 1;
    const float* vec = reinterpret_cast<const float*>(sm + kVec) + p * 512;
    const uint32_t tk = base + kK + p * kRow, tq = base + kQ + p * kRow, tdo = base + kDo + p * kSq,
                   ta = base + kA + p * kSq;
    uint32_t f[8][4];
    wgmma::to_a_frags(f, s);
    hand_over(f, base + kDS, kDsFree, kDsReady, kLocal, c, warp, lane);
    float y[32];
    wgmma::mma_rs_m64n64_fresh<0>(y, f, tk);  // Y = dS^T K^T
    wgmma::commit();
    uint32_t dof[4][4];
    load_trans_frags(dof, tdo, 0, warp, lane);  // do^T
    wgmma::wait<0>();
    wgmma::fence_operands(y);
    mma::scale_columns(y, vec + kVDte, t4);
    if (kLocal) mma::bar_sync(kPtReady, kPair);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::mma_rs_m64n64k16<1>(y, dof[ks], wgmma::desc_mn_major(base + kPt, 64, ks), 1);
    wgmma::commit_and_wait(y);
    if (kLocal && c + 1 < chunks) mma::bar_arrive(kPtFree, kPair);
    uint32_t dvf[4][4];
    wgmma::to_a_frags(dvf, y);
    hand_over(dvf, base + kDvn, kDvnFree, kDvnReady, kLocal, c, warp, lane);
    float x[32];
    wgmma::mma_rs_m64n64_fresh<1>(x, dvf, ta);  // X = dv_new^T A
    wgmma::commit();
    mma::scale_token_frags(dof, vec + kVOutq, t4);
#pragma unroll
    for (int i = 0; i < 64; ++i) s[i] *= vec[kVGamma];
    wgmma::wait<0>();
    wgmma::fence_operands(x);
    {  // dv = beta X^T, staged transposed for a 16-byte store
      float dv[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) dv[i] = x[i];
      mma::scale_columns(dv, vec + kVBeta, t4);
      uint32_t g[4][4];
      wgmma::to_a_frags(g, dv);
      store_frags_trans(g, base + kDvSt, warp, lane);
    }
    mma::scale_columns(x, vec + kVXk, t4);
    uint32_t xk[4][4];
    wgmma::to_a_frags(xk, x);
    wgmma::fence_operands(s);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::mma_rs_m64n128k16<1>(s, xk[ks], wgmma::desc_mn_major(tk, 64, ks), 1);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::mma_rs_m64n128k16<1>(s, dof[ks], wgmma::desc_mn_major(tq, 64, ks), 1);
    wgmma::commit_and_wait(s);
  }
#pragma unroll
  for (int i = 0; i < 64; ++i) keep += s[i];
}

// LQ: warpgroup 2.
template <bool kChain>
__device__ void local_q(unsigned char* sm, int chunks, float& keep) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const uint32_t base = mma::smem_addr(sm);
  float* sums = reinterpret_cast<float*>(sm + kSums);
  for (int c = 0; c < chunks; ++c) {
    const int p = c & 1;
    const float* vec = reinterpret_cast<const float*>(sm + kVec) + p * 512;
    const uint32_t tk = base + kK + p * kRow, tq = base + kQ + p * kRow, tdo = base + kDo + p * kSq,
                   ta = base + kA + p * kSq;
    float P[32];
    zero(P);
    wgmma::mma_ss_tiles64<8, 0, 0>(P, tq, tk, false);
    wgmma::commit_and_wait(P);
    mul_tile<4>(P, ta, warp, lane);  // stands for the decay mask D and the scale
    {
      uint32_t f[4][4];
      wgmma::to_a_frags(f, P);
      hand_over(f, base + kPt, kPtFree, kPtReady, kChain, c, warp, lane);
    }
    {  // E = beta (v - e^gcum K S), then v_new = A E
      float e[32];
      zero(e);
      wgmma::mma_ss_tiles64<8, 0, 0>(e, tk, base + kH, false);
      wgmma::commit_and_wait(e);
      mul_tile<4>(e, base + kV, warp, lane);
      mma::scale_columns(e, vec + kVBEg, t4);
      uint32_t f[4][4];
      wgmma::to_a_frags(f, e);
      if (c > 0) mma::bar_sync(kVnFree, kPair);
      store_frags(f, base + kVn, warp, lane);
      wgmma::fence_proxy_async();
      mma::bar_sync(kBarLQ, kOwn);
      wgmma::mma_ss_tiles64<4, 0, 1>(e, ta, base + kVn, false);
      wgmma::commit_and_wait(e);
      wgmma::to_a_frags(f, e);
      mma::bar_sync(kBarLQ, kOwn);  // every warp's E read before v_new overwrites it
      store_frags(f, base + kVn, warp, lane);
      wgmma::fence_proxy_async();
      mma::bar_arrive(kVnReady, kPair);
      mma::bar_sync(kBarLQ, kOwn);
    }
    {  // dP = do v_new^T; dP o P sums; dPs
      float dp[32];
      zero(dp);
      wgmma::mma_ss_tiles64<4, 0, 0>(dp, tdo, base + kVn, false);
      wgmma::commit_and_wait(dp);
      float pp[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) pp[i] = dp[i] * P[i];
      add_row_sums(pp, sums, warp, gid, t4);
      mul_tile<4>(dp, ta, warp, lane);  // stands for scale D
      uint32_t f[4][4];
      wgmma::to_a_frags(f, dp);
      hand_over(f, base + kDps, kDpsFree, kDpsReady, true, c, warp, lane);
      mma::bar_sync(kBarLQ, kOwn);
    }
    float dq[64];  // do S^T, scaled by row; then += dPs K
    zero(dq);
    wgmma::mma_ss_tiles64<4, 0, 1>(dq, tdo, base + kH, false);
    wgmma::commit_and_wait(dq);
    add_row_dots<8>(dq, tq, sums + 64, warp, lane);
    scale_rows(dq, vec + kVOutq, warp, gid);
    wgmma::fence_operands(dq);
    wgmma::mma_ss_tiles64<4, 0, 1>(dq, base + kDps, tk, true);
    wgmma::commit_and_wait(dq);
    keep += dq[c & 63];
  }
}

// LK: warpgroup 3.
template <bool kChain>
__device__ void local_k(unsigned char* sm, int chunks, float& keep) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const uint32_t base = mma::smem_addr(sm);
  float* sums = reinterpret_cast<float*>(sm + kSums);
  float* da = reinterpret_cast<float*>(sm + kDA);
  for (int c = 0; c < chunks; ++c) {
    const int p = c & 1;
    const float* vec = reinterpret_cast<const float*>(sm + kVec) + p * 512;
    const uint32_t tk = base + kK + p * kRow, tq = base + kQ + p * kRow, ta = base + kA + p * kSq;
    float dk[64];  // v_new dS^T, scaled by row
    zero(dk);
    mma::bar_sync(kVnReady, kPair);
    if (kChain) mma::bar_sync(kDsReady, kPair);
    wgmma::mma_ss_tiles64<4, 0, 1>(dk, base + kVn, base + kDS, false);
    wgmma::commit();
    {  // sum(dS o S) over the value half (dgl), from the two tiles, under the product
      float d[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) d[i] = 1.f;
      mul_tile<8>(d, base + kDS, warp, lane);
      mul_tile<8>(d, base + kH, warp, lane);
      add_row_sums(d, sums + 256, warp, gid, t4);
    }
    wgmma::wait<0>();
    wgmma::fence_operands(dk);
    if (kChain && c + 1 < chunks) mma::bar_arrive(kDsFree, kPair);
    if (c + 1 < chunks) mma::bar_arrive(kVnFree, kPair);
    add_row_dots<8>(dk, tk, sums + 192, warp, lane);
    scale_rows(dk, vec + kVDte, warp, gid);
    wgmma::fence_operands(dk);
    if (kChain) mma::bar_sync(kDvnReady, kPair);
#pragma unroll 1
    for (int b = 0; b < 2; ++b) {  // dw = -dv_new S^T, one 64-key half at a time
      float w[32];
      zero(w);
      wgmma::mma_ss_tiles64<4, 1, 1>(w, base + kDvn, base + kH + 8192 * b, false);
      wgmma::commit_and_wait(w);
      uint32_t f[4][4];
      wgmma::to_a_frags(f, w);
      store_frags(f, base + kDw + 8192 * b, warp, lane);
    }
    wgmma::fence_proxy_async();
    mma::bar_sync(kBarLK, kOwn);
    {  // dA = dw K^T (A o dA sums, columns by e^gcum), += dv_new V^T (A o dA sums), columns by beta
      float a[32];
      zero(a);
      wgmma::mma_ss_tiles64<8, 0, 0>(a, base + kDw, tk, false);
      wgmma::commit_and_wait(a);
      add_row_dots<4>(a, ta, sums + 128, warp, lane);  // stands for the column sums
      mma::scale_columns(a, vec + kVEg, t4);
      wgmma::fence_operands(a);
      wgmma::mma_ss_tiles64<4, 1, 0>(a, base + kDvn, base + kV, true);
      wgmma::commit_and_wait(a);
      if (kChain && c + 1 < chunks) mma::bar_arrive(kDvnFree, kPair);
      add_row_dots<4>(a, ta, sums + 320, warp, lane);
      mma::scale_columns(a, vec + kVBeta, t4);
#pragma unroll
      for (int jt = 0; jt < 8; ++jt) {  // the fp32 dA tile for the TF32 products
        const int r = 16 * warp + gid, col = 8 * jt + 2 * t4;
        *reinterpret_cast<float2*>(da + r * kFLd + col) = make_float2(a[4 * jt], a[4 * jt + 1]);
        *reinterpret_cast<float2*>(da + (r + 8) * kFLd + col) = make_float2(a[4 * jt + 2], a[4 * jt + 3]);
      }
    }
    {  // dk += diag(beta e^gcum) A^T dw
      uint32_t at[4][4];
      load_trans_frags(at, ta, 0, warp, lane);
      scale_row_frags(at, vec + kVBEg, warp, gid);
      wgmma::fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma::mma_rs_m64n128k16<1>(dk, at[ks], wgmma::desc_mn_major(base + kDw, 64, ks), 1);
      wgmma::commit_and_wait(dk);
    }
    mma::bar_sync(kBarLK, kOwn);  // dA stored
    float dl[32];  // dL = -(A^T dA) A^T, TF32: warp rows 16 warp .., 8 n-tiles
    {
      float xa[32];
      zero(xa);
      const __nv_bfloat16* am = reinterpret_cast<const __nv_bfloat16*>(sm + kA + p * kSq);
      const int r0 = 16 * warp + gid;
#pragma unroll
      for (int kt = 0; kt < 8; ++kt) {
        const int j0 = 8 * kt + t4;
        uint32_t af[4];  // A^T[i][j] = A[j][i] (the probe reads A's rows unswizzled)
        af[0] = __float_as_uint(__bfloat162float(am[j0 * 64 + r0]));
        af[1] = __float_as_uint(__bfloat162float(am[j0 * 64 + r0 + 8]));
        af[2] = __float_as_uint(__bfloat162float(am[(j0 + 4) * 64 + r0]));
        af[3] = __float_as_uint(__bfloat162float(am[(j0 + 4) * 64 + r0 + 8]));
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          float acc[4] = {xa[4 * nt], xa[4 * nt + 1], xa[4 * nt + 2], xa[4 * nt + 3]};
          mma::mma_tf32(acc, af, __float_as_uint(da[j0 * kFLd + 8 * nt + gid]), __float_as_uint(da[(j0 + 4) * kFLd + 8 * nt + gid]));
#pragma unroll
          for (int e = 0; e < 4; ++e) xa[4 * nt + e] = acc[e];
        }
      }
      mma::bar_sync(kBarLK, kOwn);  // every warp's dA read
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int col = 8 * nt + 2 * t4;
        *reinterpret_cast<float2*>(da + r0 * kFLd + col) = make_float2(xa[4 * nt], xa[4 * nt + 1]);
        *reinterpret_cast<float2*>(da + (r0 + 8) * kFLd + col) = make_float2(xa[4 * nt + 2], xa[4 * nt + 3]);
      }
      __syncwarp();
      zero(dl);
#pragma unroll
      for (int kt = 0; kt < 8; ++kt) {
        const int m0 = 8 * kt + t4;
        uint32_t xf[4];
        xf[0] = __float_as_uint(da[r0 * kFLd + m0]);
        xf[1] = __float_as_uint(da[(r0 + 8) * kFLd + m0]);
        xf[2] = __float_as_uint(da[r0 * kFLd + m0 + 4]);
        xf[3] = __float_as_uint(da[(r0 + 8) * kFLd + m0 + 4]);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          float acc[4] = {dl[4 * nt], dl[4 * nt + 1], dl[4 * nt + 2], dl[4 * nt + 3]};
          const int n = 8 * nt + gid;  // A^T[m][n] = A[n][m]
          mma::mma_tf32(acc, xf, __float_as_uint(__bfloat162float(am[n * 64 + m0])),
                        __float_as_uint(__bfloat162float(am[n * 64 + m0 + 4])));
#pragma unroll
          for (int e = 0; e < 4; ++e) dl[4 * nt + e] = acc[e];
        }
      }
    }
    {  // K K^T: dL o D o kk sums; dkk
      float kk[32];
      zero(kk);
      wgmma::mma_ss_tiles64<8, 0, 0>(kk, tk, tk, false);
      wgmma::commit_and_wait(kk);
#pragma unroll
      for (int i = 0; i < 32; ++i) kk[i] *= dl[i];
      add_row_sums(kk, sums + 320, warp, gid, t4);
      mma::scale_columns(dl, vec + kVBeta, t4);
      uint32_t f[4][4];
      wgmma::to_a_frags(f, dl);
      store_frags(f, base + kDkk, warp, lane);
      wgmma::fence_proxy_async();
      mma::bar_sync(kBarLK, kOwn);
    }
    mma::bar_sync(kDpsReady, kPair);
    // dk += dPs^T Q + dkk K + dkk^T K
    wgmma::mma_ss_tiles64<4, 1, 1>(dk, base + kDps, tq, true);
    wgmma::mma_ss_tiles64<4, 0, 1>(dk, base + kDkk, tk, true);
    wgmma::mma_ss_tiles64<4, 1, 1>(dk, base + kDkk, tk, true);
    wgmma::commit_and_wait(dk);
    if (c + 1 < chunks) mma::bar_arrive(kDpsFree, kPair);
    mma::bar_sync(kBarLK, kOwn);  // the dkk tile and dA region read before the next chunk writes them
    keep += dk[c & 63];
  }
}

// Registers a thread per role (setmaxnreg): 128 x (24 + 200 + 112 + 176) = 64K, the SM's file. The
// least counts without spills, found by compiling with -DPROBE_NREG_CHAIN=.. (and _LQ, _LK):
// chain 192, LQ 104, LK 160.
#ifndef PROBE_NREG_CHAIN
#define PROBE_NREG_CHAIN 200
#endif
#ifndef PROBE_NREG_LQ
#define PROBE_NREG_LQ 112
#endif
#ifndef PROBE_NREG_LK
#define PROBE_NREG_LK 176
#endif
static_assert(24 + PROBE_NREG_CHAIN + PROBE_NREG_LQ + PROBE_NREG_LK <= 512, "the roles fit the register file");

// A warpgroup's registers a thread set to kRegs from the launch's 128 (64K / 512 threads):
// .dec below it, .inc above (each direction's instruction only moves its own way).
template <int kRegs>
__device__ __forceinline__ void set_registers() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg's range");
  if constexpr (kRegs < 128) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
  if constexpr (kRegs > 128) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// kMode 0: the whole CTA; 1: the chain alone; 2: the local warpgroups alone.
template <int kMode>
__global__ void __launch_bounds__(512, 1) fused_vsplit(int chunks, float* ns, float* sink) {
  extern __shared__ unsigned char raw[];
  unsigned char* sm = raw + ((1024 - (mma::smem_addr(raw) & 1023)) & 1023);
  fill(sm);
  // The role from a shuffle, so that ptxas sees a warp-uniform branch.
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
  float keep = 0.f;
  const uint64_t t0 = now_ns();
  if (wg == 0) {
    set_registers<24>();
  } else if (wg == 1) {
    set_registers<PROBE_NREG_CHAIN>();
    if (kMode != 2) chain<kMode == 0>(sm, chunks, keep);
  } else if (wg == 2) {
    set_registers<PROBE_NREG_LQ>();
    if (kMode != 1) local_q<kMode == 0>(sm, chunks, keep);
  } else {
    set_registers<PROBE_NREG_LK>();
    if (kMode != 1) local_k<kMode == 0>(sm, chunks, keep);
  }
  const uint64_t t1 = now_ns();
  if (keep == 12345.f) sink[threadIdx.x & 255] = keep;
  if ((threadIdx.x & 127) == 0) ns[4 * blockIdx.x + wg] = static_cast<float>(t1 - t0) / chunks;
}

template __global__ void fused_vsplit<0>(int, float*, float*);
template __global__ void fused_vsplit<1>(int, float*, float*);
template __global__ void fused_vsplit<2>(int, float*, float*);

}  // namespace probe
"""

BINDING_SRC = r"""
#include <torch/extension.h>

// ns a chunk per (CTA, warpgroup): [ctas, 4].
torch::Tensor run(int64_t mode, int64_t chunks, int64_t ctas) {
  auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat);
  auto sink = torch::zeros({256}, opts);
  auto ns = torch::full({ctas, 4}, NAN, opts);
  void (*kernel)(int, float*, float*) =
      mode == 0 ? probe::fused_vsplit<0> : (mode == 1 ? probe::fused_vsplit<1> : probe::fused_vsplit<2>);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, probe::kSmemRequest);
  kernel<<<ctas, 512, probe::kSmemRequest>>>(static_cast<int>(chunks), ns.data_ptr<float>(), sink.data_ptr<float>());
  return ns;
}
"""

# Work a chunk per CTA (MFLOP; a tile of the unsplit kernel is two such CTA-chunks): the
# products above at m x n x k, 2 m n k each.
PRODUCTS = {
    "chain": [(64, 64, 128), (64, 64, 64), (64, 64, 64), (64, 128, 64), (64, 128, 64)],
    "LQ": [(64, 64, 128), (64, 64, 128), (64, 64, 64), (64, 64, 64), (64, 128, 64), (64, 128, 64)],
    "LK": [(64, 128, 64), (64, 128, 64), (64, 64, 128), (64, 64, 64), (64, 128, 64), (64, 64, 64), (64, 64, 64),
           (64, 64, 128), (64, 128, 64), (64, 128, 64), (64, 128, 64)],
}


def mflop(role: str) -> float:
    return sum(2 * m * n * k for m, n, k in PRODUCTS[role]) / 1e6


def main() -> int:
    from cuda_inline import chunk_probe_main

    print("MFLOP a chunk per CTA: " + ", ".join(f"{r} {mflop(r):.2f}" for r in PRODUCTS))
    return chunk_probe_main(__doc__.split("\n\n")[0], "cake_gdn_bwd_fused_probe",
                            "torch::Tensor run(int64_t mode, int64_t chunks, int64_t ctas);", KERNEL_SRC + BINDING_SRC,
                            ((0, "fused", slice(1, 4)), (1, "chain", slice(1, 2)), (2, "local", slice(2, 4))))

if __name__ == "__main__":
    sys.exit(main())

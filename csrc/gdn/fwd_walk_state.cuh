#pragma once

// The walk's state warpgroups (fwd_walk.cu): each holds 64 value columns of S^T in
// registers across a segment's chunks and runs the serial chain S -> U -> X -> S, plus the
// output of its columns (written by fwd_walk_output.cuh). Summary mode runs the same chain
// instructions as the output mode (so E_s and M_s round as the uncut walk would) minus
// Q, P~ and O; M_s's walk reads zeros for V. Tape mode runs them minus Q, P~ and O too,
// and writes the chain's bf16 operand S^T as the backward's h tape (fwd_walk_tapes.cuh).

#include <cstdint>

#include <cuda_bf16.h>

#include "common/mma_sm80.cuh"
#include "common/swizzle.cuh"
#include "common/tma_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "gdn/fwd_walk_layout.cuh"
#include "gdn/fwd_walk_output.cuh"
#include "gdn/fwd_walk_tapes.cuh"
#include "gdn/gdn.h"

namespace cake::gdn_walk {

// A state warpgroup's 64 x 128 accumulator of S^T (or dS^T) from / to a K x V fp32 matrix
// in rows of 128: s[4 nt + e] is value column col (+8 for e >= 2), head dim
// 8 nt + 2 t4 + (e & 1).
__device__ __forceinline__ void load_state_columns(float (&s)[64], const float* X, int col, int t4) {
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    const int kd = 8 * nt + 2 * t4;
    s[4 * nt + 0] = X[kd * kGdnHeadDim + col];
    s[4 * nt + 1] = X[(kd + 1) * kGdnHeadDim + col];
    s[4 * nt + 2] = X[kd * kGdnHeadDim + col + 8];
    s[4 * nt + 3] = X[(kd + 1) * kGdnHeadDim + col + 8];
  }
}

__device__ __forceinline__ void store_state_columns(const float (&s)[64], float* X, int col, int t4) {
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    const int kd = 8 * nt + 2 * t4;
    X[kd * kGdnHeadDim + col] = s[4 * nt + 0];
    X[(kd + 1) * kGdnHeadDim + col] = s[4 * nt + 1];
    X[kd * kGdnHeadDim + col + 8] = s[4 * nt + 2];
    X[(kd + 1) * kGdnHeadDim + col + 8] = s[4 * nt + 3];
  }
}

// A walk's start: S0 (nullptr: zeros; identity: the K x K identity).
__device__ __forceinline__ void start_state(float (&s)[64], const float* S0, bool identity, int col, int t4) {
  if (S0 != nullptr) {
    load_state_columns(s, S0, col, t4);
    return;
  }
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    const int kd = 8 * nt + 2 * t4;
    s[4 * nt + 0] = identity && kd == col ? 1.f : 0.f;
    s[4 * nt + 1] = identity && kd + 1 == col ? 1.f : 0.f;
    s[4 * nt + 2] = identity && kd == col + 8 ? 1.f : 0.f;
    s[4 * nt + 3] = identity && kd + 1 == col + 8 ? 1.f : 0.f;
  }
}

// A walk's end: to S_end as a K x V matrix, or from the identity (a transfer) transposed,
// row col, pairs of adjacent head dims (the layout the chains read).
__device__ __forceinline__ void end_state(const float (&s)[64], float* S_end, bool identity, int col, int t4) {
  if (!identity) {
    store_state_columns(s, S_end, col, t4);
    return;
  }
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    const int kd = 8 * nt + 2 * t4;
    *reinterpret_cast<float2*>(S_end + col * kGdnHeadDim + kd) = make_float2(s[4 * nt + 0], s[4 * nt + 1]);
    *reinterpret_cast<float2*>(S_end + (col + 8) * kGdnHeadDim + kd) = make_float2(s[4 * nt + 2], s[4 * nt + 3]);
  }
}

// A state warpgroup (wg of the CTA's): the walk of the 64 value columns of half vh
// (v0 = 64 vh ..) of one (segment, value head), from S0 (K x V fp32, rows of 128;
// nullptr: zeros; identity: the K x K identity), to S_end (same layout, or transposed
// when identity: M_s^T, the layout the chain reads). first_slot: the segment's first
// chunk slot (tape mode: where its tapes go, in `tapes`).
// The state's update of a chunk, in both directions: s <- gamma s, then the first of its
// products issued, s += A K (four k16 steps; A's fragments a[ks], K MN-major at sk). The
// caller may issue more onto s before it commits.
__device__ __forceinline__ void decay_and_update(float (&s)[64], float gamma, const uint32_t (&a)[4][4], uint32_t sk) {
#pragma unroll
  for (int i = 0; i < 64; ++i) s[i] *= gamma;
  wgmma::fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) wgmma::mma_rs_m64n128k16<1>(s, a[ks], wgmma::desc_mn_major(sk, 64, ks), 1);
}

// A state warpgroup's step c: waits until the stage's tiles, P~ and gate vectors are in
// (the aux warpgroup's barrier, then the TMA's mbarrier, which also orders its writes for
// this thread; on the first step warpgroup 1 waits for warpgroup 0's stagger) and returns
// the stage. The same for the forward and the reverse walk.
template <int kStateWgs>
__device__ __forceinline__ unsigned char* enter_stage(unsigned char* smem, uint32_t load_bar, int c, int wg) {
  const int stage = c % kStages;
  mma::bar_sync(kBarFull + 7 * wg + stage, 256);
  tma::mbar_wait(load_bar + 8 * stage, (c / kStages) & 1);
  if (kStateWgs == 2 && c == 0 && wg == 1) mma::bar_sync(kBarStagger, 256);
  return smem + stage * kStageBytes;
}

template <WalkMode kMode, int kStateWgs>
__device__ __forceinline__ void state_warpgroup(const GdnFwdCoreArgs& p, unsigned char* smem, uint32_t load_bar,
                                                int wg, int vh, int64_t hv, int64_t seg_start, int64_t doc_end, int nch,
                                                const float* S0, bool identity, float* S_end, int64_t first_slot,
                                                WalkTapes tapes) {
  constexpr bool kOutput = walks_output(kMode), kTape = walks_tapes(kMode);
  const int tid = threadIdx.x & 127, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int mi = lane >> 3, r8 = lane & 7;  // ldmatrix/stmatrix: this lane's matrix and row
  const int v0 = vh * kBV;
  __nv_bfloat16* og = static_cast<__nv_bfloat16*>(p.o);
  // S_end waits in shared memory for the end of the walk: held in registers across the
  // loop it is spilled (the loop needs them all). Every thread of the warpgroup writes
  // the same value and reads back its own write.
  __shared__ float* parked_end[kStateWgs];
  parked_end[wg] = S_end;

  // S^T accumulator: s[4 nt + e] is value column `col` (+8 for e >= 2), head dim 8 nt + 2 t4 + (e & 1).
  const int col = v0 + 16 * warp + gid;
  float s[64];
  start_state(s, S0, identity, col, t4);

  for (int c = 0; c < nch; ++c) {
    const int stage = c % kStages;
    unsigned char* st = enter_stage<kStateWgs>(smem, load_bar, c, wg);  // chunk c
    const uint32_t sq = mma::smem_addr(st + kQOff), sk = mma::smem_addr(st + kKOff);
    const uint32_t sv = mma::smem_addr(st + kVOff), sa = mma::smem_addr(st + kAOff);
    const uint32_t sp = mma::smem_addr(st + kPOff);
    const float* gs = reinterpret_cast<const float*>(st + kGOff);

    // (1) Group 1: U^T = S^T K^T. Group 2: O^T = S^T Q^T.
    uint32_t sfrag[8][4];
    wgmma::to_a_frags(sfrag, s);
    float u[32], o[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) u[i] = o[i] = 0.f;
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) wgmma::mma_rs_m64n64k16<0>(u, sfrag[ks], wgmma::desc_k_major(sk, 64, ks), ks > 0);
    wgmma::commit();
    if constexpr (kOutput) {
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) wgmma::mma_rs_m64n64k16<0>(o, sfrag[ks], wgmma::desc_k_major(sq, 64, ks), ks > 0);
    }
    wgmma::commit();  // (an empty group in summary and tape modes keeps the wait counts below)
    if (kTape && tapes.h != nullptr) {  // h: S^T at the chunk's start, while U^T is formed (none: the final states' walk)
      __nv_bfloat16* h_rows = static_cast<__nv_bfloat16*>(tapes.h) +
                              (((first_slot + c) * p.HV + hv) * kGdnHeadDim + v0 + 16 * warp) * kGdnHeadDim;
      store_h_chunk(sfrag, smem + (kOutput ? kHStageOff : kQOff) + (4 * wg + warp) * 2048, h_rows);
    }

    // (2) Group 3: X = (V^T + W') diag(beta) A^T with W' = -e^gcum_j U^T, the sum formed
    // in fp32 (one fma per element, in place of U^T; beta_j in the decay vector and on
    // V^T) and rounded to bf16 once: one k64 product on the serial chain rather than one
    // for V^T and one for W'. V^T comes as A fragments (tokens = k), read k-step by
    // k-step (no registers to hold all four).
    wgmma::wait<1>();
    wgmma::fence_operands(u);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t vfrag[4];
      mma::ldmatrix_x4_trans(vfrag, sv + sw128_offset(64, 16 * ks + (mi >> 1) * 8 + r8, 8 * vh + 2 * warp + (mi & 1)));
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        // vfrag[r] holds the bf16 pair of accumulator elements i, i + 1 (to_a_frag):
        // tokens 8 (i / 4) + 2 t4 (+1), as in scale_columns.
        const int i = 8 * ks + 2 * r;
        const float2 e = *reinterpret_cast<const float2*>(gs + kGDecayK + 8 * (i >> 2) + 2 * t4);
        const float2 b = *reinterpret_cast<const float2*>(gs + kGBeta + 8 * (i >> 2) + 2 * t4);
        u[i] = fmaf(u[i], e.x, __uint_as_float(vfrag[r] << 16) * b.x);
        u[i + 1] = fmaf(u[i + 1], e.y, __uint_as_float(vfrag[r] & 0xffff0000u) * b.y);
      }
    }
    uint32_t wfrag[4][4];
    wgmma::to_a_frags(wfrag, u);
    float x[32];
    wgmma::mma_rs_m64n64_fresh<0>(x, wfrag, sa);
    wgmma::commit();

    // (3) O^T columns (tokens i) scaled by scale e^gcum_i, once group 2 is done.
    if constexpr (kOutput) {
      wgmma::wait<1>();
      wgmma::fence_operands(o);
      mma::scale_columns(o, gs + kGOutQ, t4);
    }
    wgmma::wait<0>();
    wgmma::fence_operands(x);

    // (4) Group 4: S^T = e^gl S^T + (X * e^(gl - gcum_j)) K, the serial chain first.
    // Group 5: O^T += X P~^T.
    uint32_t xfrag[4][4];
    wgmma::to_a_frags(xfrag, x);
    mma::scale_columns(x, gs + kGTailK, t4);
    uint32_t xtfrag[4][4];
    wgmma::to_a_frags(xtfrag, x);
    decay_and_update(s, gs[kGGamma], xtfrag, sk);  // gamma = e^gl
    wgmma::commit();
    if (kStateWgs == 2 && c == 0 && wg == 0) mma::bar_arrive(kBarStagger, 256);
    if constexpr (kOutput) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma::mma_rs_m64n64k16<0>(o, xfrag[ks], wgmma::desc_k_major(sp, 64, ks), 1);
      wgmma::commit();
    }
    wgmma::wait<0>();
    if constexpr (kOutput) wgmma::fence_operands(o);
    wgmma::fence_operands(s);

    // (5) o of this chunk (fwd_walk_output.cuh); then the stage goes back to the aux.
    if constexpr (kOutput)
      store_o_chunk(o, st, sv, og, p.HV_stride, hv, v0, vh, seg_start + static_cast<int64_t>(c) * kGdnChunk, doc_end);
    if (c + kStages < nch) {
      wgmma::fence_proxy_async();  // this stage's reads and writes precede the TMA loads into it
      mma::bar_arrive(kBarEmpty + stage, kWalkThreads<kStateWgs>);
    }
  }

  // The end state (for an empty document: the initial state or zeros).
  S_end = parked_end[wg];
  if (S_end == nullptr) return;
  end_state(s, S_end, identity, col, t4);  // M_s^T when identity
}

}  // namespace cake::gdn_walk

#pragma once

// The reverse walk's state warpgroups (WalkMode::kReverse, fwd_walk.cu): the backward's
// walk of the state gradient (gdn/bwd_walk.h) on the forward walk's CTA. Each state
// warpgroup holds 64 value rows of dS^T (64 x 128 fp32, as the forward holds S^T) across
// a segment's chunks, from the last to the first; the aux warpgroup loads q, k, do (in v's
// stage tile), A and the gates, and forms P~ and the gate vectors exactly as for the
// forward's output (fwd_walk_loads.cuh): tail = e^(gl - gcum_j) / |k_j|,
// decay = -beta_m e^gcum_m / |k_m|, outq = scale e^gcum_i / |q_i|, gamma = e^gl. Per chunk, the
// forward's products in the transposed direction:
//   Y   = dS^T K^T                         RS  m64n64k128   (as U^T)
//   dv_new^T = Y diag(tail) + do^T P~      RS  m64n64k64 onto the scaled Y (do^T fragments;
//                                          P~ MN-major); bf16: X's operand and the dv_new output
//   X   = dv_new^T A                       RS  m64n64k64    (A MN-major; beta in decay)
//   dS^T = gamma dS^T + (X diag(decay)) K + (do^T diag(outq)) Q   RS  m64n128k64 x 2
// The dS tape (dS^T at the chunk's end, bf16) goes out as the forward's h tape does, from
// the fragments of Y's operand, staged after the ring (kHStageOff); dv_new as o does, into
// dv's [T, HV, 128] rows of the chunk's real tokens, staged in the warp's columns of the
// do tile once its do^T fragments are in registers. Rows past the document's end are zero
// in q, k and do (the aux zeroes them), so their P~, Y, dv_new and X entries are 0.

#include <cstdint>

#include <cuda_bf16.h>

#include "common/mma_sm80.cuh"
#include "common/swizzle.cuh"
#include "common/tma_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "gdn/fwd_walk_layout.cuh"
#include "gdn/fwd_walk_output.cuh"
#include "gdn/fwd_walk_state.cuh"
#include "gdn/fwd_walk_tapes.cuh"
#include "gdn/gdn.h"

namespace cake::gdn_walk {

// A reverse state warpgroup (wg of the CTA's): value rows v0 = 64 vh .. of one (segment,
// value head), from S0 = dS at the segment's end (K x V fp32, rows of 128; nullptr:
// zeros; identity: the K x K identity, a transfer's walk, do read as zeros) to S_end = dS
// at its start (same layout, transposed when identity as the forward's M_s^T; nullptr:
// not stored). kTapes (kReverse; not the summaries): the dS tape and dv_new per chunk. p
// as the reverse walk's launch sets it (fwd_walk.cu): v = do, o = dv_new. first_slot: the
// first chunk slot of the chunks walked; tapes.h: the dS tape.
template <bool kTapes, int kStateWgs>
__device__ __forceinline__ void reverse_state_warpgroup(const GdnFwdCoreArgs& p, unsigned char* smem,
                                                        uint32_t load_bar, int wg, int vh, int64_t hv,
                                                        int64_t seg_start, int64_t doc_end, int nch, const float* S0,
                                                        bool identity, float* S_end, int64_t first_slot,
                                                        WalkTapes tapes) {
  const int tid = threadIdx.x & 127, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int mi = lane >> 3, r8 = lane & 7;  // ldmatrix: this lane's matrix and row
  const int v0 = vh * kBV;
  __nv_bfloat16* dv_new = static_cast<__nv_bfloat16*>(p.o);
  // S_end is parked in shared memory across the loop, as the forward's (fwd_walk_state.cuh).
  __shared__ float* parked_end[kStateWgs];
  parked_end[wg] = S_end;

  // dS^T accumulator, as the forward's S^T (start_state, fwd_walk_state.cuh).
  float s[64];
  start_state(s, S0, identity, v0 + 16 * warp + gid, t4);

  for (int c = 0; c < nch; ++c) {
    const int stage = c % kStages;
    const int ch = nch - 1 - c;  // the segment's chunk of this step
    unsigned char* st = enter_stage<kStateWgs>(smem, load_bar, c, wg);  // chunk ch
    const uint32_t sq = mma::smem_addr(st + kQOff), sk = mma::smem_addr(st + kKOff);
    const uint32_t sdo = mma::smem_addr(st + kVOff), sa = mma::smem_addr(st + kAOff);
    const uint32_t sp = mma::smem_addr(st + kPOff);
    const float* gs = reinterpret_cast<const float*>(st + kGOff);
    const int64_t t0 = seg_start + static_cast<int64_t>(ch) * kGdnChunk;

    // (1) Group 1: Y = dS^T K^T; the dS tape (dS^T at the chunk's end) while it runs.
    uint32_t sfrag[8][4];
    wgmma::to_a_frags(sfrag, s);
    float y[32];
    wgmma::mma_rs_m64n64_fresh<0>(y, sfrag, sk);
    wgmma::commit();
    if constexpr (kTapes) {
      __nv_bfloat16* ds_rows = static_cast<__nv_bfloat16*>(tapes.h) +
                               (((first_slot + ch) * p.HV + hv) * kGdnHeadDim + v0 + 16 * warp) * kGdnHeadDim;
      store_h_chunk(sfrag, smem + kHStageOff + (4 * wg + warp) * 2048, ds_rows);
    }
    // do^T as A fragments (tokens = k): register r of k-step ks holds tokens
    // 16 ks + 8 (r >> 1) + 2 t4 (+1).
    uint32_t dofrag[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      mma::ldmatrix_x4_trans(dofrag[ks], sdo + sw128_offset(64, 16 * ks + (mi >> 1) * 8 + r8, 8 * vh + 2 * warp + (mi & 1)));

    // (2) Group 2: dv_new^T = Y diag(tail) + do^T P~, accumulated onto the scaled Y (a
    // second accumulator beside Y does not fit the state warpgroup's 216 registers);
    // rounded to bf16 once: X's operand and the output.
    wgmma::wait<0>();
    wgmma::fence_operands(y);
    mma::scale_columns(y, gs + kGTailK, t4);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::mma_rs_m64n64k16<1>(y, dofrag[ks], wgmma::desc_mn_major(sp, 64, ks), 1);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operands(y);
    uint32_t dvfrag[4][4];
    wgmma::to_a_frags(dvfrag, y);

    // (3) Group 3: X = dv_new^T A: B[j][m] = a[j][m], the A tile MN-major (its columns'
    // beta_m comes with the decay vector below).
    float x[32];
    wgmma::mma_rs_m64n64_fresh<1>(x, dvfrag, sa);
    wgmma::commit();
    // do^T diag(outq) in place of do^T (its product with P~ is done): fp32, rounded once more.
    mma::scale_token_frags(dofrag, gs + kGOutQ, t4);
    wgmma::wait<0>();
    wgmma::fence_operands(x);

    // (4) Group 4: dS^T = gamma dS^T + (X diag(decay)) K + (do^T diag(outq)) Q, K and Q MN-major.
    mma::scale_columns(x, gs + kGDecayK, t4);
    uint32_t xfrag[4][4];
    wgmma::to_a_frags(xfrag, x);
    decay_and_update(s, gs[kGGamma], xfrag, sk);  // gamma = e^gl
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::mma_rs_m64n128k16<1>(s, dofrag[ks], wgmma::desc_mn_major(sq, 64, ks), 1);
    wgmma::commit();
    if (kStateWgs == 2 && c == 0 && wg == 0) mma::bar_arrive(kBarStagger, 256);
    // dv_new of the chunk's real tokens, while the update runs (staged in the warp's own
    // columns of the do tile, whose fragments are in registers).
    if constexpr (kTapes) store_o_frags(dvfrag, st, sdo, dv_new, p.HV_stride, hv, v0, vh, t0, doc_end);
    wgmma::wait<0>();
    wgmma::fence_operands(s);

    if (c + kStages < nch) {
      wgmma::fence_proxy_async();  // this stage's reads and writes precede the TMA loads into it
      mma::bar_arrive(kBarEmpty + stage, kWalkThreads<kStateWgs>);
    }
  }

  // dS at the walk's start: dh0 at a document's first segment (for an empty document, dht
  // or zeros), a summary's F or M^T, else not stored.
  S_end = parked_end[wg];
  if (S_end == nullptr) return;
  // The thread's row and column offsets, read again from %tid (held across the loop they
  // take a register the loop needs).
  uint32_t t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  end_state(s, S_end, identity, v0 + 16 * ((t & 127) >> 5) + ((t & 31) >> 2), t & 3);
}

}  // namespace cake::gdn_walk

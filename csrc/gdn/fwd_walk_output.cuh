#pragma once

// The walk's o epilogue (fwd_walk_state.cuh): a state warpgroup's O^T of one chunk (its 64
// value columns x 64 tokens, fp32 accumulator) to o in bf16.
//
// Why it is as it is: O^T is staged (stmatrix.trans) into the warp's own, already
// consumed columns of the chunk's V tile and stored 16 bytes per lane, real token rows
// only: a ragged chunk never writes into the next document. The staging and stores sit
// on the state warpgroup's path, yet every way tried of moving them off it (later, by
// TMA, by the aux) was slower (docs/experiments.md): the SM's tensor, shared-memory and
// issue resources are shared by all three warpgroups, and work moved between them has
// not shortened the step.

#include <cstdint>

#include <cuda_bf16.h>

#include "common/mma_sm80.cuh"
#include "common/swizzle.cuh"
#include "common/wgmma_sm90.cuh"
#include "gdn/fwd_walk_layout.cuh"
#include "gdn/gdn.h"

namespace cake::gdn_walk {

// This warp's 16 value columns x 64 tokens, the A fragments of 4 k-steps (columns = tokens),
// staged transposed (stmatrix.trans) in its own, consumed columns of the chunk's V tile and
// read back by token: val[it] = token row 16 it + lane / 2, value columns 16 warp + 8 (lane & 1) ..
// st: the chunk's stage; sv: its V tile's shared address; vh: the warpgroup's half of the values.
__device__ __forceinline__ void stage_token_rows(const uint32_t (&frag)[4][4], const unsigned char* st, uint32_t sv,
                                                 int vh, uint4 (&val)[4]) {
  const int tid = threadIdx.x & 127, lane = tid & 31, warp = tid >> 5;
  const int mi = lane >> 3, r8 = lane & 7;  // stmatrix: this lane's matrix and row
#pragma unroll
  for (int jj = 0; jj < 4; ++jj)
    mma::stmatrix_x4_trans(sv + sw128_offset(64, 16 * jj + (mi >> 1) * 8 + r8, 8 * vh + 2 * warp + (mi & 1)), frag[jj]);
  __syncwarp();
  // All four rows read before any store: one shared-memory round trip, not four.
#pragma unroll
  for (int it = 0; it < 4; ++it)
    val[it] = *reinterpret_cast<const uint4*>(st + kVOff +
                                              sw128_offset(64, 16 * it + (lane >> 1), 8 * vh + 2 * warp + (lane & 1)));
}

// o rows t0 .. min(t0 + 64, doc_end) - 1, value columns v0 .. v0 + 63 of head hv, from
// this warpgroup's bf16 A fragments of them (columns = tokens, as the state warpgroup
// holds o). st: the chunk's stage; sv: its V tile's shared address; vh: the half v0 = 64 vh.
__device__ __forceinline__ void store_o_frags(const uint32_t (&r)[4][4], const unsigned char* st, uint32_t sv,
                                              __nv_bfloat16* og, int64_t HV, int64_t hv, int v0, int vh, int64_t t0,
                                              int64_t doc_end) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x & 127) >> 5;
  uint4 val[4];
  stage_token_rows(r, st, sv, vh, val);
  const int len = static_cast<int>(min(doc_end - t0, static_cast<int64_t>(kGdnChunk)));
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int row = 16 * it + (lane >> 1);
    if (row < len) mma::st_global_16(og + ((t0 + row) * HV + hv) * kGdnHeadDim + v0 + 16 * warp + 8 * (lane & 1), val[it]);
  }
}

// The same from the fp32 accumulator o.
__device__ __forceinline__ void store_o_chunk(const float (&o)[32], const unsigned char* st, uint32_t sv,
                                              __nv_bfloat16* og, int64_t HV, int64_t hv, int v0, int vh, int64_t t0,
                                              int64_t doc_end) {
  uint32_t r[4][4];
  wgmma::to_a_frags(r, o);
  store_o_frags(r, st, sv, og, HV, hv, v0, vh, t0, doc_end);
}

}  // namespace cake::gdn_walk

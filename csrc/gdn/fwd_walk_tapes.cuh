#pragma once

// The walk's tape epilogues (fwd_walk_state.cuh, tape mode): what the backward reads of
// the forward's walk (docs/kernels.md, "Backward tapes"), per chunk slot and value head,
// from a state warpgroup's registers:
//   h      [NC, HV, 128 (v), 128 (k)] bf16: S^T at the chunk's start, the bf16 A fragments
//          the warpgroup makes of it anyway for U^T = S^T K^T (sfrag);
//   v_new  [NC, HV, 64 (t), 128 (v)] bf16: X^T, X before its e^(gl - gcum) column scaling,
//          from the bf16 fragments made of it for the state update (xfrag); all 64 rows,
//          zeros past the document's end.
//
// Why it is as it is: both go out as 16-byte stores of whole 128-byte row pieces, staged
// per warp through shared memory (stmatrix; h as it is, v_new transposed as the o
// epilogue stages o, fwd_walk_output.cuh). h is staged in the Q tile of stage 0, which
// tape mode never loads (8 warps x 2 KB: 16 rows x 64 head dims, one half of the head
// dims at a time); v_new in the warp's own, already consumed columns of the chunk's V tile.
// The stores are issued while the tensor cores run the chunk's products (h after U^T's,
// v_new after the state update's), and the fragments are the ones the products read, so
// the tapes are bitwise the walk's bf16 operands.

#include <cstdint>

#include <cuda_bf16.h>

#include "common/mma_sm80.cuh"
#include "common/swizzle.cuh"
#include "gdn/fwd_walk_layout.cuh"
#include "gdn/fwd_walk_output.cuh"
#include "gdn/gdn.h"

namespace cake::gdn_walk {

// This warp's 16 value columns of S^T (rows of h) from the A fragments of its 8 k-steps:
// h_rows points at the first of the 16 rows (128 bf16 each); buf at the warp's 2 KB of
// staging (1024-aligned base).
__device__ __forceinline__ void store_h_chunk(const uint32_t (&sfrag)[8][4], unsigned char* buf,
                                              __nv_bfloat16* h_rows) {
  const int lane = threadIdx.x & 31;
  const int mi = lane >> 3, r8 = lane & 7;  // stmatrix: this lane's matrix and row
  const uint32_t b = mma::smem_addr(buf);
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // head dims 64 half ..
    // k-step j's fragment: matrices (rows 0-7 | 8-15) x (head dims 16 j .. | 16 j + 8 ..).
#pragma unroll
    for (int j = 0; j < 4; ++j)
      mma::stmatrix_x4(b + swizzle_rows_offset<8>((mi & 1) * 8 + r8, 2 * j + (mi >> 1)), sfrag[4 * half + j]);
    __syncwarp();
    uint4 val[4];
#pragma unroll
    for (int it = 0; it < 4; ++it)
      val[it] = *reinterpret_cast<const uint4*>(buf + swizzle_rows_offset<8>(4 * it + (lane >> 3), lane & 7));
#pragma unroll
    for (int it = 0; it < 4; ++it)
      mma::st_global_16(h_rows + (4 * it + (lane >> 3)) * kGdnHeadDim + 64 * half + 8 * (lane & 7), val[it]);
    __syncwarp();  // the staging is rewritten next
  }
}

// v_new rows 0 .. 63 of one chunk (token rows past len = min(doc_end - t0, 64) as zeros),
// value columns v0 .. v0 + 63 of this warpgroup (this warp: 16 of them), from the bf16
// fragments of X (columns = tokens). st: the chunk's stage; sv: its V tile's shared
// address; vh: the half v0 = 64 vh; vn_rows: row 0, column v0 of the chunk's v_new tile.
__device__ __forceinline__ void store_v_new_chunk(const uint32_t (&xfrag)[4][4], const unsigned char* st, uint32_t sv,
                                                  __nv_bfloat16* vn_rows, int vh, int64_t t0, int64_t doc_end) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x & 127) >> 5;
  uint4 val[4];
  stage_token_rows(xfrag, st, sv, vh, val);
  const int len = static_cast<int>(min(doc_end - t0, static_cast<int64_t>(kGdnChunk)));
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int row = 16 * it + (lane >> 1);
    mma::st_global_16(vn_rows + row * kGdnHeadDim + 16 * warp + 8 * (lane & 1),
                      row < len ? val[it] : make_uint4(0u, 0u, 0u, 0u));
  }
}

}  // namespace cake::gdn_walk

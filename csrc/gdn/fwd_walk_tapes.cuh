#pragma once

// The walk's tape epilogue (fwd_walk_state.cuh, tape mode): what the backward reads of
// the forward's walk (docs/kernels.md, "Backward tapes"), per chunk slot and value head,
// from a state warpgroup's registers:
//   h      [NC, HV, 128 (v), 128 (k)] bf16: S^T at the chunk's start, the bf16 A fragments
//          the warpgroup makes of it anyway for U^T = S^T K^T (sfrag).
// The backward forms v_new again from h (bwd_local.cu) rather than reading a tape of it:
// 16 KB less a chunk and value head to keep, for two products in the chunk-local kernel.
//
// Why it is as it is: h goes out as 16-byte stores of whole 128-byte row pieces, staged
// per warp through shared memory (stmatrix), in the Q tile of stage 0, which tape mode
// never loads (8 warps x 2 KB: 16 rows x 64 head dims, one half of the head dims at a
// time). The stores are issued while the tensor cores run U^T's product, and the
// fragments are the ones the product reads, so the tape is bitwise the walk's bf16 operand.

#include <cstdint>

#include <cuda_bf16.h>

#include "common/mma_sm80.cuh"
#include "common/swizzle.cuh"
#include "gdn/fwd_walk_layout.cuh"
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

}  // namespace cake::gdn_walk

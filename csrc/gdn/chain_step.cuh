#pragma once

// One step of a segment chain (the forward's, fwd_chain.cu; the backward's, bwd_chain.cu):
// a CTA of 128 threads owns 16 value columns of a 128 x 128 fp32 state; thread k holds
// row k of the new state and reads the previous one from shared memory as broadcasts.

#include "gdn/gdn.h"

namespace cake {

constexpr int kGdnChainCols = 16;                            // value columns per chain CTA: four float4
constexpr int kGdnChainTiles = kGdnHeadDim / kGdnChainCols;  // chain CTAs per (document, value head)
constexpr int kGdnChainQuads = kGdnChainCols / 4;

// Row k of a transfer stored transposed (element i at row[i * 128]): one coalesced line
// per warp and element, all 128 loads in flight at once.
__device__ __forceinline__ void load_transfer_row(float (&m)[kGdnHeadDim], const float* row) {
#pragma unroll
  for (int i = 0; i < kGdnHeadDim; ++i) m[i] = row[i * kGdnHeadDim];
}

// acc += sum_i m[i] tile[i], in the fixed order i = 0 .. 127 (plain FMAs: the bits depend
// only on the operands).
__device__ __forceinline__ void chain_fma(float4 (&acc)[kGdnChainQuads], const float (&m)[kGdnHeadDim],
                                          const float4 (*tile)[kGdnChainQuads]) {
#pragma unroll
  for (int i = 0; i < kGdnHeadDim; ++i) {
#pragma unroll
    for (int q = 0; q < kGdnChainQuads; ++q) {
      const float4 t = tile[i][q];
      acc[q].x = fmaf(m[i], t.x, acc[q].x);
      acc[q].y = fmaf(m[i], t.y, acc[q].y);
      acc[q].z = fmaf(m[i], t.z, acc[q].z);
      acc[q].w = fmaf(m[i], t.w, acc[q].w);
    }
  }
}

}  // namespace cake

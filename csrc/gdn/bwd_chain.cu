// The GDN backward's reverse walk of the state gradient (bwd_walk.h): its launch, and the
// chain of its cut walk. The walks themselves run on the forward walk's CTA in its two
// reverse modes (fwd_walk.cu, fwd_walk_reverse.cuh): per call,
//   1. the cuts' summaries (WalkMode::kReverseSummary; only where the walk is cut): per
//      (cut, value head), F, the segment after the cut walked back from zero over its
//      backward truncation window or the whole segment, and at an exact cut its transfer
//      M^T, walked from the identity with do read as zeros;
//   2. the chain (this file): per document with cuts, from its last segment down,
//      dS_end(s) = M_{s+1}^T dS_end(s + 1) + F_{s+1} at an exact cut, = F_{s+1} at a
//      truncated one, in place of F in seg_grad;
//   3. the tape walk (WalkMode::kReverse): per (segment, value head), the segment's
//      chunks from its end gradient (dht or the chained one), writing the dS tape and
//      dv_new; a document's first segment writes dh0.
//
// Why the chain is as it is (the forward's chain, fwd_chain.cu, walked the other way):
// - fp32 plain FMAs in a fixed order, so the bits depend only on the cut grid.
// - One CTA per (document with cuts, value head, 16 value columns): value columns never
//   mix, so 8 CTAs share a head's chain without talking. The grid is the static bound of
//   inner segments; the CTAs of a document's last inner segment run its chain.
// - Thread k owns row k of the CTA's tile; dS_end(s + 1) sits in shared memory, read as
//   broadcasts; M^T is stored so that thread k's loads of its row are coalesced.

#include <cstdint>

#include "common/varlen.cuh"
#include "gdn/bwd_walk.h"
#include "gdn/chain_step.cuh"
#include "gdn/chunks.cuh"
#include "gdn/gdn.h"

namespace cake {
namespace {

// Per (document with cuts, value head, 16 value columns), from its last segment down:
// seg_grad[cut after s] <- dS_end(s) (bwd_walk.h). Launched per inner segment; the CTAs
// of a document's last inner segment run its chain, the others return.
__global__ void __launch_bounds__(kGdnHeadDim) gdn_bwd_chain_kernel(const GdnBwdWalkArgs p) {
  __shared__ float4 tile[kGdnHeadDim][kGdnChainQuads];  // dS_end(s + 1) restricted to the CTA's columns
  const int64_t i = blockIdx.x / (p.HV * kGdnChainTiles);
  if (i >= p.seg_offsets[p.N] - p.N) return;
  const int64_t hv = blockIdx.x / kGdnChainTiles % p.HV;
  const int col = static_cast<int>(blockIdx.x % kGdnChainTiles) * kGdnChainCols;
  const int64_t slot = inner_segment_slot(p.seg_offsets, p.N, i);
  const int64_t n = slot - i;  // documents before n have seg_offsets[n] - n inner segments
  const int32_t first = p.seg_offsets[n];
  const int nseg = p.seg_offsets[n + 1] - first;
  if (slot != first + nseg - 2) return;  // not the document's last inner segment

  constexpr int64_t kMat = kGdnHeadDim * kGdnHeadDim;
  const int k = threadIdx.x;
  const int64_t inner0 = first - n;  // segment 0's inner index
  {
    const float4* e = reinterpret_cast<const float4*>(p.dht + (n * p.HV_stride + hv) * kMat + k * kGdnHeadDim + col);
#pragma unroll
    for (int q = 0; q < kGdnChainQuads; ++q) tile[k][q] = p.dht != nullptr ? e[q] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  for (int s = nseg - 2; s >= 0; --s) {
    const int64_t at = (inner0 + s) * p.HV + hv;
    float4* g = reinterpret_cast<float4*>(p.seg_grad + at * kMat + k * kGdnHeadDim + col);
    float4 acc[kGdnChainQuads];
#pragma unroll
    for (int q = 0; q < kGdnChainQuads; ++q) acc[q] = g[q];
    if (p.seg_exact[at]) {  // the same flag for the whole CTA
      float mrow[kGdnHeadDim];  // row k of M^T's matrix
      load_transfer_row(mrow, p.seg_transfer + at * kMat + k);
      __syncthreads();  // the tile holds dS_end(s + 1)
      chain_fma(acc, mrow, tile);
    }
#pragma unroll
    for (int q = 0; q < kGdnChainQuads; ++q) g[q] = acc[q];
    __syncthreads();  // every thread has read dS_end(s + 1)
#pragma unroll
    for (int q = 0; q < kGdnChainQuads; ++q) tile[k][q] = acc[q];
  }
}

}  // namespace

cudaError_t gdn_bwd_chain_launch(const GdnBwdWalkArgs& p, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0 || p.inner_slots <= 0) return cudaSuccess;
  gdn_bwd_chain_kernel<<<static_cast<unsigned>(p.inner_slots * p.HV * kGdnChainTiles), kGdnHeadDim, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t gdn_bwd_walk_launch(const GdnBwdWalkArgs& p, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  if (p.inner_slots > 0) {
    cudaError_t err = gdn_bwd_reverse_summary_launch(p, stream);
    if (err == cudaSuccess) err = gdn_bwd_chain_launch(p, stream);
    if (err != cudaSuccess) return err;
  }
  return gdn_bwd_reverse_walk_launch(p, stream);
}

}  // namespace cake

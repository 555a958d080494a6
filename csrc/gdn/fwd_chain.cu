// The chain of a segmented GDN forward walk (gdn.h; docs/kernels.md, "Exact cuts and the
// chain"): per (document, value head), in segment order,
// S_start(s + 1) = M_s S_start(s) + E_s,  s = 1 .. P - 2, where S_start(1) = E_0 (segment
// 0's walk already started from the initial state), and S_start(s + 1) = E_s at a
// truncated cut (seg_exact = 0: no M_s was formed).
// In place: seg_state[slot of s] holds E_s before and S_start(s + 1) after.
//
// Why it is as it is:
// - fp32 throughout (a bf16 transfer chain diverges; docs/contract.md, "Accuracy"); plain
//   FMAs in a fixed order, so the bits depend only on the cut grid.
// - One CTA per (chained document, value head, 16 value columns): the value columns never
//   mix, so 8 CTAs share a head's chain without talking; each step is 128 x 128 x 16 MACs
//   plus one 64 KB read of M_s (from L2: the summaries wrote it just before). The chain
//   is serial, so a step's latency is what counts, not its throughput.
// - Only documents with >= 3 segments have a step. The grid covers the bound on their
//   number (gdn_fwd_chain_doc_slots; the plan lists them in chain_docs), not every
//   document: CTAs that return at once cost about as much each as real work.
// - Thread k owns row k of the CTA's tile; the previous start state's tile sits in
//   shared memory, read as broadcasts. M_s is stored transposed, so a warp's loads of
//   row k = lane's element i are one 128-byte line (loading rows directly, a float4 per
//   lane, costs 32 L1 wavefronts a load).

#include <cassert>  // __assert_fail (glibc), what a device assert calls
#include <cstdio>

#include "gdn/chain_step.cuh"
#include "gdn/gdn.h"
#include "gdn/plan.h"

namespace cake {
namespace {

constexpr int kChainThreads = kGdnHeadDim;                      // thread k owns row k

__global__ void __launch_bounds__(kChainThreads) gdn_fwd_chain_kernel(const GdnFwdArgs p) {
  __shared__ float4 tile[kGdnHeadDim][kGdnChainQuads];  // S_start(s) restricted to the CTA's columns
  const int32_t n = p.chain_docs[blockIdx.x / (p.HV * kGdnChainTiles)];
  if (n < 0) return;  // past the documents with a chain
  const int64_t hv = blockIdx.x / kGdnChainTiles % p.HV;
  const int col = static_cast<int>(blockIdx.x % kGdnChainTiles) * kGdnChainCols;
  const int32_t first = p.seg_offsets[n];
  const int nseg = p.seg_offsets[n + 1] - first;
  if (nseg <= 2) return;  // S_start(1) = E_0 is in place already

  constexpr int64_t kMat = kGdnHeadDim * kGdnHeadDim;
  const int k = threadIdx.x;
  const int64_t inner = first - n;  // segment 0's inner index (the seg_ workspaces hold inner segments)
  float* state = p.seg_state + (inner * p.HV + hv) * kMat;
  const float* transfer = p.seg_transfer + (inner * p.HV + hv) * kMat;
  const int64_t step = p.HV * kMat;  // from one segment's matrix to the next

  {
    const float4* e0 = reinterpret_cast<const float4*>(state + k * kGdnHeadDim + col);
#pragma unroll
    for (int q = 0; q < kGdnChainQuads; ++q) tile[k][q] = e0[q];
  }
  for (int s = 1; s + 1 < nseg; ++s) {
    const float4* e = reinterpret_cast<const float4*>(state + s * step + k * kGdnHeadDim + col);
    float4 acc[kGdnChainQuads];
#pragma unroll
    for (int q = 0; q < kGdnChainQuads; ++q) acc[q] = e[q];
    // A truncated cut (the same flag for the whole CTA): S_start(s + 1) = E_s, in place.
    if (p.seg_exact[(inner + s) * p.HV + hv]) {
      // Row k of M_s (column k of M_s^T), all loads in flight at once: a step then costs
      // one L2 round trip plus its FMAs.
      float mrow[kGdnHeadDim];
      load_transfer_row(mrow, transfer + s * step + k);
      __syncthreads();  // the tile holds S_start(s)
      chain_fma(acc, mrow, tile);
      float4* out = reinterpret_cast<float4*>(state + s * step + k * kGdnHeadDim + col);
#pragma unroll
      for (int q = 0; q < kGdnChainQuads; ++q) out[q] = acc[q];
      __syncthreads();  // every thread has read S_start(s)
    }
    // (After a truncated step no thread reads the tile before the next exact step's barrier.)
#pragma unroll
    for (int q = 0; q < kGdnChainQuads; ++q) tile[k][q] = acc[q];
  }
}

}  // namespace

namespace {

// Per (document, value head), the real segment of a piece between two empty segments:
// its values row by row (float4s), its transfer back from the stored transpose through
// 32 x 32 shared-memory tiles (both sides' accesses are then whole lines), zeros at a
// truncated cut. 128 threads: four warps, eight rows of a tile each.
__global__ void __launch_bounds__(kGdnHeadDim) gdn_piece_summaries_kernel(const GdnPieceSummariesArgs p) {
  constexpr int64_t kMat = kGdnHeadDim * kGdnHeadDim;
  constexpr int kTile = 32, kTiles = kGdnHeadDim / kTile, kRows = kTile / (kGdnHeadDim / 32);
  __shared__ float tile[kTile][kTile + 1];  // +1: the transposed reads hit 32 banks
  const int64_t n = blockIdx.x / p.HV, hv = blockIdx.x % p.HV;
  const int32_t first = p.seg_offsets[n];
  const int nseg = p.seg_offsets[n + 1] - first;
  if (nseg != 3) {
    if (threadIdx.x == 0)
      printf("cake gdn_segment_summaries / gdn_segment_grad_summaries: document %lld has %d segments; each must be "
             "flagged to open and close inside (doc_flags 1 | 2) and be at most one segment of its cut grid\n",
             static_cast<long long>(n), nseg - 2);
    __assert_fail("a document is not one segment between two empty ones", __FILE__, __LINE__, __func__);
  }
  const int64_t at = (first - n + p.shift) * p.HV + hv;  // the real segment's inner index
  const int64_t out = (n * p.out_HV + p.hv0 + hv) * kMat;
  const float4* e = reinterpret_cast<const float4*>(p.seg_state + at * kMat);
  float4* ve = reinterpret_cast<float4*>(p.values + out);
  for (int i = threadIdx.x; i < kMat / 4; i += kGdnHeadDim) ve[i] = e[i];

  const bool exact = p.seg_exact[at] != 0;  // the same for the whole CTA
  const float* stored = p.seg_transfer + at * kMat;  // stored[r][c] = M[c][r]
  float* m = p.transfers + out;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int bi = 0; bi < kTiles; ++bi) {
    for (int bj = 0; bj < kTiles; ++bj) {
      for (int i = 0; i < kRows; ++i) {
        const int r = warp * kRows + i;
        tile[r][lane] = exact ? stored[(bi * kTile + r) * kGdnHeadDim + bj * kTile + lane] : 0.f;
      }
      __syncthreads();
      for (int i = 0; i < kRows; ++i) {  // M[bj * 32 + r][bi * 32 + lane] = stored[bi * 32 + lane][bj * 32 + r]
        const int r = warp * kRows + i;
        m[(bj * kTile + r) * kGdnHeadDim + bi * kTile + lane] = tile[lane][r];
      }
      __syncthreads();
    }
  }
}

}  // namespace

cudaError_t gdn_piece_summaries_launch(const GdnPieceSummariesArgs& p, cudaStream_t stream) {
  const int64_t blocks = p.N * p.HV;
  if (blocks <= 0) return cudaSuccess;
  if (p.seg_offsets == nullptr || p.seg_state == nullptr || p.seg_transfer == nullptr || p.seg_exact == nullptr)
    return cudaErrorInvalidValue;
  gdn_piece_summaries_kernel<<<static_cast<unsigned>(blocks), kGdnHeadDim, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t gdn_state_chain_launch(const GdnFwdArgs& p, int64_t chain_slots, cudaStream_t stream) {
  const int64_t blocks = chain_slots * p.HV * kGdnChainTiles;
  if (p.N <= 0 || blocks <= 0) return cudaSuccess;
  gdn_fwd_chain_kernel<<<static_cast<unsigned>(blocks), kChainThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t gdn_fwd_chain_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  if (p.seg_chunks <= 0) return cudaSuccess;
  return gdn_state_chain_launch(p, gdn_fwd_chain_doc_slots(p.T, p.N, p.seg_chunks, p.doc_flags != nullptr), stream);
}

}  // namespace cake

// The plan of the GDN forward (see gdn_fwd.h): the check of cu_seqlens, where each
// document's chunks and segments sit in the static slot grids, and the host's choice of
// the cut grid.
//
// NOTES:
// - The offsets are computed on the device (no host sync, CUDA-graph safe); launch sizes
//   use only the bounds gdn_fwd_chunk_slots / gdn_fwd_segment_slots, and CTAs past a
//   document's real chunks or segments return at once.
// - cu_seqlens's values are checked here, by the first kernel of the forward, not by
//   torch ops before it (about 8 small kernels and 50 us of host time a call): a bad
//   array stops the stream with a device-side assert naming it (as torch._assert_async
//   would), before any other stage reads it.
// - The non-deterministic cut grid comes from a cost model over static shapes only (T, N,
//   HV, SM count): the document lengths are on the device and reading them would sync.
// - The deterministic grid halves for a long document that alone would leave SMs idle
//   (gdn_fwd_choose_segment_long_max): s16k_long (one document of 256 chunks, HV = 16),
//   at 32 chunks, 8 segments x 16 heads walk unsplit where 4 x 16 walked split by value
//   columns: walk 0.106 -> 0.085 ms, summaries 0.043 -> 0.045, forward 0.210 -> 0.193
//   (tools/ab_csrc.py, against the same code on the 64-chunk grid). The rule reads the
//   document's length and HV, never its neighbours or the SM count, so its bits stay its
//   own; packs of 4096-token documents (s64k_h16, s256k_h2, s16k_h8) are not cut, and
//   documents of fewer than 256 chunks keep the 64-chunk grid (s32k_h16's three
//   documents already fill the GPU).

#include <algorithm>
#include <cassert>  // __assert_fail (glibc), what a device assert calls
#include <cmath>
#include <cstdio>

#include "gdn_chunks.cuh"
#include "gdn_fwd.h"

namespace cake {
namespace {

// Inclusive block-wide sum of x (blockDim.x = 1024) and the block's total.
__device__ __forceinline__ int32_t block_inclusive_scan(int32_t x, int32_t* warp_sums, int32_t& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int32_t s = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    warp_sums[lane] = s;
  }
  __syncthreads();
  total = warp_sums[nwarps - 1];
  const int32_t result = x + (warp > 0 ? warp_sums[warp - 1] : 0);
  __syncthreads();  // warp_sums is rewritten by the next call
  return result;
}

// cu_seqlens must start at 0, never decrease and end at T: else the values around the
// first violation this thread sees are printed and the kernel asserts (the CUDA context
// is then unusable, as after any device-side assert).
__device__ __forceinline__ void check_cu_seqlens(const CuSeqlens& cu, int64_t n, int64_t N, int64_t T) {
  const int64_t lo = cu[n], hi = cu[n + 1];
  if ((n == 0 && lo != 0) || hi < lo || (n == N - 1 && hi != T)) {
    printf("cake gdn_fwd: cu_seqlens must start at 0, be non-decreasing and end at T = %lld; got "
           "cu_seqlens[%lld] = %lld, cu_seqlens[%lld] = %lld\n",
           static_cast<long long>(T), static_cast<long long>(n), static_cast<long long>(lo),
           static_cast<long long>(n + 1), static_cast<long long>(hi));
    __assert_fail("cu_seqlens must start at 0, be non-decreasing and end at T", __FILE__, __LINE__, __func__);
  }
}

// chunk_offsets[n] = sum over m < n of ceil(len_m / 64); seg_offsets[n] = sum over m < n
// of max(1, ceil(chunks_m / grid_m)), grid_m = doc_cut_chunks(chunks_m, ...) (one segment
// per document when seg_chunks = 0);
// chain_docs (chain_slots entries, see gdn_fwd.h): the documents with >= 3 segments in
// order, then -1; walk_queue (if cut): 0, the summaries' first walk.
__global__ void __launch_bounds__(1024) gdn_fwd_plan_kernel(CuSeqlens cu, int64_t N, int64_t T, int seg_chunks,
                                                            int long_max, int32_t* chunk_offsets, int32_t* seg_offsets,
                                                            int32_t* chain_docs, int32_t chain_slots,
                                                            int32_t* walk_queue) {
  __shared__ int32_t warp_sums[3][32];
  if (threadIdx.x == 0) {
    chunk_offsets[0] = seg_offsets[0] = 0;
    if (walk_queue != nullptr) *walk_queue = 0;
  }
  int32_t chunk_carry = 0, seg_carry = 0, chain_carry = 0;
  for (int64_t base = 0; base < N; base += blockDim.x) {
    const int64_t n = base + threadIdx.x;
    int32_t chunks = 0, segs = 0;
    if (n < N) {
      check_cu_seqlens(cu, n, N, T);
      const int64_t len = cu[n + 1] - cu[n];
      chunks = len > 0 ? static_cast<int32_t>((len + kGdnChunk - 1) / kGdnChunk) : 0;
      const int grid = doc_cut_chunks(chunks, seg_chunks, long_max);
      segs = grid > 0 ? max(1, (chunks + grid - 1) / grid) : 1;
    }
    const int32_t chained = segs >= 3 ? 1 : 0;
    int32_t chunk_total, seg_total, chain_total;
    const int32_t chunk_end = block_inclusive_scan(chunks, warp_sums[0], chunk_total);
    const int32_t seg_end = block_inclusive_scan(segs, warp_sums[1], seg_total);
    const int32_t chain_end = block_inclusive_scan(chained, warp_sums[2], chain_total);
    if (n < N) {
      chunk_offsets[n + 1] = chunk_carry + chunk_end;
      seg_offsets[n + 1] = seg_carry + seg_end;
      // chain_carry + chain_end - 1 < chain_slots: gdn_fwd_chain_doc_slots bounds the count.
      if (chained) chain_docs[chain_carry + chain_end - 1] = static_cast<int32_t>(n);
    }
    chunk_carry += chunk_total;
    seg_carry += seg_total;
    chain_carry += chain_total;
  }
  for (int32_t j = chain_carry + threadIdx.x; j < chain_slots; j += blockDim.x) chain_docs[j] = -1;
}

// 2 where a launch of about `ctas` CTAs fits in one wave of sm_count when split.
int value_splits_for(double ctas, int sm_count) { return 2.0 * ctas <= sm_count ? 2 : 1; }

}  // namespace

cudaError_t gdn_fwd_plan_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  if (p.N <= 0) return cudaSuccess;
  gdn_fwd_plan_kernel<<<1, 1024, 0, stream>>>(CuSeqlens{p.cu_seqlens, p.cu_int64}, p.N, p.T, p.seg_chunks,
                                              p.seg_long_max, p.chunk_offsets, p.seg_offsets, p.chain_docs,
                                              static_cast<int32_t>(gdn_fwd_chain_doc_slots(p.T, p.N, p.seg_chunks)),
                                              p.walk_queue);
  return cudaGetLastError();
}

// Cost model, in units of one chunk step of the walk with output on one SM (~2.75 us on
// an H200), fitted to tools/gdn_fwd_gpu_check.py --segments sweeps at the benchmark's
// mamba gate. The walk: units of one length (whole documents) run in whole waves of
// sm_count; cut pieces are ragged (a document's last is short), so they count in
// fractional waves; a launch that fits in one wave when split by value columns
// (value_splits_for) takes kSplitStep of a step per chunk. Summaries: most cuts
// are truncated (gdn_fwd.h) and cost a short walk each, about kSummaryWave per wave of
// them; the exact ones (slow heads) walk E_s and M_s over the whole segment, about
// kSummaryStep a chunk, alongside. The chain: kChainStep a segment. A cut plan must win by
// kMargin. Documents are taken as equally long (T / N): their lengths are on the device.
int gdn_fwd_choose_segment_chunks(int64_t T, int64_t N, int64_t HV, bool deterministic, int sm_count) {
  if (deterministic) return kGdnDetSegChunks;
  if (N <= 0 || T <= 0 || sm_count <= 0) return 0;
  constexpr double kSummaryWave = 6.5, kSummaryStep = 0.25, kChainStep = 0.9, kMargin = 0.85, kSplitStep = 0.66;
  const double chunks = std::ceil(static_cast<double>(T) / kGdnChunk / static_cast<double>(N));
  const double walks = static_cast<double>(N * HV);
  auto split = [&](double ctas) { return value_splits_for(ctas, sm_count) == 2 ? kSplitStep : 1.0; };
  auto waves = [&](double units) { return std::ceil(units / sm_count); };
  auto ragged_waves = [&](double units) { return std::max(1.0, units / sm_count); };
  const double uncut = split(walks) * waves(walks) * chunks;
  double best = kMargin * uncut;
  int best_g = 0;
  for (int g : {16, 24, 32, 48, 64, 96, 128}) {
    const double segs = std::ceil(chunks / g);
    if (segs < 2) continue;
    const double summary_units = 2 * walks * (segs - 1);
    const double summaries = split(summary_units) * (kSummaryWave * waves(walks * (segs - 1)) + kSummaryStep * g);
    const double cost = summaries + (segs - 2) * kChainStep + split(walks * segs) * ragged_waves(walks * segs) * g;
    if (cost < best) best = cost, best_g = g;
  }
  return best_g;
}

int gdn_fwd_choose_segment_long_max(int64_t HV, bool deterministic) {
  if (!deterministic || HV <= 0) return 0;
  const int64_t long_max = kGdnDetSegChunks * ((kGdnDetFillWalks + HV - 1) / HV - 1);
  return long_max >= 4 * kGdnDetSegChunks ? static_cast<int>(long_max) : 0;
}

void gdn_fwd_choose_value_splits(GdnFwdArgs& a, int sm_count) {
  // Segments per document, the documents taken as equally long (their lengths are on the device).
  double segs = 1.0;
  if (a.N > 0 && a.T > 0 && a.seg_chunks > 0) {
    const double chunks = std::ceil(static_cast<double>(a.T) / kGdnChunk / static_cast<double>(a.N));
    segs = std::max(1.0, std::ceil(chunks / doc_cut_chunks(static_cast<int>(chunks), a.seg_chunks, a.seg_long_max)));
  }
  const double walks = static_cast<double>(std::max<int64_t>(a.N, 0) * a.HV);
  a.walk_splits = value_splits_for(walks * segs, sm_count);
  a.summary_splits = value_splits_for(2.0 * walks * (segs - 1.0), sm_count);  // E and M of each inner segment
}

}  // namespace cake

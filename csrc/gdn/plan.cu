// The plan of the GDN forward (plan.h): on the device, the check of cu_seqlens and where
// each document's chunks and segments sit in the static slot grids; on the host, the cut
// grid, the value splits and the workspace layout.
//
// Why it is as it is (docs/kernels.md, "Plan and cut grid"):
// - The offsets are computed on the device (no host sync, CUDA-graph safe); launch sizes
//   use only the bounds gdn_fwd_chunk_slots / gdn_fwd_segment_slots, and CTAs past a
//   document's real chunks or segments return at once.
// - cu_seqlens's values are checked here, by the first kernel of the forward, not by
//   torch ops before it (several small kernels and host time on every call): a bad
//   array stops the stream with a device-side assert naming it (as torch._assert_async
//   would), before any other stage reads it.
// - The non-deterministic cut grid comes from a cost model over static shapes only (T, N,
//   HV, SM count): the document lengths are on the device and reading them would sync.
// - The deterministic grid halves for a long document that alone would leave SMs idle
//   (gdn_fwd_choose_segment_long_max): more, unsplit walks beat fewer split ones there.
//   The rule reads the document's length and HV, never its neighbours or the SM count,
//   so its bits stay its own.

#include <algorithm>
#include <cassert>  // __assert_fail (glibc), what a device assert calls
#include <cmath>
#include <cstdio>

#include "common/scan.cuh"
#include "gdn/chunks.cuh"
#include "gdn/gdn.h"
#include "gdn/plan.h"

namespace cake {
namespace {

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

// doc_flags[n] must hold only gdn.h's bits, at most one grid bit, and the half grid's
// only where the call has a half grid (its slot bounds, gdn_fwd_finest_cut_chunks, are
// for the grids the call can cut at): else the kernel asserts, as for cu_seqlens.
__device__ __forceinline__ void check_doc_flags(uint8_t flags, int64_t n, int seg_chunks, int long_max) {
  const bool bad = (flags & ~kGdnDocFlagBits) != 0 || ((flags & kGdnHalfGrid) && (flags & kGdnFullGrid)) ||
                   ((flags & kGdnHalfGrid) && !(seg_chunks > 1 && long_max > 2 * seg_chunks));
  if (bad) {
    printf("cake gdn_fwd: doc_flags[%lld] = %d: its bits must be of 1, 2, 4, 8, with at most one of 4 and 8, and 4 "
           "(the half grid) only where the call's plan has a half grid (deterministic, HV < 43)\n",
           static_cast<long long>(n), static_cast<int>(flags));
    __assert_fail("doc_flags holds a bit the call cannot honour", __FILE__, __LINE__, __func__);
  }
}

// chunk_offsets[n] = sum over m < n of ceil(len_m / 64); seg_offsets[n] = sum over m < n
// of max(1, ceil(chunks_m / grid_m)), grid_m = doc_cut_chunks(chunks_m, ...) (one segment
// per document when seg_chunks = 0), plus the empty segments of doc_flags (gdn.h);
// chain_docs (chain_slots entries, see gdn.h): the documents with >= 3 segments in
// order, then -1; walk_queue (if cut): 0, the summaries' first walk.
__global__ void __launch_bounds__(1024) gdn_fwd_plan_kernel(CuSeqlens cu, int64_t N, int64_t T, int seg_chunks,
                                                            int long_max, const uint8_t* doc_flags,
                                                            int32_t* chunk_offsets, int32_t* seg_offsets,
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
      const uint8_t flags = doc_flags != nullptr ? doc_flags[n] : 0;
      if (doc_flags != nullptr) check_doc_flags(flags, n, seg_chunks, long_max);
      const int grid = doc_cut_chunks(chunks, seg_chunks, long_max, flags);
      segs = grid > 0 ? max(1, (chunks + grid - 1) / grid) : 1;
      segs += empty_segments(flags);
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

// 2 where a launch of about `ctas` CTAs fits in one wave of sm_count when split
// (docs/kernels.md, "Value split").
int value_splits_for(double ctas, int sm_count) { return 2.0 * ctas <= sm_count ? 2 : 1; }

// The summaries' split, for `walks` summary walks (E and M of each inner segment): most
// are short (truncated cuts) and the launch lasts as long as its few whole-segment walks
// (exact cuts, on slow heads), whose chunk steps the split shortens to about two thirds.
// So it splits up to kSummarySplitWaves waves of walks, not only within one; past a few
// waves the launch is bound by the walks' sum, which the split raises by about a third.
constexpr double kSummarySplitWaves = 4.0;
int summary_splits_for(double walks, int sm_count) { return walks <= kSummarySplitWaves * sm_count ? 2 : 1; }

// The value splits of the walk and summary launches for a plan's shapes and cut grid.
void choose_value_splits(GdnPlan& p) {
  // Segments per document, the documents taken as equally long (their lengths are on the device).
  double segs = 1.0;
  if (p.N > 0 && p.T > 0 && p.seg_chunks > 0) {
    const double chunks = std::ceil(static_cast<double>(p.T) / kGdnChunk / static_cast<double>(p.N));
    segs = std::max(1.0, std::ceil(chunks / doc_cut_chunks(static_cast<int>(chunks), p.seg_chunks, p.seg_long_max)));
  }
  const double walks = static_cast<double>(std::max<int64_t>(p.N, 0) * p.HV);
  p.walk_splits = value_splits_for(walks * segs, p.sm_count);
  p.summary_splits = summary_splits_for(2.0 * walks * (segs - 1.0), p.sm_count);
}

// Byte offsets of consecutive pieces of one buffer, 256-byte aligned.
struct Carve {
  int64_t bytes = 0;
  int64_t take(int64_t n) {
    const int64_t at = bytes;
    bytes += (n + 255) / 256 * 256;
    return at;
  }
};

}  // namespace

cudaError_t gdn_fwd_plan_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  if (p.N <= 0) return cudaSuccess;
  gdn_fwd_plan_kernel<<<1, 1024, 0, stream>>>(
      CuSeqlens{p.cu_seqlens, p.cu_int64}, p.N, p.T, p.seg_chunks, p.seg_long_max, p.doc_flags, p.chunk_offsets,
      p.seg_offsets, p.chain_docs,
      static_cast<int32_t>(gdn_fwd_chain_doc_slots(p.T, p.N, p.seg_chunks, p.doc_flags != nullptr)), p.walk_queue);
  return cudaGetLastError();
}

// Cost model, in units of one chunk step of the walk with output on one SM (~2.75 us on
// an H200), fitted to tools/gdn_fwd_gpu_check.py --segments sweeps at the benchmark's
// mamba gate (docs/benchmark.md, "Shapes"). The walk: units of one length (whole
// documents) run in whole waves of sm_count; cut pieces are ragged (a document's last is
// short), so they count in fractional waves; a launch that fits in one wave when split by
// value columns (value_splits_for) takes kSplitStep of a step per chunk. Summaries: most
// cuts are truncated and cost a short walk each, about kSummaryWave per wave of them;
// the exact ones (slow heads) walk E_s and M_s over the whole segment, about kSummaryStep
// a chunk, alongside; priced as split where value_splits_for would split them, the rule
// the model was fitted under. The launch splits them more often (summary_splits_for),
// which the model does not credit, so that it keeps choosing the grids measured when it
// was fitted. The chain: kChainStep a segment. A cut plan must win by kMargin.
// Documents are taken as equally long (T / N): their lengths are on the device.
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
  return long_max > 2 * kGdnDetSegChunks ? static_cast<int>(long_max) : 0;
}

int gdn_bwd_choose_head_slices(int64_t T, int64_t N, int64_t H, int64_t HV, int seg_chunks, int seg_long_max,
                               int sm_count, int64_t workspace_bytes) {
  if (N <= 0 || T <= 0 || sm_count <= 0 || H % kGdnMaxHeadSlices != 0) return 1;
  if (workspace_bytes > kGdnBwdSliceBytes) return kGdnMaxHeadSlices;
  // The documents taken as equally long: segments of `len` chunks, `steps` chunk steps a SM.
  const double chunks = std::ceil(static_cast<double>(T) / kGdnChunk / static_cast<double>(N));
  const int grid = seg_chunks > 0 ? doc_cut_chunks(static_cast<int>(chunks), seg_chunks, seg_long_max) : 0;
  const double len = grid > 0 ? std::min<double>(chunks, grid) : chunks;
  const double steps = static_cast<double>(N) * chunks * static_cast<double>(HV) / sm_count;
  auto walk_time = [&](int s) { return s * std::ceil(steps / s / len) * len; };
  return walk_time(kGdnMaxHeadSlices) <= walk_time(1) ? kGdnMaxHeadSlices : 1;
}

namespace {

// The plan for a given cut grid: the value splits (for H, HV heads) and the workspace layout.
// The per-chunk block has the tapes when with_tapes, and lives apart from the workspace
// when chunks_apart.
GdnPlan plan_for_grid(int64_t T, int64_t N, int64_t H, int64_t HV, bool use_qk_l2norm, int sm_count, int seg_chunks,
                      int seg_long_max, int value_splits, bool with_tapes, bool chunks_apart, bool doc_flags) {
  GdnPlan p{};
  p.chunks_apart = chunks_apart;
  p.doc_flags = doc_flags;
  p.T = T;
  p.N = N;
  p.H = H;
  p.HV = HV;
  p.head_slices = 1;
  p.use_qk_l2norm = use_qk_l2norm;
  p.sm_count = sm_count;
  p.seg_chunks = seg_chunks;
  p.seg_long_max = seg_long_max;
  if (value_splits > 0) p.walk_splits = p.summary_splits = value_splits;
  else choose_value_splits(p);

  p.chunk_slots = gdn_fwd_chunk_slots(T, N);
  // Inner segment slots (the segments that are not their document's last): the seg_ workspaces.
  p.inner_slots = p.seg_chunks > 0 ? gdn_fwd_inner_segment_slots(
                                         T, gdn_fwd_finest_cut_chunks(p.seg_chunks, p.seg_long_max), N, doc_flags)
                                   : 0;
  p.chain_slots = gdn_fwd_chain_doc_slots(T, N, p.seg_chunks, doc_flags);
  const int64_t NI = p.inner_slots;
  constexpr int64_t kMatBytes = kGdnHeadDim * kGdnHeadDim * 4;
  Carve c;
  GdnWorkspaceLayout& w = p.ws;
  w.chunk_offsets = c.take((N + 1) * 4);
  w.seg_offsets = c.take((N + 1) * 4);
  w.seg_state = c.take(NI * HV * kMatBytes);
  w.seg_transfer = c.take(NI * HV * kMatBytes);
  w.seg_exact = c.take(NI * HV * 4);
  w.chain_docs = c.take(p.chain_slots * 4);
  w.walk_queue = c.take(4);
  w.chunk = gdn_chunk_layout(T, N, H, HV, use_qk_l2norm, with_tapes);
  w.chunks = c.take(chunks_apart ? 0 : w.chunk.bytes);
  w.bytes = c.bytes;
  return p;
}

}  // namespace

GdnChunkLayout gdn_chunk_layout(int64_t T, int64_t N, int64_t H, int64_t HV, bool use_qk_l2norm, bool with_tapes) {
  const int64_t tiles = gdn_fwd_chunk_slots(T, N) * HV;  // (chunk slot, value head) tiles
  constexpr int64_t kATile = kGdnChunk * kGdnChunk * 2, kStateTile = kGdnHeadDim * kGdnHeadDim * 2;
  Carve c;
  GdnChunkLayout l{};
  l.with_tapes = with_tapes;
  l.a = c.take(tiles * kATile);
  l.gcum = c.take(tiles * kGdnChunk * 4);
  l.chunk_beta = c.take(tiles * kGdnChunk * 4);
  l.chunk_decay = c.take(tiles * 4);
  l.qk_lrn = c.take(use_qk_l2norm ? gdn_fwd_chunk_slots(T, N) * H * 2 * kGdnChunk * 4 : 0);
  l.h_tape = c.take(with_tapes ? tiles * kStateTile : 0);
  l.bytes = c.bytes;
  return l;
}

GdnPlan gdn_fwd_make_plan(int64_t T, int64_t N, int64_t H, int64_t HV, bool use_qk_l2norm, bool deterministic,
                          int sm_count, int segment_chunks, int value_splits, bool keep_tapes, bool doc_flags) {
  const int seg_chunks =
      segment_chunks >= 0 ? segment_chunks : gdn_fwd_choose_segment_chunks(T, N, HV, deterministic, sm_count);
  // An explicit grid (tests, sweeps) cuts every document alike.
  const int seg_long_max = segment_chunks >= 0 ? 0 : gdn_fwd_choose_segment_long_max(HV, deterministic);
  return plan_for_grid(T, N, H, HV, use_qk_l2norm, sm_count, seg_chunks, seg_long_max, value_splits, keep_tapes,
                       keep_tapes, doc_flags);
}

GdnPlan gdn_bwd_make_plan(int64_t T, int64_t N, int64_t H, int64_t HV, bool use_qk_l2norm, bool deterministic,
                          int sm_count, int segment_chunks, int value_splits, int head_slices, bool kept_tapes,
                          bool doc_flags) {
  // The forward's grid, chosen for all HV heads (so a slice walks as the forward did).
  const GdnPlan whole =
      gdn_fwd_make_plan(T, N, H, HV, use_qk_l2norm, deterministic, sm_count, segment_chunks, 1, false, doc_flags);
  auto sliced = [&](int slices) {
    GdnPlan p = plan_for_grid(T, N, H / slices, HV / slices, use_qk_l2norm, sm_count, whole.seg_chunks,
                              whole.seg_long_max, value_splits, /*with_tapes=*/true, /*chunks_apart=*/kept_tapes,
                              doc_flags);
    p.head_slices = slices;
    p.backward = true;
    constexpr int64_t kStateTile = kGdnHeadDim * kGdnHeadDim * 2;
    constexpr int64_t kMatBytes = kGdnHeadDim * kGdnHeadDim * 4;
    const int64_t beside = kept_tapes ? 0 : p.inner_slots * p.HV;  // cuts of a reverse walk run beside the recompute
    Carve c{p.ws.bytes};
    p.ws.dS_tape = c.take(p.chunk_slots * p.HV * kStateTile);
    p.ws.bwd_seg_grad = c.take(beside * kMatBytes);
    p.ws.bwd_seg_transfer = c.take(beside * kMatBytes);
    p.ws.bwd_seg_exact = c.take(beside * 4);
    p.ws.bytes = c.bytes;
    return p;
  };
  if (kept_tapes) return sliced(1);
  if (head_slices > 0) {
    assert(H % head_slices == 0);
    return sliced(head_slices);
  }
  const GdnPlan one = sliced(1);
  const int slices = gdn_bwd_choose_head_slices(T, N, H, HV, whole.seg_chunks, whole.seg_long_max, sm_count, one.ws.bytes);
  return slices == 1 ? one : sliced(slices);
}

void gdn_fwd_apply_plan(const GdnPlan& plan, void* workspace, GdnFwdArgs& a, void* chunk_block) {
  unsigned char* base = static_cast<unsigned char*>(workspace);
  const GdnWorkspaceLayout& w = plan.ws;
  const GdnChunkLayout& l = w.chunk;
  unsigned char* chunks = plan.chunks_apart ? static_cast<unsigned char*>(chunk_block) : base + w.chunks;
  const bool inner = plan.inner_slots > 0, cut = plan.seg_chunks > 0;
  a.chunk_offsets = reinterpret_cast<int32_t*>(base + w.chunk_offsets);
  a.a = chunks + l.a;
  a.gcum = reinterpret_cast<float*>(chunks + l.gcum);
  a.chunk_beta = reinterpret_cast<float*>(chunks + l.chunk_beta);
  a.chunk_decay = reinterpret_cast<float*>(chunks + l.chunk_decay);
  a.qk_lrn = plan.use_qk_l2norm ? reinterpret_cast<float*>(chunks + l.qk_lrn) : nullptr;
  a.seg_offsets = reinterpret_cast<int32_t*>(base + w.seg_offsets);
  a.seg_state = inner ? reinterpret_cast<float*>(base + w.seg_state) : nullptr;
  a.seg_transfer = inner ? reinterpret_cast<float*>(base + w.seg_transfer) : nullptr;
  a.seg_exact = inner ? reinterpret_cast<int32_t*>(base + w.seg_exact) : nullptr;
  a.chain_docs = cut ? reinterpret_cast<int32_t*>(base + w.chain_docs) : nullptr;
  a.walk_queue = cut ? reinterpret_cast<int32_t*>(base + w.walk_queue) : nullptr;
  a.h_tape = l.with_tapes ? chunks + l.h_tape : nullptr;
  a.T = plan.T;
  a.N = plan.N;
  a.H = plan.H;
  a.HV = plan.HV;
  a.H_stride = plan.H * plan.head_slices;
  a.HV_stride = plan.HV * plan.head_slices;
  a.use_qk_l2norm = plan.use_qk_l2norm;
  a.seg_chunks = plan.seg_chunks;
  a.seg_long_max = plan.seg_long_max;
  a.walk_splits = plan.walk_splits;
  a.summary_splits = plan.summary_splits;
  a.sm_count = plan.sm_count;
}

}  // namespace cake

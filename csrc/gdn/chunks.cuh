#pragma once

// Packed documents cut into chunks of kGdnChunk tokens (and the walk into segments of
// chunks), on the device. Document n has ceil(len_n / 64) chunks; they occupy chunk slots
// chunk_offsets[n] .. chunk_offsets[n+1] - 1 of a static grid of ceil(T / 64) + N slots (an
// upper bound: no host sync, CUDA-graph safe). Slots at or past chunk_offsets[N] are
// unused. (docs/kernels.md, "Plan and cut grid".)

#include <cstdint>

#include "common/scan.cuh"
#include "common/varlen.cuh"
#include "gdn/gdn.h"

namespace cake {

// Where a chunk sits: its document, first token and number of real tokens (1..64).
struct ChunkPos {
  int64_t doc;
  int64_t t0;
  int len;
};

// The chunk in `slot` (< chunk_offsets[N]).
__device__ __forceinline__ ChunkPos find_chunk(const int32_t* chunk_offsets, CuSeqlens cu, int64_t N,
                                               int64_t slot) {
  const int64_t lo = find_document(chunk_offsets, N, slot);
  const int64_t start = cu[lo];
  const int64_t t0 = start + (slot - chunk_offsets[lo]) * kGdnChunk;
  const int64_t left = cu[lo + 1] - t0;
  return {lo, t0, static_cast<int>(left < kGdnChunk ? left : kGdnChunk)};
}

// The cut grid of a document of `chunks` chunks: every seg_chunks chunks from its start
// (0: uncut), or every seg_chunks / 2 for a long document, of more than 2 seg_chunks and
// at most long_max chunks (long_max = 0: none; the deterministic plan's choice, plan.h). A function of
// the document's own length, so its bits do not depend on its neighbours; or, for a
// piece of a longer document (doc_flags kGdnHalfGrid / kGdnFullGrid, gdn.h), of that
// document's length, which the caller gives as the flag.
__host__ __device__ inline int doc_cut_chunks(int chunks, int seg_chunks, int long_max, uint8_t flags = 0) {
  const bool half = (flags & kGdnHalfGrid) != 0 ||
                    ((flags & kGdnFullGrid) == 0 && chunks > 2 * seg_chunks && chunks <= long_max);
  return seg_chunks > 1 && half ? seg_chunks / 2 : seg_chunks;
}

// The empty segments a document's doc_flags (gdn.h) add: one before its segments where it
// opens inside a longer document, one after where it closes inside.
__host__ __device__ inline int empty_segments(uint8_t flags) {
  return ((flags & kGdnOpensInside) ? 1 : 0) + ((flags & kGdnClosesInside) ? 1 : 0);
}

// A segment of a document's walk: chunks c0 .. c0 + nch - 1 of document doc, its index
// seg of nseg (seg_offsets: see gdn.h; seg_chunks = 0 means one segment a document; the
// empty segments of doc_flags have nch = 0, c0 = 0 before the others, c0 = chunks after).
struct SegmentPos {
  int64_t doc;
  int seg, nseg;
  int c0, nch;
  int64_t doc_start, doc_end;  // the document's tokens
};

// The slot of the i-th segment that is not its document's last, i < seg_offsets[N] - N
// (documents before n have seg_offsets[n] - n such segments, non-decreasing in n).
__device__ __forceinline__ int64_t inner_segment_slot(const int32_t* seg_offsets, int64_t N, int64_t i) {
  int64_t lo = 0, hi = N;  // the last document n with seg_offsets[n] - n <= i
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (seg_offsets[mid] - mid <= i) lo = mid;
    else hi = mid;
  }
  return i + lo;  // seg_offsets[lo] + (i - (seg_offsets[lo] - lo))
}

// The segment in `slot` (< seg_offsets[N]).
__device__ __forceinline__ SegmentPos find_segment(const int32_t* seg_offsets, CuSeqlens cu, int64_t N,
                                                   int seg_chunks, int long_max, const uint8_t* doc_flags,
                                                   int64_t slot) {
  SegmentPos s;
  s.doc = find_document(seg_offsets, N, slot);
  const int32_t first = seg_offsets[s.doc];
  s.seg = static_cast<int>(slot - first);
  s.nseg = seg_offsets[s.doc + 1] - first;
  s.doc_start = cu[s.doc];
  s.doc_end = cu[s.doc + 1];
  const int chunks = s.doc_end > s.doc_start ? static_cast<int>((s.doc_end - s.doc_start + kGdnChunk - 1) / kGdnChunk) : 0;
  const uint8_t flags = doc_flags != nullptr ? doc_flags[s.doc] : 0;
  const int grid = doc_cut_chunks(chunks, seg_chunks, long_max, flags);
  const int real = s.seg - ((flags & kGdnOpensInside) ? 1 : 0);  // the segment's index among the real ones
  if (real < 0 || real >= s.nseg - empty_segments(flags)) {  // an empty segment of doc_flags
    s.c0 = real < 0 ? 0 : chunks;
    s.nch = 0;
    return s;
  }
  s.c0 = grid > 0 ? real * grid : 0;
  s.nch = grid > 0 ? min(grid, chunks - s.c0) : chunks;
  return s;
}

// The backward's truncation window of a segment (the reverse walk's summaries, bwd_walk.h):
// the fewest first chunks whose chunk_decay sums to <= kGdnTruncLogDecay, or 0 if there
// are none (the forward's truncation_start, fwd_walk_scheduler.cuh, mirrored). decay: chunk_decay at the segment's first chunk, stride
// HV. Every warp computes it alike (same loads, same summation order).
__device__ __forceinline__ int window_chunks(const float* decay, int64_t HV, int nch) {
  const int lane = threadIdx.x & 31;
  float carry = 0.f;  // the log decay of the chunks before this round's
  for (int begin = 0; begin < nch; begin += 32) {
    const int c = begin + lane;
    const float x = warp_inclusive_scan(c < nch ? decay[c * HV] : 0.f) + carry;  // chunks 0 .. c
    const unsigned hit = __ballot_sync(0xffffffffu, c < nch && x <= kGdnTruncLogDecay);
    if (hit != 0u) return begin + __ffs(hit);  // the lowest lane: the shortest window
    carry = __shfl_sync(0xffffffffu, x, 31);
  }
  return 0;
}

}  // namespace cake

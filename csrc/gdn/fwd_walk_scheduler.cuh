#pragma once

// Which walk a walk CTA runs (fwd_walk.cu): the Walk of a grid index (find_walk), the
// truncation window of a summary (truncation_start), and the persistent queue the summary
// CTAs take walks from (take_walk).
//
// Output and tape modes: one CTA per walk. Summary mode: a persistent grid of at most one CTA per
// SM, each CTA taking the next walk from p.walk_queue (an integer atomic; the plan zeroed
// it) until none is left. Why persistent: where no document is cut every summary walk is
// empty, and a CTA per walk slot (one at a time per SM, for their shared memory) costs
// microseconds a call just to start and return. Why a queue, not a fixed walk i,
// i + gridDim.x, ... per CTA: walks differ in length (a truncated cut's E_s is a few
// chunks, its M_s none, an exact one's both whole segments), and with an even grid a CTA
// would only ever take E_s or only M_s (kind = index % 2); the queue balances as the
// block scheduler did. Which CTA runs a walk does not change its bits.

#include <cstdint>

#include "common/scan.cuh"
#include "common/varlen.cuh"
#include "gdn/chunks.cuh"
#include "gdn/fwd_walk_layout.cuh"
#include "gdn/gdn.h"

namespace cake::gdn_walk {

// Summary mode: the truncation window of an inner segment (docs/kernels.md, "Truncated
// cuts"), as the
// offset of its first chunk from the segment's first, or -1 if the cut is exact: the
// latest chunk cw with sum over c = cw .. nch - 1 of decay[c] <= kGdnTruncLogDecay
// (the smallest window). decay: chunk_decay at the segment's first chunk, stride HV.
// Every warp computes it alike (same loads and the same summation order), so no barrier.
__device__ __forceinline__ int truncation_start(const float* decay, int64_t HV, int nch) {
  const int lane = threadIdx.x & 31;
  float carry = 0.f;  // the log decay of the chunks after this round's
  for (int end = nch; end > 0; end -= 32) {
    const int c = end - 1 - lane;  // lane 0 takes the latest chunk
    float x = warp_inclusive_scan(c >= 0 ? decay[c * HV] : 0.f);
    x += carry;  // the log decay of chunks c .. nch - 1
    const unsigned hit = __ballot_sync(0xffffffffu, c >= 0 && x <= kGdnTruncLogDecay);
    if (hit != 0u) return end - __ffs(hit);  // the lowest lane: the latest chunk
    carry = __shfl_sync(0xffffffffu, x, 31);
  }
  return -1;
}

// One walk: output and tape modes, (segment slot, hv[, half]); summary mode, (inner segment, hv,
// E or M[, half]), inner segments being those that are not their document's last (the
// half only when split: kStateWgs = 1; the halves are neighbours, so they run together
// and share their loads of q, k and A in L2). run = false for walks past the real
// segments, M of segment 0 (whose start state is known) and M of a truncated cut.
struct Walk {
  bool run, transfer;
  int hv, half, nch;
  int64_t seg_start, seg_end, doc_end, first_slot;
  const float* S0;
  float* S_end;
};

// The reverse walk's summaries (kReverseSummary, bwd_walk.h): walk (cut after inner
// segment i, hv, F or M^T[, half]) is the segment after the cut walked back, F from zero
// over its backward truncation window (window_chunks, chunks.cuh) or, at an exact cut, the
// whole segment, and M^T from the identity (do = 0) at an exact cut only; the args as the
// reverse walk's launch sets them (seg_state = F, then the chained end gradients).
template <int kStateWgs>
__device__ __forceinline__ Walk find_reverse_summary(const GdnFwdCoreArgs& p, int64_t index) {
  constexpr int kHalves = 3 - kStateWgs;
  Walk w{};
  w.half = kHalves == 2 ? static_cast<int>(index % 2) : 0;
  const int64_t block = index / kHalves;
  w.transfer = block % 2 == 1;
  const int64_t hv = block / 2 % p.HV;
  w.hv = static_cast<int>(hv);
  const int64_t i = block / 2 / p.HV;
  if (i >= p.seg_offsets[p.N] - p.N) return w;
  const int64_t slot = inner_segment_slot(p.seg_offsets, p.N, i);
  const SegmentPos sp =
      find_segment(p.seg_offsets, CuSeqlens{p.cu_seqlens, p.cu_int64}, p.N, p.seg_chunks, p.seg_long_max,
                   p.doc_flags, slot + 1);
  const int64_t first_slot = p.chunk_offsets[sp.doc] + sp.c0;
  const int window = window_chunks(p.chunk_decay + first_slot * p.HV + hv, p.HV, sp.nch);
  if (w.transfer && window > 0) return w;  // a truncated cut needs no transfer
  if (!w.transfer && w.half == 0 && threadIdx.x == 0) p.seg_exact[i * p.HV + hv] = window > 0 ? 0 : 1;
  constexpr int64_t kMat = kGdnHeadDim * kGdnHeadDim;
  w.S0 = nullptr;
  w.S_end = (w.transfer ? p.seg_transfer : p.seg_state) + (i * p.HV + hv) * kMat;
  w.nch = window > 0 ? window : sp.nch;
  w.seg_start = sp.doc_start + static_cast<int64_t>(sp.c0) * kGdnChunk;
  w.seg_end = min(sp.doc_end, w.seg_start + static_cast<int64_t>(w.nch) * kGdnChunk);
  w.doc_end = sp.doc_end;
  w.first_slot = first_slot;
  w.run = true;
  return w;
}

// kReverse (the reverse walk, fwd_walk_reverse.cuh) takes the args as that walk's launch
// sets them: initial_state = dht, final_state = dh0, seg_state = the chained end
// gradients; its S0 is dS at the segment's end, S_end dh0 at a document's first segment.
// Segment walks past p.walk_segments (gdn.h) do not run.
template <WalkMode kMode, int kStateWgs>
__device__ __forceinline__ Walk find_walk(const GdnFwdCoreArgs& p, int64_t index) {
  if constexpr (kMode == WalkMode::kReverseSummary) return find_reverse_summary<kStateWgs>(p, index);
  constexpr bool kSegmentWalk = kMode != WalkMode::kSummary;  // from the segment's start state
  constexpr int kKinds = kSegmentWalk ? 1 : 2, kHalves = 3 - kStateWgs;
  Walk w{};
  w.half = kHalves == 2 ? static_cast<int>(index % 2) : 0;
  const int64_t block = index / kHalves;
  w.transfer = !kSegmentWalk && block % kKinds == 1;  // M_s rather than E_s
  const int64_t hv = block / kKinds % p.HV;
  w.hv = static_cast<int>(hv);
  const int64_t item = block / kKinds / p.HV;
  if (item >= p.seg_offsets[p.N] - (kSegmentWalk ? 0 : p.N)) return w;
  const int64_t slot = kSegmentWalk ? item : inner_segment_slot(p.seg_offsets, p.N, item);
  const SegmentPos sp =
      find_segment(p.seg_offsets, CuSeqlens{p.cu_seqlens, p.cu_int64}, p.N, p.seg_chunks, p.seg_long_max,
                   p.doc_flags, slot);
  if (w.transfer && sp.seg == 0) return w;
  if constexpr (kSegmentWalk) {  // a call that needs only the first or the last segments' ends
    if ((p.walk_segments == kGdnWalkFirst && sp.seg != 0) ||
        (p.walk_segments == kGdnWalkLast && sp.seg != sp.nseg - 1))
      return w;
  }

  // The seg_ workspaces hold inner segments only, by inner index slot - doc (document n's
  // first inner segment is seg_offsets[n] - n).
  const int64_t inner = slot - sp.doc;
  int skip = 0;  // chunks of the segment before the walk starts (summary of a truncated cut)
  if constexpr (!kSegmentWalk) {
    const int cw = truncation_start(p.chunk_decay + (p.chunk_offsets[sp.doc] + sp.c0) * p.HV + hv, p.HV, sp.nch);
    if (w.transfer && cw >= 0) return w;  // truncated: the chain needs no M_s
    if (!w.transfer && w.half == 0 && threadIdx.x == 0) p.seg_exact[inner * p.HV + hv] = cw < 0;
    skip = cw > 0 ? cw : 0;
  }
  constexpr int64_t kMat = kGdnHeadDim * kGdnHeadDim;
  w.S0 = nullptr;
  if constexpr (kMode == WalkMode::kReverse) {
    // From the document's end gradient (dht, or zeros) at its last segment, else from the
    // chained gradient of the cut after the segment (inner index slot - doc).
    if (sp.seg == sp.nseg - 1) {
      if (p.initial_state != nullptr) w.S0 = p.initial_state + (sp.doc * p.HV_stride + hv) * kMat;
    } else {
      w.S0 = p.seg_state + (inner * p.HV + hv) * kMat;
    }
    w.S_end = sp.seg == 0 ? p.final_state + (sp.doc * p.HV_stride + hv) * kMat : nullptr;
  } else if (sp.seg == 0 && !w.transfer && skip == 0) {
    if (p.initial_state != nullptr) w.S0 = p.initial_state + (sp.doc * p.HV_stride + hv) * kMat;
  } else if (kSegmentWalk) {
    w.S0 = p.seg_state + ((inner - 1) * p.HV + hv) * kMat;  // the chained start state: the previous segment's
  }
  if constexpr (walks_output(kMode))
    w.S_end = sp.seg == sp.nseg - 1 ? p.final_state + (sp.doc * p.HV_stride + hv) * kMat : nullptr;
  else if constexpr (kMode == WalkMode::kSummary)
    w.S_end = (w.transfer ? p.seg_transfer : p.seg_state) + (inner * p.HV + hv) * kMat;
  else if constexpr (kMode == WalkMode::kTape)  // the final state only in gdn_fwd_final_state's walk
    w.S_end = p.final_state != nullptr && sp.seg == sp.nseg - 1 ? p.final_state + (sp.doc * p.HV_stride + hv) * kMat
                                                                 : nullptr;

  const int c0 = sp.c0 + skip;
  w.nch = sp.nch - skip;
  w.seg_start = sp.doc_start + static_cast<int64_t>(c0) * kGdnChunk;
  w.seg_end = min(sp.doc_end, w.seg_start + static_cast<int64_t>(w.nch) * kGdnChunk);
  w.doc_end = sp.doc_end;
  w.first_slot = p.chunk_offsets[sp.doc] + c0;
  w.run = true;
  return w;
}

// Summary mode: thread 0 takes the next walk index from the queue into `taken` (read by
// the CTA after the next barrier).
__device__ __forceinline__ void take_walk(int32_t* queue, int32_t& taken) {
  if (threadIdx.x == 0) taken = atomicAdd(queue, 1);
}

}  // namespace cake::gdn_walk

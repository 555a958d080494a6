#pragma once

// The plan of a GDN call, in one place (docs/kernels.md, "Plan and cut grid", "Value
// split", "Workspaces"): on the host, from static shapes only (no host sync), the cut
// grid, the value splits and the workspace layout (GdnPlan); on the device, the offsets
// of the documents' chunks and segments (gdn_fwd_plan_launch, gdn.h). Torch-free: the
// binding allocates GdnPlan::bytes and calls gdn_fwd_apply_plan; a backward carves its
// forward pieces from the same layout.

#include <algorithm>
#include <cstdint>

#include "gdn/gdn.h"

namespace cake {

// Chunk slots NC: every document's chunks fit ceil(T / 64) + N slots.
inline int64_t gdn_fwd_chunk_slots(int64_t T, int64_t N) { return (T + kGdnChunk - 1) / kGdnChunk + N; }

// Segment slots: document n has max(1, ceil(chunks_n / seg_chunks)) <= chunks_n /
// seg_chunks + 1 segments (an empty one has one, of no chunks, which writes its final
// state), and sum chunks_n <= NC; so NC / seg_chunks + N bounds the total. With
// doc_flags (gdn.h), up to two empty segments more a document.
inline int64_t gdn_fwd_segment_slots(int64_t T, int64_t N, int seg_chunks, bool doc_flags = false) {
  return (seg_chunks > 0 ? (gdn_fwd_chunk_slots(T, N) + seg_chunks - 1) / seg_chunks + N : N) +
         (doc_flags ? 2 * N : 0);
}

// Segments that are not their document's last (the ones with summaries): sum over n of
// (segments_n - 1) <= sum floor((chunks_n - 1) / seg_chunks) <= (ceil(T / 64) - 1) / seg_chunks;
// with doc_flags two more a document (the empty first one, and the last real one before
// an empty last one).
inline int64_t gdn_fwd_inner_segment_slots(int64_t T, int seg_chunks, int64_t N = 0, bool doc_flags = false) {
  return (seg_chunks > 0 && T > 0 ? ((T + kGdnChunk - 1) / kGdnChunk - 1) / seg_chunks : 0) +
         (seg_chunks > 0 && doc_flags ? 2 * N : 0);
}

// The finest grid any document is cut at (doc_cut_chunks, chunks.cuh), for the slot bounds above.
inline int gdn_fwd_finest_cut_chunks(int seg_chunks, int seg_long_max) {
  return seg_chunks > 1 && seg_long_max > 2 * seg_chunks ? seg_chunks / 2 : seg_chunks;
}

// Documents with >= 3 segments, the ones with a chain step: more than 2 seg_chunks
// chunks (a long one, cut finer, has more than 2 seg_chunks too), so more than 128 seg_chunks
// tokens each. The chain launches a CTA group per such slot, not per document (with many
// short documents almost all would return).
// With doc_flags any document may have 3 (a real one between two empty ones).
inline int64_t gdn_fwd_chain_doc_slots(int64_t T, int64_t N, int seg_chunks, bool doc_flags = false) {
  if (seg_chunks > 0 && doc_flags) return N;
  return seg_chunks > 0 ? std::min<int64_t>(N, T / (2 * kGdnChunk * static_cast<int64_t>(seg_chunks) + 1)) : 0;
}

// The deterministic cut grid, for every shape and device (docs/contract.md, "Determinism").
constexpr int kGdnDetSegChunks = 64;
// Deterministic: a document of more than 2 kGdnDetSegChunks chunks (8,192 tokens) is cut
// every kGdnDetSegChunks / 2 while, cut at the full grid, its segments times HV would fill
// fewer than kGdnDetFillWalks walks, i.e. up to kGdnDetSegChunks (ceil(kGdnDetFillWalks /
// HV) - 1) chunks (none from HV = 43). Such a document alone leaves SMs idle at the full
// grid; the length and HV are the document's own, not the SM count's or its neighbours'.
// The minimum keeps gdn_fwd_chain_doc_slots' bound: on either grid a document with a chain
// step (three segments or more) has more than 2 kGdnDetSegChunks chunks.
constexpr int kGdnDetFillWalks = 128;

// The cut grid for a call: deterministic, kGdnDetSegChunks; otherwise chosen from the
// shapes and the SM count by a cost model (0 when the (document, value head) walks alone
// fill the GPU).
int gdn_fwd_choose_segment_chunks(int64_t T, int64_t N, int64_t HV, bool deterministic, int sm_count);

// seg_long_max for a call: deterministic, as kGdnDetFillWalks says; non-deterministic, 0
// (its grid is chosen from the whole call already).
int gdn_fwd_choose_segment_long_max(int64_t HV, bool deterministic);

// The per-chunk block: the pieces of every chunk slot and head (gdn.h) that the prep and
// the walk write and the backward reads, byte offsets from the block's start, each
// 256-byte aligned: a, gcum, chunk_beta, chunk_decay, qk_lrn (0 bytes without
// use_qk_l2norm) and, with_tapes, h_tape (else 0 bytes). Its layout depends on T, N, H,
// HV and use_qk_l2norm alone, never on the plan, so that the full save mode can keep it
// from the forward to the backward as one tensor whose size the op's fake kernel knows
// (cake_ops/ops/gdn.py, gdn_tapes_bytes).
struct GdnChunkLayout {
  int64_t a, gcum, chunk_beta, chunk_decay, qk_lrn, h_tape;
  bool with_tapes;
  int64_t bytes;
};
GdnChunkLayout gdn_chunk_layout(int64_t T, int64_t N, int64_t H, int64_t HV, bool use_qk_l2norm, bool with_tapes);

// Byte offsets of the workspace pieces (gdn.h) in one buffer, each 256-byte aligned; a
// piece that the call does not use has 0 bytes (its pointer is set to nullptr): the plan
// kernel's offsets, the cuts' pieces, the per-chunk block (unless it lives apart:
// GdnPlan::chunks_apart) and, in a backward plan, the reverse walk's dS_tape [NC, HV,
// 128, 128] bf16 (gdn/bwd_walk.h; its dv_new goes to dv's memory, which the chunk-local
// gradients overwrite), so one buffer serves the whole backward. A backward that
// recomputes its tapes runs the reverse walk beside the recompute's summaries, chain and
// tape walk (binding.cpp gdn_bwd), so its cuts have pieces of their own, shaped as the
// forward's: bwd_seg_grad, bwd_seg_transfer [NI, HV, 128, 128] fp32, bwd_seg_exact
// [NI, HV] int32 (with kept tapes nothing runs beside it: it takes the forward's).
struct GdnWorkspaceLayout {
  int64_t chunk_offsets, seg_offsets, seg_state, seg_transfer, seg_exact, chain_docs, walk_queue;
  int64_t chunks;   // the per-chunk block (0 bytes when apart)
  GdnChunkLayout chunk;
  int64_t dS_tape;  // the backward's
  int64_t bwd_seg_grad, bwd_seg_transfer, bwd_seg_exact;
  int64_t bytes;    // the buffer's size
};

// Everything the host decides for one call.
struct GdnPlan {
  int64_t T, N, H, HV;  // H and HV: the heads each launch covers (one head slice's)
  int head_slices;      // the call's heads are head_slices * H and head_slices * HV (backward; else 1)
  bool use_qk_l2norm;
  int seg_chunks;      // the cut grid (0: uncut)
  int seg_long_max;    // long documents of more than 2 seg_chunks, at most seg_long_max chunks: cut at seg_chunks / 2
  int walk_splits;     // value splits of the walk with output (1 or 2)
  int summary_splits;  // and of the summaries
  int sm_count;
  int64_t chunk_slots;        // NC
  int64_t inner_slots;        // NI: the seg_ workspaces' segments
  int64_t chain_slots;        // ND
  bool backward;              // the layout has the backward's pieces (gdn_bwd_make_plan)
  bool doc_flags;             // the call passes per-document flags (gdn.h): the slot bounds hold their segments
  bool chunks_apart;          // the per-chunk block is a buffer of its own (the full save mode's)
  GdnWorkspaceLayout ws;
};

// The plan of a call. segment_chunks: -1 lets the plan choose the cut grid (fixed for
// deterministic, shape- and SM-count-dependent otherwise); >= 0 forces one (0: uncut;
// an explicit grid cuts every document alike: no finer long-document grid).
// value_splits: -1 lets the plan choose (2 where the split CTAs fit in one wave of
// sm_count, the summaries' up to four waves of their walks, else 1; the bits do not
// depend on it, so the deterministic variant chooses too), 1 or 2 forces it. Forcing is
// for tests and tuning. keep_tapes (the full save mode): the per-chunk block, with the
// tapes, lives apart from the workspace, for the backward to read.
GdnPlan gdn_fwd_make_plan(int64_t T, int64_t N, int64_t H, int64_t HV, bool use_qk_l2norm, bool deterministic,
                          int sm_count, int segment_chunks = -1, int value_splits = -1, bool keep_tapes = false,
                          bool doc_flags = false);

// The backward runs its stages on one head slice at a time: H / head_slices q/k heads
// and their value heads, in one workspace of that slice's size (docs/kernels.md,
// "Head slices"). Each head's work is the same instructions in any slice, so the bits do
// not depend on the slicing. The rule: 2 slices where H is even and either the unsliced
// workspace (workspace_bytes) exceeds kGdnBwdSliceBytes, or the walks (segments of a
// document's grid, each one SM's serial chain) fill as many whole rounds of segment walks
// on sm_count SMs in all as unsliced, the documents taken as equally long; else 1. Fewer
// heads per launch cost the walks a round wherever their last round was partly filled,
// and every launch its tail: measured 1.04x the backward's time at 2 slices where the
// workspace is 2.3 GiB (s32k_h16, s256k_h2) for 1.2 GiB less memory, 1.02x at s64k_h16;
// 4 slices cost more (1.05x at s64k_h16), so 2 at most.
constexpr int kGdnMaxHeadSlices = 2;
constexpr int64_t kGdnBwdSliceBytes = int64_t{1} << 30;
int gdn_bwd_choose_head_slices(int64_t T, int64_t N, int64_t H, int64_t HV, int seg_chunks, int seg_long_max,
                               int sm_count, int64_t workspace_bytes);
// The backward's plan: the forward's cut grid for the same arguments (chosen for all HV
// heads, so its recompute walks as the forward did) with the backward's workspace pieces
// added, laid out for one head slice. head_slices: -1 lets the plan choose
// (gdn_bwd_choose_head_slices), else a divisor of H (tests, tuning). kept_tapes: the
// forward's per-chunk block (gdn_fwd_make_plan's keep_tapes) is given apart, whole: one
// slice, and the workspace holds the rest.
GdnPlan gdn_bwd_make_plan(int64_t T, int64_t N, int64_t H, int64_t HV, bool use_qk_l2norm, bool deterministic,
                          int sm_count, int segment_chunks = -1, int value_splits = -1, int head_slices = -1,
                          bool kept_tapes = false, bool doc_flags = false);

// Sets args' plan fields (seg_chunks, seg_long_max, splits, sm_count, shapes, the heads'
// row strides) and points its workspace pointers into `workspace` (plan.ws.bytes bytes,
// 256-byte aligned) and the per-chunk block's into `chunk_block` where the plan has it
// apart (GdnChunkLayout bytes, 256-byte aligned), else into the workspace; h_tape only
// where the block has the tapes, else nullptr.
void gdn_fwd_apply_plan(const GdnPlan& plan, void* workspace, GdnFwdArgs& args, void* chunk_block = nullptr);

}  // namespace cake

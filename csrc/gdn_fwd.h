#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime.h>

#include "dtype.h"

namespace cake {

// Forward of the chunked gated delta rule over packed documents (DESIGN.md §1), for
// head dims K = V = 128, chunk 64:
//   plan (gdn_fwd_plan.cu): chunk and segment offsets of the documents (a scan over N).
//   prep (gdn_fwd_prep.cu): per (chunk slot, q/k head): (with use_qk_l2norm, the rows'
//        inverse norms of q and k, applied to K K^T in fp32 and stored for the walk; q and
//        k are never written normalised),
//        K K^T once for the G value heads, then per value head the chunk-local gate
//        cumsum gcum and A = (I + tril(beta_i e^(gcum_i - gcum_j) k_i.k_j, -1))^-1,
//        stored with beta folded in: a_ws = A diag(beta) (bf16).
//   walk (gdn_fwd_walk.cu): per (document, value head): the state walk with the output
//        fused, S^T kept in registers across chunks (wgmma, warp-specialised):
//        v_new = A diag(beta) (v - e^gcum (k S)),  o = scale e^gcum (q S) + P v_new,
//        S <- e^gl S + (e^(gl - gcum) k)^T v_new,  P = scale tril(q k^T * e^(gcum_i - gcum_j)).
// With segments (seg_chunks > 0), every document is cut at a grid of seg_chunks chunks
// counted from its start (seg_chunks / 2 for a long one, of 4 seg_chunks .. seg_long_max
// chunks: doc_cut_chunks, gdn_chunks.cuh), and the walk runs per (segment, value head) in
// parallel:
//   summaries (gdn_fwd_walk.cu, no output): segment s's walk is affine in its start
//        state, S_end = M_s S_start + E_s. E_s is the walk of s from zero (segment 0:
//        from the initial state), M_s (K x K) the walk of s from the identity with v = 0.
//   chain (gdn_fwd_chain.cu): S_start(s + 1) = M_s S_start(s) + E_s in order, fp32.
//   walk: each segment from its start state, with the output.
// Truncated cuts (KERNELS.md §4.4 method 1): where the gates alone make the start state
// negligible at a cut, i.e. the last W chunks before it are contractions whose log
// decays sum to <= kGdnTruncLogDecay (||M|| <= e^-20, below fp32 resolution of the state),
// E_s is walked from zero over those W chunks only, M_s is not formed and the chain
// takes S_start(s + 1) = E_s. The test reads only the segment's own gates and keys, so
// the bits still depend on the document alone.
// The deterministic grid is a function of the document's own length and HV only, so a
// document's bits depend on it alone (DESIGN.md §2); the non-deterministic grid is chosen
// from the shapes and SM count.
//
//   q, k           [T, H, 128] bf16          v [T, HV, 128] bf16, HV = G * H
//   g              [T, HV] fp32              beta [T, HV] fp32 or bf16 (beta_dtype)
//   cu_seqlens     [N + 1] int32 / int64 (cu_int64): 0, non-decreasing, T
//   initial_state  [N, HV, 128, 128] fp32 or nullptr (zeros)
//   o              [T, HV, 128] bf16, every element written
//   final_state    [N, HV, 128, 128] fp32, every element written (an empty document's
//                  is its initial state, or zeros)
// Workspaces (contents need no initialisation; sizes from gdn_fwd_workspace_*):
//   chunk_offsets  [N + 1] int32                 first chunk slot of each document
//   a              [NC, HV, 64, 64] bf16         A diag(beta) per chunk slot
//   gcum           [NC, HV, 64] fp32             chunk-local cumsum of g (pads: last value)
//   chunk_decay    [NC, HV] fp32                 the chunk's log decay gcum[63] when every
//                                                token's update I - beta k k^T is a contraction
//                                                (0 <= beta |k|^2 <= 2), else +inf
//   qk_lrn         [NC, H, 2, 64] fp32           log2 of the rows' inverse L2 norms,
//                                                q then k (only if use_qk_l2norm)
//   seg_offsets    [N + 1] int32                 first segment slot of each document
//   seg_state      [NI, HV, 128, 128] fp32       E_s, then the chained start states S_start(s + 1)
//   seg_transfer   [NI, HV, 128, 128] fp32       M_s^T (transposed: the chain reads columns of M_s)
//   seg_exact      [NI, HV] int32                1: S_start(s + 1) needs M_s; 0: the cut is truncated
//   chain_docs     [ND] int32                    the documents with a chain (>= 3 segments), in
//                                                order, then -1 (ND = gdn_fwd_chain_doc_slots)
//   walk_queue     [1] int32                     the next summary walk to hand out (the plan zeroes it)
// with NC = ceil(T / 64) + N chunk slots and NI inner segment slots, the segments that
// are not their document's last, document n's from index seg_offsets[n] - n on
// (gdn_fwd_inner_segment_slots; the seg_ workspaces only when seg_chunks > 0: with many
// short documents NI is far below the segment slots NS = gdn_fwd_segment_slots). Launch
// sizes depend on T, N, H, HV and seg_chunks only (and the SM count, for the persistent
// summary grid): no host sync, CUDA-graph capturable. Deterministic: fixed reduction
// orders, no float atomics (an integer one hands out summary walks; which CTA runs a walk
// does not change its bits).
struct GdnFwdArgs {
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const void* beta;
  DType beta_dtype;
  const void* cu_seqlens;
  bool cu_int64;
  const float* initial_state;
  void* o;
  float* final_state;
  int32_t* chunk_offsets;
  void* a;
  float* gcum;
  float* chunk_decay;
  float* qk_lrn;
  int32_t* seg_offsets;
  float* seg_state;
  float* seg_transfer;
  int32_t* seg_exact;
  int32_t* chain_docs;
  int32_t* walk_queue;
  int64_t T, N, H, HV;
  int seg_chunks;    // > 0: the cut grid in chunks; 0: one segment per document
  int seg_long_max;  // documents of 4 seg_chunks .. seg_long_max chunks are cut every seg_chunks / 2 (0: none)
  int walk_splits;     // CTAs per (segment, value head) walk with output: 1, or 2 (a half of the value columns each)
  int summary_splits;  // the same for the summaries; the bits are the same either way
  int sm_count;        // the device's SMs: the persistent summary grid's size bound
  float scale;
  bool use_qk_l2norm;
};

constexpr int kGdnHeadDim = 128;
constexpr float kL2NormEps = 1e-6f;  // use_qk_l2norm: x / sqrt(|x|^2 + eps), as the PyTorch path
constexpr float kGdnTruncLogDecay = -20.f;  // a cut is truncated where the window's log decay is <= this

inline int64_t gdn_fwd_chunk_slots(int64_t T, int64_t N) { return (T + 63) / 64 + N; }
inline int64_t gdn_fwd_workspace_a_elems(int64_t T, int64_t N, int64_t HV) {
  return gdn_fwd_chunk_slots(T, N) * HV * 64 * 64;
}
inline int64_t gdn_fwd_workspace_gcum_elems(int64_t T, int64_t N, int64_t HV) {
  return gdn_fwd_chunk_slots(T, N) * HV * 64;
}

// Segment slots: document n has max(1, ceil(chunks_n / seg_chunks)) <= chunks_n /
// seg_chunks + 1 segments (an empty one has one, of no chunks, which writes its final
// state), and sum chunks_n <= NC; so NC / seg_chunks + N bounds the total.
inline int64_t gdn_fwd_segment_slots(int64_t T, int64_t N, int seg_chunks) {
  return seg_chunks > 0 ? (gdn_fwd_chunk_slots(T, N) + seg_chunks - 1) / seg_chunks + N : N;
}

// Segments that are not their document's last (the ones with summaries): sum over n of
// (segments_n - 1) <= sum floor((chunks_n - 1) / seg_chunks) <= (ceil(T / 64) - 1) / seg_chunks.
inline int64_t gdn_fwd_inner_segment_slots(int64_t T, int seg_chunks) {
  return seg_chunks > 0 && T > 0 ? ((T + 63) / 64 - 1) / seg_chunks : 0;
}

// The finest grid any document is cut at (doc_cut_chunks), for the slot bounds above.
inline int gdn_fwd_finest_cut_chunks(int seg_chunks, int seg_long_max) {
  return seg_chunks > 1 && seg_long_max >= 4 * seg_chunks ? seg_chunks / 2 : seg_chunks;
}

// Documents with >= 3 segments, the ones with a chain step: more than 2 seg_chunks
// chunks (a long one, cut finer, has at least 4 seg_chunks), so more than 128 seg_chunks
// tokens each. The chain launches a CTA group per
// such slot, not per document (with many short documents almost all would return).
inline int64_t gdn_fwd_chain_doc_slots(int64_t T, int64_t N, int seg_chunks) {
  return seg_chunks > 0 ? std::min<int64_t>(N, T / (128 * static_cast<int64_t>(seg_chunks) + 1)) : 0;
}

// The cut grid for a call: deterministic (DESIGN.md §2) uses kGdnDetSegChunks for every
// shape and device, with long documents cut finer (gdn_fwd_choose_segment_long_max);
// otherwise the grid is chosen from the shapes and the SM count (0 when the (document,
// value head) walks alone fill the GPU).
constexpr int kGdnDetSegChunks = 64;
int gdn_fwd_choose_segment_chunks(int64_t T, int64_t N, int64_t HV, bool deterministic, int sm_count);

// seg_long_max for a call. Deterministic: a document of at least 4 kGdnDetSegChunks chunks
// (16,384 tokens) is cut every kGdnDetSegChunks / 2 while, cut at the full grid, its
// segments times HV would fill fewer than kGdnDetFillWalks walks, i.e. up to
// kGdnDetSegChunks (ceil(kGdnDetFillWalks / HV) - 1) chunks (none from HV = 32). Such a
// document alone leaves SMs idle at the full grid; the length and HV are the document's
// own, not the SM count's or its neighbours'. Non-deterministic: 0 (its grid is chosen
// from the whole call already).
constexpr int kGdnDetFillWalks = 128;
int gdn_fwd_choose_segment_long_max(int64_t HV, bool deterministic);

// The value-column splits of the walk and summary launches (args.walk_splits,
// args.summary_splits) for args' shapes and cut grid: 2 where the split CTAs fit in one
// wave of sm_count (gdn_fwd_walk.cu), else 1. The result does not depend on them, so the
// deterministic variant uses them too.
void gdn_fwd_choose_value_splits(GdnFwdArgs& args, int sm_count);

// The whole forward: plan, prep, segment summaries and chain (if cut), walk. Returns
// the first launch error.
cudaError_t gdn_fwd_launch(const GdnFwdArgs& args, cudaStream_t stream);

// The stages (also usable alone, e.g. by a backward that recomputes the forward).
cudaError_t gdn_fwd_plan_launch(const GdnFwdArgs& args, cudaStream_t stream);
cudaError_t gdn_fwd_prep_launch(const GdnFwdArgs& args, cudaStream_t stream);
cudaError_t gdn_fwd_summary_launch(const GdnFwdArgs& args, cudaStream_t stream);
cudaError_t gdn_fwd_chain_launch(const GdnFwdArgs& args, cudaStream_t stream);
cudaError_t gdn_fwd_walk_launch(const GdnFwdArgs& args, cudaStream_t stream);

}  // namespace cake

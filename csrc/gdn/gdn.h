#pragma once

// The GDN ("Gated DeltaNet") kernels on sm_90a: the one argument struct of the forward's
// stages (which the backward's tape walk reuses), their constants and launchers; the
// backward's own stages are declared in bwd_walk.h and bwd_local.h. Torch-free (the binding, gdn/binding.cpp, is the only
// torch-side file). Math: docs/math.md ("The recurrence", "Chunked form"); the stages:
// docs/kernels.md ("Forward stages").
//
// Glossary: our stage names, the math (chunk of 64 tokens, gcum the chunk-local cumsum
// of the log gates g, gl = gcum of the chunk's last token), and FLA's names for the same
// work (docs/math.md, "Stage names"):
//   plan       chunk and segment offsets of the packed documents in static slot grids
//              (plan.cu)                   ~ FLA prepare_chunk_indices / prepare_chunk_offsets
//   prep       per (chunk, q/k head): K K^T; per value head: gcum and
//              A diag(beta), A = (I + tril(beta_i e^(gcum_i - gcum_j) k_i.k_j, -1))^-1;
//              with use_qk_l2norm the rows' inverse norms (fwd_prep.cu)
//                                          ~ FLA chunk_local_cumsum + chunk_scaled_dot_kkt_fwd
//                                            + solve_tril (the norms: l2norm_fwd, not applied)
//   walk       per (segment, value head), S^T in registers across chunks (fwd_walk.cu):
//              v_new = A diag(beta) (v - e^gcum (k S)),  o = scale e^gcum (q S) + P~ v_new,
//              S <- e^gl S + (e^(gl - gcum) k)^T v_new,  P~ = scale tril(q k^T e^(gcum_i - gcum_j))
//                                          ~ FLA recompute_w_u_fwd + chunk_gated_delta_rule_fwd_h
//                                            fused with chunk_fwd_o
//   summaries  per inner segment s, the walk without output: S_end = M_s S_start + E_s,
//              E_s from zero, M_s from the identity with v = 0 (fwd_walk.cu, summary mode)
//   chain      S_start(s + 1) = M_s S_start(s) + E_s in order, fp32 (fwd_chain.cu)
//                                          ~ (summaries + chain) the segment transfers of FLA's
//                                            context-parallel pre-pass, chained
//   tape walk  the walk again in tape mode for the backward: S^T at each chunk's start
//              (fwd_walk_tapes.cuh)             ~ FLA chunk_gated_delta_rule_fwd_h
//   reverse walk  dS walked back per (segment, value head): dv_new = P^T do + K~ dS,
//              dS <- e^gl dS + Q~^T do - w^T dv_new (bwd_walk.h: the walk's CTA in reverse
//              mode, fwd_walk_reverse.cuh; its cut summaries and chain, bwd_chain.cu)
//                                          ~ FLA chunk_bwd_dv_local + chunk_gated_delta_rule_bwd_dhu
//   local gradients  per (chunk, q/k head): dq, dk, dv, dbeta, dg from the tapes, v_new
//              formed again from the h tape
//              (bwd_local.cu)              ~ FLA chunk_bwd_dqkwg + prepare_wy_repr_bwd
//                                            + chunk_local_cumsum (reverse) + l2norm_bwd
// Segments: every document is cut at a grid of seg_chunks chunks counted from its start
// (chunks.cuh, doc_cut_chunks; docs/kernels.md, "Plan and cut grid"); at a truncated cut
// the summary walks E_s over a window only and forms no M_s (docs/kernels.md,
// "Truncated cuts"; "Exact cuts and the chain"). The deterministic grid is a function of
// the document's own length and HV (docs/contract.md, "Determinism").
//
//   q, k           [T, H, 128] bf16          v [T, HV, 128] bf16, HV = G * H
//   g              [T, HV] fp32              beta [T, HV] fp32 or bf16 (beta_dtype)
//   cu_seqlens     [N + 1] int32 / int64 (cu_int64): 0, non-decreasing, T
//   initial_state  [N, HV, 128, 128] fp32 or nullptr (zeros)
//   o              [T, HV, 128] bf16, every element written
//   final_state    [N, HV, 128, 128] fp32, every element written (an empty document's
//                  is its initial state, or zeros)
// Workspaces (contents need no initialisation; sizes and offsets: GdnPlan, plan.h;
// docs/kernels.md, "Workspaces"):
//   chunk_offsets  [N + 1] int32                 first chunk slot of each document
//   a              [NC, HV, 64, 64] bf16         A = (I + L)^-1 per chunk slot (beta not folded in)
//   gcum           [NC, HV, 64] fp32             chunk-local cumsum of the floored g
//                                                (kGdnGateFloor; pads: last value)
//   chunk_beta     [NC, HV, 64] fp32             beta of the chunk's rows (pads: 0)
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
// and for the backward (gdn_bwd_make_plan), after them:
//   h_tape         [NC, HV, 128, 128] bf16       [slot, hv, v, k] = S_c[k, v], the chunk's start state
//   dS_tape        [NC, HV, 128, 128] bf16       the reverse walk's dS (gdn/bwd_walk.h; its
//                                                dv_new goes to dv's memory)
// with NC = ceil(T / 64) + N chunk slots and NI inner segment slots, the segments that
// are not their document's last, document n's from index seg_offsets[n] - n on
// (gdn_fwd_inner_segment_slots; the seg_ workspaces only when seg_chunks > 0). Launch
// sizes depend on T, N, H, HV and seg_chunks only (and the SM count, for the persistent
// summary grid): no host sync, CUDA-graph capturable. Deterministic: fixed reduction
// orders, no float atomics (an integer one hands out summary walks; which CTA runs a walk
// does not change its bits).
//
// The kernels take this struct by value: its layout is their parameter layout.

#include <cstdint>

#include <cuda_runtime.h>

#include "common/dtype.h"

namespace cake {

// The forward's arguments (every stage's).
struct GdnFwdCoreArgs {
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
  float* chunk_beta;
  float* chunk_decay;
  float* qk_lrn;
  int32_t* seg_offsets;
  float* seg_state;
  float* seg_transfer;
  int32_t* seg_exact;
  int32_t* chain_docs;
  int32_t* walk_queue;
  int64_t T, N, H, HV;
  // Heads per token row of the tensors ([T, H, *] q, k; [T, HV, *] v, g, beta, o; and the
  // per-document states' HV): H and HV, unless the call is a head slice of wider tensors
  // (the backward's, GdnPlan::head_slices), whose pointers then start at the slice's first
  // head. The workspaces hold the call's H and HV heads.
  int64_t H_stride, HV_stride;
  int seg_chunks;    // > 0: the cut grid in chunks; 0: one segment per document
  int seg_long_max;  // documents of more than 2 seg_chunks, at most seg_long_max chunks, are cut every seg_chunks / 2 (0: none)
  int walk_splits;     // CTAs per (segment, value head) walk with output: 1, or 2 (a half of the value columns each)
  int summary_splits;  // the same for the summaries; the bits are the same either way
  int sm_count;        // the device's SMs: the persistent summary grid's size bound
  float scale;
  bool use_qk_l2norm;
  // Which segments the segment walks (output, tape and reverse modes) run: all
  // (kGdnWalkAll), or only each document's first (kGdnWalkFirst: the reverse walk of
  // gdn_bwd_initial_state, whose dh0 is the first segment's end) or last (kGdnWalkLast:
  // gdn_fwd_final_state, whose final state is the last segment's end). The other
  // segments' walks return at once; the summaries and the chain run as always, so the
  // walked segments start from the same states and give the same bits. It sits in the
  // padding after use_qk_l2norm: the struct's size, and so the walk kernel's parameter
  // layout, is unchanged.
  uint8_t walk_segments;
  // Per document (nullptr: none), where the call's document is a piece of a longer one
  // cut on its grid (deterministic KCP: docs/kcp.md): kGdnOpensInside, the piece starts
  // inside its document, so the plan puts an empty segment before its segments (walked
  // from the initial state, it makes the initial state the first real segment's chained
  // start, and its reverse walk makes dh0 that segment's chained start gradient);
  // kGdnClosesInside, the piece ends inside, so an empty segment follows its segments
  // (the last real one is then summarised and chained, and the final state is the chained
  // start of what follows; its reverse summary, F = 0 and M^T = I, makes dht the last
  // real segment's end gradient). Needs a cut plan (seg_chunks > 0).
  // kGdnHalfGrid / kGdnFullGrid (at most one): the piece is cut at the half grid / the
  // full grid whatever its own length, as its longer document's length puts that
  // document in one class or the other (chunks.cuh, doc_cut_chunks); the half grid only
  // where the call has one (seg_long_max > 0). Other bits are an error (the plan kernel
  // asserts).
  const uint8_t* doc_flags;
};
constexpr uint8_t kGdnWalkAll = 0, kGdnWalkFirst = 1, kGdnWalkLast = 2;
constexpr uint8_t kGdnOpensInside = 1, kGdnClosesInside = 2, kGdnHalfGrid = 4, kGdnFullGrid = 8;
constexpr uint8_t kGdnDocFlagBits = kGdnOpensInside | kGdnClosesInside | kGdnHalfGrid | kGdnFullGrid;

// GdnFwdCoreArgs plus what only the backward's recompute (gdn_bwd_tapes_launch) writes;
// nullptr in the forward. The walk kernel takes the core by value and the tapes as a
// separate parameter after its tensor maps: the maps (128-byte aligned in the parameter
// space) follow the core, and a longer struct would move them and so change the
// forward walk's code.
struct GdnFwdArgs : GdnFwdCoreArgs {
  void* h_tape;  // [NC, HV, 128 (v), 128 (k)] bf16: S^T at each chunk's start (the tape walk)
};

constexpr int kGdnChunk = 64;     // tokens per chunk: the unit of every GDN workspace and walk step
constexpr int kGdnHeadDim = 128;  // K = V, the only head dims the kernels take
constexpr float kL2NormEps = 1e-6f;  // use_qk_l2norm: x / sqrt(|x|^2 + eps), as the PyTorch path
constexpr float kGdnTruncLogDecay = -20.f;  // a cut is truncated where the window's log decay is <= this
                                            // (||M_s|| <= e^-20, below fp32 resolution of the state)

// The prep floors every log gate at kGdnGateFloor (natural log units) as it loads g, so a
// full reset g = -inf (exp(g) = 0) does not make gcum_i - gcum_j = -inf - (-inf) = NaN
// over the whole document. e^-128 = 2^-184.7 is 0 in fp32 (below 2^-149), and 0 under the
// kernels' exp2.ftz (results below 2^-126 flush) after any scale or inverse-norm factor
// below 2^58 is folded into the exponent, so a floored token decays the state exactly as
// e^-inf does; and the chunk-local gcum stays >= 64 * -128 (for g <= 0), far from where
// fp32 differences of it lose accuracy. A floored chunk is simply a strongly decaying one
// (chunk_decay <= -128: truncated cuts see it as such). NaN stays NaN (no fmaxf).
// The PyTorch path applies the same floor (docs/contract.md, "Accuracy").
constexpr float kGdnGateFloor = -128.f;

// The backward's forward-direction recompute ("B1"; docs/kernels.md, "Backward tapes"):
// plan, prep, summaries and chain as the forward's, then the walk in tape
// mode, so the tapes are those of the forward's own walk (same plan, same start states,
// same instructions). args: a backward plan applied (gdn_bwd_make_plan, plan.h); o and
// final_state are not read or written. Writes, per used chunk slot (< chunk_offsets[N])
// and value head, every element of h_tape, a, gcum, chunk_beta (and qk_lrn with
// use_qk_l2norm); later slots are left unwritten. In two parts, for a backward that runs
// the reverse walk beside the second (it needs the first's plan offsets, A and gates
// only): gdn_bwd_tapes_prep_launch (plan, prep), gdn_bwd_tapes_walk_launch (summaries,
// chain, tape walk).
cudaError_t gdn_bwd_tapes_launch(const GdnFwdArgs& args, cudaStream_t stream);
cudaError_t gdn_bwd_tapes_prep_launch(const GdnFwdArgs& args, cudaStream_t stream);
cudaError_t gdn_bwd_tapes_walk_launch(const GdnFwdArgs& args, cudaStream_t stream);

// The forward's stages, which the binding launches in this order, each under its profiler
// range: plan, prep, segment summaries and chain (when cut), walk. args: shapes, tensors
// and a GdnPlan applied (plan.h). Also usable alone, e.g. by a backward that recomputes the
// forward.
cudaError_t gdn_fwd_plan_launch(const GdnFwdArgs& args, cudaStream_t stream);
cudaError_t gdn_fwd_prep_launch(const GdnFwdArgs& args, cudaStream_t stream);
cudaError_t gdn_fwd_summary_launch(const GdnFwdArgs& args, cudaStream_t stream);
cudaError_t gdn_fwd_chain_launch(const GdnFwdArgs& args, cudaStream_t stream);
// The chain alone on caller-made pieces (cake::gdn_state_chain, binding.cpp): the chain
// kernel over chain_slots entries of chain_docs; it reads N, HV, seg_offsets, seg_state,
// seg_transfer, seg_exact and chain_docs only.
cudaError_t gdn_state_chain_launch(const GdnFwdArgs& args, int64_t chain_slots, cudaStream_t stream);
// The summaries of a call's documents, each flagged to open and close inside (doc_flags 1
// | 2) and so one real segment between two empty ones (cake::gdn_segment_summaries and
// gdn_segment_grad_summaries, binding.cpp; KCP's relays): after the summaries (forward)
// or the reverse summaries (backward), per document n and value head hv, the real
// segment's values (E_s, or F) and transfer (M_s, or B, from the stored transpose; zeros
// at a truncated cut) to values and transfers [N, out_HV, 128, 128] fp32 at value head
// hv0 + hv. Its inner index is seg_offsets[n] - n + shift (1: the segment after the empty
// first one, the forward's; 0: the cut after the empty first one, whose reverse
// summaries are the real segment's). A document of other than three segments fails the
// kernel with an assert.
struct GdnPieceSummariesArgs {
  const int32_t* seg_offsets;
  const float* seg_state;
  const float* seg_transfer;
  const int32_t* seg_exact;
  float* values;
  float* transfers;
  int64_t N, HV;       // the call's documents and the value heads of the workspace (a head slice's)
  int64_t out_HV, hv0;  // the outputs' value heads, and the slice's first
  int shift;
};
cudaError_t gdn_piece_summaries_launch(const GdnPieceSummariesArgs& args, cudaStream_t stream);
cudaError_t gdn_fwd_walk_launch(const GdnFwdArgs& args, cudaStream_t stream);
cudaError_t gdn_fwd_tape_walk_launch(const GdnFwdArgs& args, cudaStream_t stream);  // the walk in tape mode
// The final states alone (gdn_fwd_final_state): in place of the walk, each document's last
// segment walked in tape mode without a tape (no q, P~ or o), from its chained start
// state, writing final_state; args.walk_segments = kGdnWalkLast, h_tape and o nullptr. The
// same start state and the same chain instructions as the output walk's: the same bits.
cudaError_t gdn_fwd_final_state_walk_launch(const GdnFwdArgs& args, cudaStream_t stream);

}  // namespace cake

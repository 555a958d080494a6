#pragma once

// The GDN backward's reverse walk of the state gradient ("B2"; docs/math.md, "Chunked
// form"; cake_ops/pytorch/gdn.py walk_tapes, the reverse loop). Torch-free: the binding
// (gdn/binding.cpp) is the torch side.
//
// Per (document n, value head hv), the document's chunks from its last to its first,
// with dS (K x V fp32, the gradient of the state at the current chunk's end) starting as
// dht[n, hv] (zeros without dht). Per chunk, with q^, k^ the chunk's (optionally
// L2-normalised) rows, gcum its chunk-local cumsum, gl = gcum[63], P =
// scale tril(q^ k^T * e^(gcum_i - gcum_j)), a = A and beta (the prep's workspace):
//   dS tape[slot, hv, v, k] = dS[k, v]                                  (bf16, transposed)
//   dv_new = P^T do + diag(e^(gl - gcum)) k^ dS                         -> dv_new (bf16)
//   dS     = (scale e^gcum q^)^T do + e^gl dS - (a diag(beta e^gcum) k^)^T dv_new
// and finally dh0[n, hv] = dS. An empty document writes dh0 = dht (or zeros) and no tape.
//
// The walk runs at the forward's cut grid (docs/kernels.md, "Backward"), every segment
// from its own end gradient, one walk per (segment, value head) on the forward walk's CTA
// in its reverse mode (fwd_walk.cu, fwd_walk_reverse.cuh; split by value columns as the
// forward's walks are). That gradient is dS at the start of the next segment s + 1: a
// summary pass (two walks per cut and value head) walks segment s + 1 back from zero, over
// the shortest run of its first chunks whose chunk_decay sums to <= kGdnTruncLogDecay if
// there is one (a truncated cut), else over the whole segment, giving F, and at an exact
// cut from the identity without the outputs, giving the transfer M^T; a chain per document
// (bwd_chain.cu) then runs from its last segment down,
// dS_end(s) = M_{s+1}^T dS_end(s + 1) + F_{s+1} at an exact cut, = F_{s+1} at a truncated
// one, in fp32 in a fixed order. Uncut (seg_chunks = 0, seg_offsets[n] = n): one walk a
// document, no summaries.
//
//   q, k           [T, H, 128] bf16 (raw rows)       do [T, HV, 128] bf16, HV = G * H
//   a              [NC, HV, 64, 64] bf16 = A per chunk slot (beta not folded in)
//   gcum           [NC, HV, 64] fp32 (pads: the last real value)
//   chunk_beta     [NC, HV, 64] fp32 (pads: 0)
//   qk_lrn         [NC, H, 2, 64] fp32, log2 of the q then k rows' inverse norms, or
//                  nullptr (unit norms: the rows are used as given)
//   dht            [N, HV, 128, 128] fp32 or nullptr (zeros)
//   chunk_offsets  [N + 1] int32, the first chunk slot of each document (plan)
//   cu_seqlens     [N + 1] int32 / int64 (cu_int64)
//   seg_offsets    [N + 1] int32, the first segment slot of each document (plan)
//   chunk_decay    [NC, HV] fp32 (prep): a chunk's log decay, +inf where a token is no contraction
//                  (read by the summaries only: nullptr when uncut)
//   seg_grad, seg_transfer [NI, HV, 128, 128] fp32, seg_exact [NI, HV] int32: the cuts'
//                  workspaces (NI = inner_slots, plan.h), indexed as the forward's seg_
//                  pieces (the backward's own pieces beside the recompute, else those)
//   dS             [NC, HV, 128, 128] bf16 out: [slot, hv, v, k] = dS_end[k, v]
//   dv_new         [T, HV, 128] bf16 out, dv's layout (the fused backward passes dv itself,
//                  which the chunk-local gradients overwrite: gdn/bwd_local.h)
//   dh0            [N, HV, 128, 128] fp32 out
// Every element of every used slot (< chunk_offsets[N]) of dS and every element of dv_new
// and dh0 is written (with first_segments_only, dh0 and the first segments' dS and dv_new
// rows); later slots are not.
// Grids from static bounds (no host sync). Deterministic (no atomics; the cut grid of the
// deterministic plan is the document's own, so its bits do not depend on its neighbours).

#include <cstdint>

#include <cuda_runtime.h>

namespace cake {

struct GdnBwdWalkArgs {
  const void* q;
  const void* k;
  const void* dout;  // do
  const void* a;
  const float* gcum;
  const float* chunk_beta;
  const float* qk_lrn;  // nullptr: unit norms
  const float* dht;     // nullptr: zeros
  const int32_t* chunk_offsets;
  const void* cu_seqlens;
  bool cu_int64;
  void* dS;      // bf16 [NC, HV, 128, 128]
  void* dv_new;  // bf16 [T, HV, 128]
  float* dh0;    // [N, HV, 128, 128]
  const int32_t* seg_offsets;
  const float* chunk_decay;
  float* seg_grad;
  float* seg_transfer;
  int32_t* seg_exact;
  int64_t T, N, H, HV;
  int64_t H_stride, HV_stride;  // heads per token row of the tensors (GdnFwdCoreArgs)
  int seg_chunks, seg_long_max;  // the forward plan's grid (gdn.h)
  int64_t inner_slots;           // NI: the cuts' workspace slots (0: none)
  float scale;  // finite, > 0
  // The value splits of the tape walk and of the summaries (1 or 2; the forward plan's).
  int value_splits, summary_splits;
  // Only each document's first segment walked back (gdn_bwd_initial_state: dh0 alone; the
  // summaries and the chain as always): the other segments write no dS tape and no dv_new.
  bool first_segments_only;
  const uint8_t* doc_flags;  // the forward's (gdn.h), or nullptr
};

// Summaries, chain, tape walk (bwd_chain.cu).
cudaError_t gdn_bwd_walk_launch(const GdnBwdWalkArgs& args, cudaStream_t stream);
// The chain alone (also cake::gdn_state_grad_chain's, on caller-made pieces): it reads N,
// HV, HV_stride, dht, seg_offsets, seg_grad, seg_transfer, seg_exact and inner_slots only.
cudaError_t gdn_bwd_chain_launch(const GdnBwdWalkArgs& args, cudaStream_t stream);
// The summaries and the tape walk on the forward walk's CTA (fwd_walk.cu).
cudaError_t gdn_bwd_reverse_summary_launch(const GdnBwdWalkArgs& args, cudaStream_t stream);
cudaError_t gdn_bwd_reverse_walk_launch(const GdnBwdWalkArgs& args, cudaStream_t stream);

}  // namespace cake

#pragma once

// The GDN backward's chunk-local gradients ("B3"): given the tapes of the backward's two
// walks (the state at each chunk's start, from which it forms v_new again, the state
// gradient at each chunk's end and dv_new), every gradient that is local to a chunk: dq, dk (summed over the GVA group,
// through the in-op L2 norm), dv, dg (the chunk-local reverse cumsum of d gcum) and dbeta.
// The math is cake_ops/pytorch/gdn.py local_gradients, line by line; the kernel and its
// layout: bwd_local.cu. Torch-free (the binding: gdn/binding.cpp).
//
//   q, k        [T, H, 128] bf16 raw (normalised in the kernel when use_qk_l2norm)
//   v, dout     [T, HV, 128] bf16        (dout: the gradient of o)
//   g           [T, HV] fp32             (only to zero dg where g < kGdnGateFloor)
//   beta        [T, HV] fp32 or bf16 (beta_dtype)
//   gcum        [NC, HV, 64] fp32        chunk-local cumsum of the floored g (pads: last value)
//   a           [NC, HV, 64, 64] bf16    A = (I + tril(beta_i D_ij k_i.k_j, -1))^-1, beta NOT folded in
//   h           [NC, HV, 128 (v), 128 (k)] bf16   S^T at the chunk's start
//   ds          [NC, HV, 128 (v), 128 (k)] bf16   dS^T at the chunk's end
//   dv_new      [T, HV, 128] bf16        may be dv itself: each CTA reads its tokens' rows of a
//               value head before it writes their dv, and no other CTA reads them
//   initial_state, dht [N, HV, 128 (k), 128 (v)] fp32 or null: a document's first state S and
//               its last state gradient dS_end, which the h and dS tapes hold in bf16; dg's
//               term e^gl <dS_end, S> at those chunks reads them in fp32 (the tapes' rounding
//               there alone takes dg past the contract where that term dominates)
//   chunk_offsets [N + 1] int32, cu_seqlens [N + 1] int32 / int64 (cu_int64)
// Outputs, every element of every token written:
//   dq, dk [T, H, 128] bf16;  dv [T, HV, 128] bf16;  dg [T, HV] fp32;  dbeta [T, HV] beta_dtype
// NC = gdn_fwd_chunk_slots(T, N) = ceil(T / 64) + N (plan.h); the grid is NC * H CTAs, one
// per (chunk slot, q/k head); slots at or past chunk_offsets[N] return. No host sync;
// deterministic (fixed reduction orders, no atomics).

#include <cstdint>

#include <cuda_runtime.h>

#include "common/dtype.h"

namespace cake {

struct GdnBwdLocalArgs {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const float* g;
  const void* beta;
  DType beta_dtype;
  const float* gcum;
  const void* a;
  const void* h;
  const void* ds;
  const void* dv_new;
  const float* initial_state;
  const float* dht;
  const int32_t* chunk_offsets;
  const void* cu_seqlens;
  bool cu_int64;
  void* dq;
  void* dk;
  void* dv;
  float* dg;
  void* dbeta;
  int64_t T, N, H, HV;
  int64_t H_stride, HV_stride;  // heads per token row of the tensors (GdnFwdCoreArgs)
  float scale;
  bool use_qk_l2norm;
  // The forward's (gdn.h), or nullptr: a document that opens (closes) inside a longer one
  // takes dg's cross-chunk term at its first (last) chunk from the bf16 tape, as that
  // longer document's call would, not from the fp32 initial state (dht).
  const uint8_t* doc_flags;
};

cudaError_t gdn_bwd_local_launch(const GdnBwdLocalArgs& args, cudaStream_t stream);

}  // namespace cake

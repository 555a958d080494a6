#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "dtype.h"

namespace cake {

// Forward of the chunked gated delta rule over packed documents (DESIGN.md §1), for
// head dims K = V = 128, chunk 64, in two kernels:
//   prep (gdn_fwd_prep.cu): per (chunk slot, q/k head): optional L2 norm of q and k,
//        K K^T once for the G value heads, then per value head the chunk-local gate
//        cumsum gcum and A = (I + tril(beta_i e^(gcum_i - gcum_j) k_i.k_j, -1))^-1,
//        stored with beta folded in: a_ws = A diag(beta) (bf16).
//   walk (gdn_fwd_walk.cu): per (document, value head): the state walk with the output
//        fused, S^T kept in registers across chunks (wgmma, warp-specialised):
//        v_new = A diag(beta) (v - e^gcum (k S)),  o = scale e^gcum (q S) + P v_new,
//        S <- e^gl S + (e^(gl - gcum) k)^T v_new,  P = scale tril(q k^T * e^(gcum_i - gcum_j)).
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
//   qn, kn         [T, H, 128] bf16              L2-normalised q, k (only if use_qk_l2norm)
// with NC = ceil(T / 64) + N chunk slots. Launch sizes depend on T, N, H, HV only: no
// host sync, CUDA-graph capturable. Deterministic: fixed reduction orders, no atomics.
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
  void* qn;
  void* kn;
  int64_t T, N, H, HV;
  float scale;
  bool use_qk_l2norm;
};

constexpr int kGdnHeadDim = 128;

inline int64_t gdn_fwd_chunk_slots(int64_t T, int64_t N) { return (T + 63) / 64 + N; }
inline int64_t gdn_fwd_workspace_a_elems(int64_t T, int64_t N, int64_t HV) {
  return gdn_fwd_chunk_slots(T, N) * HV * 64 * 64;
}
inline int64_t gdn_fwd_workspace_gcum_elems(int64_t T, int64_t N, int64_t HV) {
  return gdn_fwd_chunk_slots(T, N) * HV * 64;
}

// The whole forward: prep, then walk. Returns the first launch error.
cudaError_t gdn_fwd_launch(const GdnFwdArgs& args, cudaStream_t stream);

// The two stages (also usable alone, e.g. by a backward that recomputes the forward).
cudaError_t gdn_fwd_prep_launch(const GdnFwdArgs& args, cudaStream_t stream);
cudaError_t gdn_fwd_walk_launch(const GdnFwdArgs& args, cudaStream_t stream);

}  // namespace cake

#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/dtype.h"

namespace cake {

// Depthwise causal convolution over packed variable-length documents.
//
//   x             [T, D]       x_dtype (fp32, fp16, bf16), row-major
//   weight        [D, W]       w_dtype (fp32 or x_dtype), 1 <= W <= 4
//   bias          [D]          w_dtype, or nullptr
//   cu_seqlens    [N + 1]      int64 if cu_int64 else int32: 0, non-decreasing, T
//   initial_state [N, D, W-1]  s_dtype (fp32 or x_dtype), or nullptr;
//                              initial_state[n, d, j] is channel d at position
//                              cu_seqlens[n] - (W - 1) + j (j = W-2: the token
//                              just before document n)
//   y             [T, D]       x_dtype, every element written
//
//   y[t, d] = act(bias[d] + sum_i weight[d, i] * x[t - (W-1) + i, d]), where
//   positions before the token's document read initial_state (or zero), and act
//   is SiLU if silu else identity. Accumulates in fp32; deterministic. The
//   document of a token is found on the device, so no host sync: capturable in
//   CUDA graphs. Returns the launch error; cudaErrorInvalidValue for a W or
//   x_dtype outside the ones above.
cudaError_t short_conv_fwd_launch(const void* x, const void* weight, const void* bias,
                                  const void* cu_seqlens, bool cu_int64,
                                  const void* initial_state, void* y, int64_t T, int64_t D,
                                  int W, int64_t N, DType x_dtype, DType w_dtype,
                                  DType s_dtype, bool silu, cudaStream_t stream);

// The backward's token tile: dweight and dbias are summed per tile of this many tokens
// (tile k: tokens k * kShortConvBwdTileTokens onwards) into fp32 partials, then over the
// tiles in order, so their bits depend on T only (not on the GPU or the launch shape).
constexpr int64_t kShortConvBwdTileTokens = 128;

// The backward's fp32 workspace is [short_conv_bwd_tiles(T), D, W + 1]: per token tile, the
// sums of the W taps of dweight, then of dbias. It needs no initialising: every element
// is written before it is read.
inline int64_t short_conv_bwd_tiles(int64_t T) {
  return (T + kShortConvBwdTileTokens - 1) / kShortConvBwdTileTokens;
}

// Backward of short_conv_fwd_launch, for the same x, weight, bias, cu_seqlens,
// initial_state, dtypes and silu:
//
//   dy             [T, D]       x_dtype, row-major (dense)
//   dx             [T, D]       x_dtype, every element written
//   dweight        [D, W]       w_dtype, every element written
//   dbias          [D]          w_dtype (bias has weight's dtype), written with or without bias
//   dinitial_state [N, D, W-1]  ds_dtype (fp32 or x_dtype: the initial state's, x's without
//                               one), written with or without an initial state (W = 1: none)
//   workspace      [short_conv_bwd_tiles(T), D, W + 1]  fp32, uninitialised
//
//   dpre[t, d]   = dy[t, d] * act'(pre[t, d]), pre recomputed in fp32 as the forward does
//   dx[t, d]     = sum_s dpre[t + s, d] * weight[d, W-1-s] over s < W with t + s in t's document
//   dweight[d,i] = sum_t dpre[t, d] * (the input at t - (W-1) + i, as the forward reads it)
//   dbias[d]     = sum_t dpre[t, d]
//   dinitial_state[n, d, j] = sum_{p <= j, p < len_n} dpre[c_n + p, d] * weight[d, j - p]
//
// Deterministic without float atomics: every dx and dinitial_state element is one
// thread's fixed-order sum over its own document, and dweight / dbias are summed per
// token tile (fixed order) and then over the tiles (fixed order), so every bit is a
// function of the inputs only. No host sync (capturable in CUDA graphs); launch sizes
// come from T, D, N. Returns the launch error; cudaErrorInvalidValue for a W or dtype
// outside the forward's.
cudaError_t short_conv_bwd_launch(const void* dy, const void* x, const void* weight,
                                  const void* bias, const void* cu_seqlens, bool cu_int64,
                                  const void* initial_state, void* dx, void* dweight,
                                  void* dbias, void* dinitial_state, float* workspace,
                                  int64_t T, int64_t D, int W, int64_t N, DType x_dtype,
                                  DType w_dtype, DType s_dtype, DType ds_dtype, bool silu,
                                  cudaStream_t stream);

}  // namespace cake

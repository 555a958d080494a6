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

}  // namespace cake

#pragma once

// Element access shared by the short convolution's kernels: conversions of x's dtype
// to and from fp32, runtime-dtype loads and stores of the small tensors (weight, bias,
// the initial state and their gradients: touched a handful of times per thread, so a
// runtime switch there keeps the instantiations to (x dtype) x W x vector width), and
// the aligned channel pack of the vector loads; and the launchers' runtime-to-compile-time
// dispatch of x's dtype and the width W.

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/dtype.h"

namespace cake::short_conv_elements {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float load_float(const void* p, int64_t i, DType dtype) {
  if (dtype == DType::kFloat16) return __half2float(static_cast<const __half*>(p)[i]);
  if (dtype == DType::kBFloat16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_float(void* p, int64_t i, DType dtype, float v) {
  if (dtype == DType::kFloat16) static_cast<__half*>(p)[i] = __float2half_rn(v);
  else if (dtype == DType::kBFloat16) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  else static_cast<float*>(p)[i] = v;
}

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// f(XT{}, std::integral_constant<int, W>{}) for x's element type and the width W in
// 1..4; cudaErrorInvalidValue for any other (the binding has refused them already).
template <typename F>
cudaError_t dispatch_dtype_width(DType x_dtype, int W, F&& f) {
  auto with_width = [&](auto x) -> cudaError_t {
    switch (W) {
      case 1: return f(x, std::integral_constant<int, 1>{});
      case 2: return f(x, std::integral_constant<int, 2>{});
      case 3: return f(x, std::integral_constant<int, 3>{});
      case 4: return f(x, std::integral_constant<int, 4>{});
      default: return cudaErrorInvalidValue;
    }
  };
  switch (x_dtype) {
    case DType::kFloat32: return with_width(float{});
    case DType::kFloat16: return with_width(__half{});
    case DType::kBFloat16: return with_width(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cake::short_conv_elements

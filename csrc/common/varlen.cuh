#pragma once

// Packed variable-length documents on the device (the CUDA side of cake_ops/varlen.py):
// tokens of document n are cu_seqlens[n] .. cu_seqlens[n + 1] - 1 of one [T, ...] tensor.

#include <cstdint>

namespace cake {

// cu_seqlens [N + 1], int32 or int64 (as the caller passed it: no conversion kernel).
struct CuSeqlens {
  const void* ptr;
  bool int64;

  __device__ __forceinline__ int64_t operator[](int64_t n) const {
    return int64 ? static_cast<const int64_t*>(ptr)[n] : static_cast<const int32_t*>(ptr)[n];
  }
};

// The last n < N with offsets[n] <= x, for non-decreasing offsets [N + 1] with
// offsets[0] <= x < offsets[N] (so documents with no slots, or no tokens, are skipped):
// binary search. offsets: an int32 pointer (slot offsets) or a CuSeqlens (tokens).
template <typename Offsets>
__device__ __forceinline__ int64_t find_document(const Offsets& offsets, int64_t N, int64_t x) {
  int64_t lo = 0, hi = N;  // offsets[lo] <= x < offsets[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid] <= x) lo = mid;
    else hi = mid;
  }
  return lo;
}

}  // namespace cake

#pragma once

// Inclusive prefix or suffix sums across a warp, prefix sums across a block (Hillis-Steele):
// fixed orders of additions, so the same inputs give the same bits on every run.

#include <cstdint>

namespace cake {

// Inclusive sums over the warp's lanes of each of the N values x[0..N-1], in place: prefix
// sums (lane l: lanes 0 .. l; shuffle-up) or, kSuffix, suffix sums (lanes l .. 31;
// shuffle-down). The N scans interleave step by step (independent shuffles in flight
// together).
template <bool kSuffix = false, typename T, int N>
__device__ __forceinline__ void warp_inclusive_scan(T (&x)[N]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
    for (int s = 0; s < N; ++s) {
      const T y = kSuffix ? __shfl_down_sync(0xffffffffu, x[s], o) : __shfl_up_sync(0xffffffffu, x[s], o);
      if (kSuffix ? lane + o < 32 : lane >= o) x[s] += y;
    }
  }
}

template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T x) {
  T v[1] = {x};
  warp_inclusive_scan(v);
  return v[0];
}

// Inclusive block-wide sum of x (blockDim.x a multiple of 32, at most 1024) and the
// block's total; warp_sums: 32 words of shared memory, free again on return.
__device__ __forceinline__ int32_t block_inclusive_scan(int32_t x, int32_t* warp_sums, int32_t& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  x = warp_inclusive_scan(x);
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) warp_sums[lane] = warp_inclusive_scan(lane < nwarps ? warp_sums[lane] : 0);
  __syncthreads();
  total = warp_sums[nwarps - 1];
  const int32_t result = x + (warp > 0 ? warp_sums[warp - 1] : 0);
  __syncthreads();  // warp_sums is rewritten by the next call
  return result;
}

}  // namespace cake

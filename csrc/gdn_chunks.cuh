#pragma once

// Packed variable-length documents cut into 64-token chunks, on the device (the CUDA
// side of cake_ops/varlen.py). Document n has ceil(len_n / 64) chunks; they occupy
// chunk slots chunk_offsets[n] .. chunk_offsets[n+1] - 1 of a static grid of
// ceil(T / 64) + N slots (an upper bound: no host sync, CUDA-graph safe). Slots at
// or past chunk_offsets[N] are unused.

#include <cstdint>

namespace cake {

constexpr int kGdnChunk = 64;

struct CuSeqlens {
  const void* ptr;
  bool int64;

  __device__ __forceinline__ int64_t operator[](int64_t n) const {
    return int64 ? static_cast<const int64_t*>(ptr)[n] : static_cast<const int32_t*>(ptr)[n];
  }
};

// Where a chunk sits: its document, first token and number of real tokens (1..64).
struct ChunkPos {
  int64_t doc;
  int64_t t0;
  int len;
};

// The chunk in `slot` (< chunk_offsets[N]): the document n with
// chunk_offsets[n] <= slot < chunk_offsets[n + 1] (so empty documents are skipped).
__device__ __forceinline__ ChunkPos find_chunk(const int32_t* chunk_offsets, CuSeqlens cu, int64_t N,
                                               int64_t slot) {
  int64_t lo = 0, hi = N;  // chunk_offsets[lo] <= slot < chunk_offsets[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (chunk_offsets[mid] <= slot) lo = mid;
    else hi = mid;
  }
  const int64_t start = cu[lo];
  const int64_t t0 = start + (slot - chunk_offsets[lo]) * kGdnChunk;
  const int64_t left = cu[lo + 1] - t0;
  return {lo, t0, static_cast<int>(left < kGdnChunk ? left : kGdnChunk)};
}

}  // namespace cake

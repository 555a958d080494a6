#pragma once

// Bank-conflict-free layout of a row-major shared-memory tile of 16-byte chunks.
//
// A tile row of RC chunks (RC * 8 bf16) is stored with its logical chunk c at physical
// chunk c ^ f(row), f chosen so that the 8 row addresses of one ldmatrix / stmatrix
// matrix (8 consecutive rows, one logical chunk) fall in 8 distinct 16-byte bank groups.
// cp.async writes whole chunks, so the permutation costs nothing on the load side.

namespace cake {

// Byte offset of (row, logical chunk) in a tile whose rows are RC 16-byte chunks.
template <int RC>
__device__ __forceinline__ int swizzle_offset(int row, int chunk) {
  static_assert(RC == 2 || RC == 4 || RC >= 8, "rows of 2, 4 or a multiple of 8 chunks");
  static_assert(RC < 8 || RC % 8 == 0, "rows of 2, 4 or a multiple of 8 chunks");
  if constexpr (RC >= 8) {
    return (row * RC + (chunk ^ (row & 7))) * 16;  // 128-byte rows or wider: one row per bank line
  } else if constexpr (RC == 4) {
    return (row * RC + (chunk ^ ((row >> 1) & 3))) * 16;  // two rows per bank line
  } else {
    return (row * RC + (chunk ^ ((row >> 2) & 1))) * 16;  // four rows per bank line
  }
}

}  // namespace cake

#pragma once

// Bank-conflict-free layouts of shared-memory tiles of 16-byte chunks: the 16-byte chunk
// c of row r is stored at chunk c ^ (r & 7) of its 128-byte line, so the 8 row addresses
// of one ldmatrix / stmatrix matrix (8 consecutive rows, one logical chunk) fall in 8
// distinct 16-byte bank groups. Two layouts differ in where a row wider than 128 bytes
// goes; each has one helper:
//   swizzle_rows_offset<RC>: row-major, a row is RC chunks (RC * 16 bytes) in one piece;
//     written by cp.async whole chunks (the prep's k tile).
//   sw128_offset: the hardware's 128-byte swizzle (SW128) that TMA writes and wgmma reads:
//     a tile wider than 64 bf16 is column blocks of 64, each rows x 128 bytes, block
//     after block (wgmma_sm90.cuh; the walk's tiles).

namespace cake {

// Byte offset of (row, logical chunk) in a row-major tile whose rows are RC 16-byte chunks.
template <int RC>
__device__ __forceinline__ int swizzle_rows_offset(int row, int chunk) {
  static_assert(RC % 8 == 0, "rows of whole 128-byte lines");
  return (row * RC + (chunk ^ (row & 7))) * 16;
}

// Byte offset of 16-byte chunk `chunk` (0 .. 8 * blocks - 1) of row `row` in an SW128
// tile of `rows` rows.
__device__ __forceinline__ int sw128_offset(int rows, int row, int chunk) {
  return (chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

}  // namespace cake

#pragma once

// Warpgroup tensor-core building blocks (sm_90a PTX): wgmma.mma_async with A from
// registers (RS) or shared memory (SS), B from shared memory through a matrix
// descriptor, bf16 in, fp32 accumulate; and the shared-memory tile layout they read.
//
// Register layouts of m64nNk16 for the warpgroup's 128 threads (warp w, lane = 4 gid + t4):
//   accumulator d[4j + e]: row 16w + gid + 8 (e >> 1), column 8j + 2 t4 + (e & 1);
//   A fragment a[0..3] (bf16 pairs): rows 16w + gid (+8), columns 2 t4 (+8) of the k16 step,
//   as in mma.m16n8k16. So the accumulator columns 16j .. 16j + 15 become the A fragment of
//   k-step j by pairing registers (to_a_frag): a product feeds the next in registers.
//
// Shared tiles ("SW128"): rows of 64 bf16 (128 bytes) with 16-byte chunk c of row r
// stored at chunk c ^ (r & 7); a tile wider than 64 columns is column blocks of 64, each
// block rows x 128 bytes, block after block. Every tile starts 1024-byte aligned. This is
// the hardware's 128-byte swizzle, so one layout serves wgmma in both majors:
//   K-major operand (rows = M or N, columns = K): descriptor stride 1024 (8 rows), the
//     k16 step s of block s / 4 starts 32 (s % 4) bytes into it;
//   MN-major operand (rows = K, columns = M or N): leading offset = one column block
//     (N beyond 64), stride 1024 (8 rows of K), the k16 step s starts 16 rows down.
// ldmatrix / stmatrix reach the same tiles through sw128_offset (swizzle.cuh), conflict-free.

#include <cstdint>

#include <cuda_bf16.h>

#include "common/mma_sm80.cuh"
#include "common/swizzle.cuh"

namespace cake::wgmma {

// Matrix descriptor: start address, leading and stride byte offsets, 128-byte swizzle.
// constexpr: a kernel that knows its tiles' addresses at compile time (bwd_local.cu) gets
// immediates, which ptxas moves to the uniform registers wgmma reads without R2UR.
__host__ __device__ constexpr uint64_t desc_sw128(uint32_t smem_addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (static_cast<uint64_t>(1) << 62);  // swizzle: 128 bytes
}

// The k16 steps of one tile differ only in the start address: its field (address >> 4,
// bits 0..13) takes the step's byte offset >> 4 without a carry out, since shared memory
// lies below 256 KB. So a tile's descriptor is formed once and each step adds a constant.

// The step offsets (descriptor units): k16 step `s` of a K-major tile with `rows` rows,
// of an MN-major tile.
__host__ __device__ constexpr uint32_t k_major_step(int rows, int s) {
  return static_cast<uint32_t>(((s >> 2) * rows * 128 + (s & 3) * 32) >> 4);
}
__host__ __device__ constexpr uint32_t mn_major_step(int s) { return static_cast<uint32_t>((s * 16 * 128) >> 4); }

// d advanced by `step` descriptor units. The start-address field takes it without a carry
// out (above), so only the low word changes: the high word (offsets, swizzle) stays a value
// the compiler knows, and the step is one 32-bit add instead of a 64-bit carry chain and a
// move of both words to uniform registers per wgmma.
__host__ __device__ constexpr uint64_t desc_add(uint64_t d, uint32_t step) {
  return (d & 0xffffffff00000000ull) | static_cast<uint32_t>(static_cast<uint32_t>(d) + step);
}

// Step 0 of a K-major SW128 tile at `tile`; of an MN-major one (rows = K) with `rows` rows.
__host__ __device__ constexpr uint64_t desc_k_major(uint32_t tile) { return desc_sw128(tile, 16, 1024); }
__host__ __device__ constexpr uint64_t desc_mn_major(uint32_t tile, int rows) {
  return desc_sw128(tile, static_cast<uint32_t>(rows) * 128, 1024);
}

// Operand k16 step `s` of a K-major SW128 tile with `rows` rows at `tile`.
__device__ __forceinline__ uint64_t desc_k_major(uint32_t tile, int rows, int s) {
  return desc_k_major(tile) + k_major_step(rows, s);
}

// Operand k16 step `s` of an MN-major SW128 tile (rows = K) with `rows` rows at `tile`.
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t tile, int rows, int s) {
  return desc_mn_major(tile, rows) + mn_major_step(s);
}

// Accumulator columns 16 j .. 16 j + 15 as the bf16 A fragment of k-step j: the
// accumulator's register order is mma.m16n8k16's, so mma_sm80.cuh's helpers serve as they are.
using mma::to_a_frag;
using mma::to_a_frags;

// Orders register writes before the wgmma that reads them (accumulators, A fragments).
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most `N` committed groups are still running.
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accesses of an accumulator across the asynchronous
// window between an mma and its wait.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared memory written by ordinary stores (or cp.async) that wgmma reads next.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d[0..31] (+)= A (registers) * B (shared, descriptor b): m64n64k16, bf16 -> fp32.
template <int kTransB>
__device__ __forceinline__ void mma_rs_m64n64k16(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB));
}

// d = A B, m64n64, a fresh product of kSteps k16 steps: A's fragments a[ks], B the SW128
// tile of 64 K-rows at `tile` (K-major, or MN-major for kTransB). d is zeroed (the asm reads
// its registers) and the first step overwrites it. Fences, then issues; the caller commits.
template <int kTransB, int kSteps>
__device__ __forceinline__ void mma_rs_m64n64_fresh(float (&d)[32], const uint32_t (&a)[kSteps][4], uint32_t tile) {
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  fence();
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks)
    mma_rs_m64n64k16<kTransB>(d, a[ks], kTransB ? desc_mn_major(tile, 64, ks) : desc_k_major(tile, 64, ks), ks > 0);
}

// d[0..63] (+)= A (registers) * B (shared, descriptor b): m64n128k16, bf16 -> fp32.
template <int kTransB>
__device__ __forceinline__ void mma_rs_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB));
}

// d[0..31] (+)= A (shared, descriptor a) * B (shared, descriptor b): m64n64k16, bf16 -> fp32;
// kTransA / kTransB = 1: that operand is stored MN-major.
template <int kTransA, int kTransB>
__device__ __forceinline__ void mma_ss_m64n64k16(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

// d[0..15] (+)= A (shared, descriptor a) * B (shared, descriptor b): m64n32k16, as above.
template <int kTransA, int kTransB>
__device__ __forceinline__ void mma_ss_m64n32k16(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, %19, %20;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

// d[0..63] (+)= A (shared, descriptor a) * B (shared, descriptor b): m64n128k16, as above.
template <int kTransA, int kTransB>
__device__ __forceinline__ void mma_ss_m64n128k16(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63},"
      " %64, %65, p, 1, 1, %67, %68;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

// d (+)= A B over kSteps k16 steps from two SW128 tiles of 64 rows at a and b: A K-major
// (its 64 M rows) or, kTransA, MN-major (64 K rows); B K-major (its 64 N rows) or,
// kTransB, MN-major (64 K rows; N = 64, or 128 in two column blocks). accumulate = false:
// the first step overwrites d (whose registers the asm still reads: zero them first).
// Fences and issues; the caller commits.
template <int kSteps, int kTransA, int kTransB, int N>
__device__ __forceinline__ void mma_ss_tiles64(float (&d)[N], uint32_t a, uint32_t b, bool accumulate) {
  static_assert(N == 32 || (N == 64 && kTransB), "m64n64, or m64n128 with B MN-major");
  fence();
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    const uint64_t da = kTransA ? desc_mn_major(a, 64, ks) : desc_k_major(a, 64, ks);
    const uint64_t db = kTransB ? desc_mn_major(b, 64, ks) : desc_k_major(b, 64, ks);
    if constexpr (N == 32) mma_ss_m64n64k16<kTransA, kTransB>(d, da, db, accumulate || ks > 0);
    else mma_ss_m64n128k16<kTransA, kTransB>(d, da, db, accumulate || ks > 0);
  }
}

// Commits the issued products and waits for all of them: d may be read.
template <int N>
__device__ __forceinline__ void commit_and_wait(float (&d)[N]) {
  commit();
  wait<0>();
  fence_operands(d);
}

}  // namespace cake::wgmma

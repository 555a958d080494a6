#pragma once

// Warp-level tensor-core and shared-memory building blocks (sm_80+ PTX, used on sm_90a):
// mma.sync m16n8k16 bf16 -> fp32 and m16n8k8 tf32 -> fp32, ldmatrix / stmatrix, cp.async
// with zero fill, bf16 packing, accumulator -> A fragment and per-column scaling, named
// barriers and the MUFU exponential.
//
// Fragment layouts of mma.m16n8k16 (lane = 4 * gid + tid4):
//   A 16x16 (row): a0 (gid,    2*tid4 .. +1)   a1 (gid + 8, 2*tid4 .. +1)
//                  a2 (gid,    2*tid4 + 8 ..)  a3 (gid + 8, 2*tid4 + 8 ..)
//   B 16x8  (col): b0 (k = 2*tid4 .. +1, n = gid)   b1 (k = 2*tid4 + 8 .. +1, n = gid)
//   C 16x8       : c0, c1 (gid, 2*tid4 .. +1)   c2, c3 (gid + 8, 2*tid4 .. +1)
// So two C tiles side by side (16x16, fp32) pack (pack_bf16) into one A fragment: an
// accumulator becomes the next product's left operand without shared memory (to_a_frag;
// the warpgroup accumulator of wgmma has the same register order, so it serves there too).

#include <cstdint>

#include <cuda_bf16.h>

namespace cake::mma {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Two floats -> one register of two bf16 (round to nearest even); `lo` has the lower index.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// One register of two bf16 -> two floats (exact): (low, high) half, pack_bf16's inverse.
__device__ __forceinline__ float2 unpack_bf16(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// Accumulator columns 16 j .. 16 j + 15 (n-tiles 2 j, 2 j + 1: registers d[8 j .. 8 j + 7])
// as the bf16 A fragment of k-step j.
template <int N>
__device__ __forceinline__ void to_a_frag(uint32_t (&a)[4], const float (&d)[N], int j) {
  a[0] = pack_bf16(d[8 * j + 0], d[8 * j + 1]);
  a[1] = pack_bf16(d[8 * j + 2], d[8 * j + 3]);
  a[2] = pack_bf16(d[8 * j + 4], d[8 * j + 5]);
  a[3] = pack_bf16(d[8 * j + 6], d[8 * j + 7]);
}

// The A fragments of all K k-steps of an accumulator (to_a_frag for j = 0 .. K - 1).
template <int K, int N>
__device__ __forceinline__ void to_a_frags(uint32_t (&a)[K][4], const float (&d)[N]) {
#pragma unroll
  for (int j = 0; j < K; ++j) to_a_frag(a[j], d, j);
}

// A 64-column accumulator (8 n-tiles, as mma's or wgmma's: this thread's columns j = 8 jt +
// 2 t4 (+1)) times the per-column factors f[j] (read where used: registers are scarce).
__device__ __forceinline__ void scale_columns(float (&acc)[32], const float* f, int t4) {
#pragma unroll
  for (int jt = 0; jt < 8; ++jt) {
    const float2 e = *reinterpret_cast<const float2*>(f + 8 * jt + 2 * t4);
    acc[4 * jt + 0] *= e.x;
    acc[4 * jt + 1] *= e.y;
    acc[4 * jt + 2] *= e.x;
    acc[4 * jt + 3] *= e.y;
  }
}

// The bf16 A fragments of 4 k-steps over tokens (columns = tokens: register r of k-step
// ks holds tokens 16 ks + 8 (r >> 1) + 2 t4 (+1)) times the per-token factors f, in fp32,
// rounded to bf16 again.
__device__ __forceinline__ void scale_token_frags(uint32_t (&a)[4][4], const float* f, int t4) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float2 e = *reinterpret_cast<const float2*>(f + 16 * ks + 8 * (r >> 1) + 2 * t4);
      const uint32_t w = a[ks][r];
      a[ks][r] = pack_bf16(__uint_as_float(w << 16) * e.x, __uint_as_float(w & 0xffff0000u) * e.y);
    }
  }
}

// d += a * b (m16n8k16, bf16 inputs, fp32 accumulate).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices; lanes 8i .. 8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// As ldmatrix_x4, each matrix transposed on the way (lane 4g+t gets rows 2t, 2t+1 of column g).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b (m16n8k8, tf32 inputs in b32 registers, fp32 accumulate); fragments as
// m16n8k16's with 32-bit elements: a0 (gid, tid4) a1 (gid + 8, tid4) a2 (gid, tid4 + 4)
// a3 (gid + 8, tid4 + 4); b0 (k = tid4, n = gid) b1 (k = tid4 + 4, n = gid).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

constexpr float kLog2e = 1.4426950408889634f;  // e^x = 2^(x kLog2e), the form exp2_ftz takes

// 2^x on the MUFU unit (relative error ~2^-22); results below 2^-126 flush to 0.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Inverse of ldmatrix_x4: stores four 8x8 matrices (sm_90); lanes 8i .. 8i+7 give the
// row addresses of matrix i, register i holds this lane's pair of matrix i.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}

// Inverse of ldmatrix_x4_trans: stores four 8x8 matrices transposed (sm_90).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// 16-byte global -> shared copy; writes zeros (and reads nothing) when !valid.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// One 16-byte global store. Written out because a uint4 store assembled from packed
// halves was split into four 4-byte stores before ptxas (4x the L2 sectors).
__device__ __forceinline__ void st_global_16(void* dst, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// The same store where `pred` holds, as one predicated instruction (no branch around it).
__device__ __forceinline__ void st_global_16_if(bool pred, void* dst, uint4 v) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n@p st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}\n" ::"l"(dst),
      "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(static_cast<int>(pred))
      : "memory");
}

// Named barriers: `threads` threads (a multiple of 32) of the CTA meet at barrier `id`
// (0 is __syncthreads's); bar_arrive counts without waiting.
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The whole CTA at barrier 0, in the non-.aligned form: for warps that reach it from
// different code (__syncthreads is the .aligned form, which requires the same instruction).
__device__ __forceinline__ void cta_barrier() { asm volatile("barrier.sync 0;\n" ::: "memory"); }

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

}  // namespace cake::mma

// Forward prep of the chunked gated delta rule (see gdn_fwd.h): chunk offsets, then
// per (chunk slot, q/k head) the optional L2 norm of q and k, K K^T, and per value head
// gcum and the WY inverse A diag(beta).
//
// NOTES:
// - K K^T (64x64x128, tensor cores) is formed once per q/k head and reused by the G
//   value heads; only the gating, beta and the inverse are per value head.
// - The inverse is fp32 on CUDA cores, blocked 16x16: diagonal blocks by forward
//   substitution (one thread per column), then block row I of the result from
//   A_IJ = -A_II sum_K L_IK A_KJ. fp32 keeps A exact to rounding even where the gated
//   L is ill-conditioned; A is rounded once, to the bf16 that the walk consumes.
// - Exponents are differences of chunk-local cumsums, clamped to <= 0 and masked before
//   use, so strong decay (gcum down to -1280 in a chunk) underflows to 0, never to
//   0 * inf.
// - gcum comes from a fixed-order warp scan: deterministic, bitwise run to run.

#include <cuda_bf16.h>

#include "gdn_chunks.cuh"
#include "gdn_fwd.h"
#include "mma_sm80.cuh"
#include "swizzle.cuh"

namespace cake {
namespace {

constexpr int kPrepThreads = 128;  // 4 warps; warp w owns rows 16w .. 16w+15 of the chunk
constexpr int kLd = 65;            // fp32 row stride of L and A: column walks are conflict-free
constexpr int kLdT = 49;           // row stride of the 16 x 48 block-row product
constexpr float kL2NormEps = 1e-6f;

// ---------------------------------------------------------------------------------
// chunk_offsets[n] = sum over m < n of ceil(len_m / 64): one block, a scan over N.
__global__ void __launch_bounds__(1024) gdn_chunk_offsets_kernel(CuSeqlens cu, int64_t N,
                                                                 int32_t* offsets) {
  __shared__ int32_t warp_sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  if (threadIdx.x == 0) offsets[0] = 0;
  int32_t carry = 0;
  for (int64_t base = 0; base < N; base += blockDim.x) {
    const int64_t n = base + threadIdx.x;
    int32_t x = 0;
    if (n < N) {
      const int64_t len = cu[n + 1] - cu[n];
      x = len > 0 ? static_cast<int32_t>((len + kGdnChunk - 1) / kGdnChunk) : 0;
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int32_t s = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t y = __shfl_up_sync(0xffffffffu, s, o);
        if (lane >= o) s += y;
      }
      warp_sums[lane] = s;
    }
    __syncthreads();
    if (n < N) offsets[n + 1] = carry + x + (warp > 0 ? warp_sums[warp - 1] : 0);
    carry += warp_sums[nwarps - 1];
    __syncthreads();  // warp_sums is rewritten by the next round
  }
}

__device__ __forceinline__ float load_beta(const void* beta, DType dtype, int64_t i) {
  if (dtype == DType::kBFloat16) return __bfloat162float(static_cast<const __nv_bfloat16*>(beta)[i]);
  return static_cast<const float*>(beta)[i];
}

// The chunk's 64 rows of x [T, H, 128] (bf16) for head h: zero past the document end;
// L2-normalised in fp32 if asked (then also written to `normed`, real rows only); into
// the swizzled shared tile `tile` unless null. Threads: 16 per row, 8 rows per pass.
__device__ __forceinline__ void load_rows(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* normed,
                                          unsigned char* tile, const ChunkPos& pos, int64_t H, int h,
                                          bool l2norm) {
  const int tid = threadIdx.x;
  const int c = tid & 15;
  uint4 raw[8];
#pragma unroll
  for (int it = 0; it < 8; ++it) {
    const int r = it * 8 + (tid >> 4);
    raw[it] = make_uint4(0u, 0u, 0u, 0u);
    if (r < pos.len) raw[it] = __ldg(reinterpret_cast<const uint4*>(x + ((pos.t0 + r) * H + h) * kGdnHeadDim + c * 8));
  }
#pragma unroll
  for (int it = 0; it < 8; ++it) {
    const int r = it * 8 + (tid >> 4);
    if (l2norm) {
      __nv_bfloat162* pair = reinterpret_cast<__nv_bfloat162*>(&raw[it]);
      float2 f[4];
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        f[e] = __bfloat1622float2(pair[e]);
        ss = fmaf(f[e].x, f[e].x, ss);
        ss = fmaf(f[e].y, f[e].y, ss);
      }
      // The 16 lanes of a row are one aligned half-warp.
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      const float rstd = rsqrtf(ss + kL2NormEps);
#pragma unroll
      for (int e = 0; e < 4; ++e) pair[e] = __floats2bfloat162_rn(f[e].x * rstd, f[e].y * rstd);
      if (r < pos.len) *reinterpret_cast<uint4*>(normed + ((pos.t0 + r) * H + h) * kGdnHeadDim + c * 8) = raw[it];
    }
    if (tile != nullptr) *reinterpret_cast<uint4*>(tile + swizzle_offset<16>(r, c)) = raw[it];
  }
}

__global__ void __launch_bounds__(kPrepThreads) gdn_fwd_prep_kernel(const GdnFwdArgs p) {
  // The k tile (bf16 64x128, swizzled) until K K^T is formed, then L (fp32 64 x kLd).
  __shared__ __align__(128) unsigned char s_k_or_l[64 * kLd * sizeof(float)];
  __shared__ float s_a[64 * kLd];
  __shared__ float s_t[16 * kLdT];
  __shared__ float s_gcum[64];
  __shared__ float s_beta[64];
  __shared__ float s_half;

  const int64_t slot = blockIdx.x / p.H;
  const int h = static_cast<int>(blockIdx.x % p.H);
  const int64_t NCused = p.chunk_offsets[p.N];
  if (slot >= NCused) return;  // an unused slot: nothing to do (the walk never reads it)
  const CuSeqlens cu{p.cu_seqlens, p.cu_int64};
  const ChunkPos pos = find_chunk(p.chunk_offsets, cu, p.N, slot);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int mi = lane >> 3, r8 = lane & 7;  // ldmatrix: matrix index and row of this lane's address

  // 1. k (and q, only to normalise it) for this chunk and q/k head.
  load_rows(static_cast<const __nv_bfloat16*>(p.k), static_cast<__nv_bfloat16*>(p.kn), s_k_or_l, pos, p.H,
            h, p.use_qk_l2norm);
  if (p.use_qk_l2norm)
    load_rows(static_cast<const __nv_bfloat16*>(p.q), static_cast<__nv_bfloat16*>(p.qn), nullptr, pos, p.H,
              h, true);
  for (int e = tid; e < 64 * kLd; e += kPrepThreads) s_a[e] = 0.f;  // blocks above the diagonal stay 0
  __syncthreads();

  // 2. K K^T, lower block triangle: warp w forms rows 16w.. for columns < 16w + 16.
  float kk[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) kk[j][0] = kk[j][1] = kk[j][2] = kk[j][3] = 0.f;
  {
    const uint32_t k_base = mma::smem_addr(s_k_or_l);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      uint32_t a[4];
      mma::ldmatrix_x4(a, k_base + swizzle_offset<16>(16 * warp + (mi & 1) * 8 + r8, 2 * ks + (mi >> 1)));
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        if (jp <= warp) {
          uint32_t b[4];
          mma::ldmatrix_x4(b, k_base + swizzle_offset<16>(16 * jp + (mi >> 1) * 8 + r8, 2 * ks + (mi & 1)));
          mma::mma_bf16(kk[2 * jp], a, b[0], b[1]);
          mma::mma_bf16(kk[2 * jp + 1], a, b[2], b[3]);
        }
      }
    }
  }

  float* s_l = reinterpret_cast<float*>(s_k_or_l);
  const int64_t G = p.HV / p.H;
  for (int64_t gi = 0; gi < G; ++gi) {
    const int64_t hv = h * G + gi;
    __syncthreads();  // the k tile (first head) or the previous head's L, A, gcum, beta are free

    // 3. gcum: chunk-local inclusive cumsum of g (pads have g = 0, so they repeat the last value).
    float x = 0.f;
    if (tid < 64) {
      const bool real = tid < pos.len;
      const int64_t idx = (pos.t0 + tid) * p.HV + hv;
      x = real ? p.g[idx] : 0.f;
      s_beta[tid] = real ? load_beta(p.beta, p.beta_dtype, idx) : 0.f;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
      }
      if (tid == 31) s_half = x;
    }
    __syncthreads();
    if (tid < 64) {
      if (tid >= 32) x += s_half;
      s_gcum[tid] = x;
      p.gcum[(slot * p.HV + hv) * 64 + tid] = x;
    }
    __syncthreads();

    // 4. L = strict_lower(beta_i e^(gcum_i - gcum_j) (K K^T)_ij), from the accumulators.
#pragma unroll
    for (int jt = 0; jt < 8; ++jt) {
      if ((jt >> 1) <= warp) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 16 * warp + gid + (e >> 1) * 8;
          const int j = 8 * jt + 2 * t4 + (e & 1);
          const float d = __expf(fminf(s_gcum[i] - s_gcum[j], 0.f));
          s_l[i * kLd + j] = j < i ? s_beta[i] * d * kk[jt][e] : 0.f;
        }
      }
    }
    __syncthreads();

    // 5. A = (I + L)^-1. Diagonal blocks: thread (b, c) solves column c of block b.
    if (tid < 64) {
      const int b = tid >> 4, c = tid & 15;
      const float* lb = s_l + 16 * b * kLd + 16 * b;
      float xs[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        float acc = 0.f;
#pragma unroll
        for (int q = 0; q < r; ++q) acc = fmaf(lb[r * kLd + q], xs[q], acc);
        xs[r] = r == c ? 1.f : (r > c ? -acc : 0.f);
      }
      float* ab = s_a + 16 * b * kLd + 16 * b;
#pragma unroll
      for (int r = 0; r < 16; ++r) ab[r * kLd + c] = xs[r];
    }
    // Block row I: T = L[I, :I] A[:I, :I], then A[I, :I] = -A_II T.
#pragma unroll 1
    for (int I = 1; I < 4; ++I) {
      const int W = 16 * I;
      __syncthreads();
      for (int e = tid; e < 16 * W; e += kPrepThreads) {
        const int i = e / W, col = e - i * W;
        const float* lrow = s_l + (W + i) * kLd;
        float acc = 0.f;
        for (int q = 0; q < W; ++q) acc = fmaf(lrow[q], s_a[q * kLd + col], acc);
        s_t[i * kLdT + col] = acc;
      }
      __syncthreads();
      for (int e = tid; e < 16 * W; e += kPrepThreads) {
        const int i = e / W, col = e - i * W;
        const float* arow = s_a + (W + i) * kLd + W;
        float acc = 0.f;
#pragma unroll
        for (int m = 0; m < 16; ++m) acc = fmaf(arow[m], s_t[m * kLdT + col], acc);
        s_a[(W + i) * kLd + col] = -acc;
      }
    }
    __syncthreads();

    // 6. a_ws = A diag(beta) in bf16, the whole 64x64 tile (zeros above the diagonal).
    __nv_bfloat16* a_out = static_cast<__nv_bfloat16*>(p.a) + (slot * p.HV + hv) * 64 * 64;
    for (int e = tid; e < 64 * 8; e += kPrepThreads) {
      const int i = e >> 3, j0 = (e & 7) * 8;
      uint32_t w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int j = j0 + 2 * q;
        const float v0 = j <= i ? s_a[i * kLd + j] * s_beta[j] : 0.f;
        const float v1 = j + 1 <= i ? s_a[i * kLd + j + 1] * s_beta[j + 1] : 0.f;
        w[q] = mma::pack_bf16(v0, v1);
      }
      *reinterpret_cast<uint4*>(a_out + i * 64 + j0) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

}  // namespace

cudaError_t gdn_fwd_prep_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  if (p.N <= 0) return cudaSuccess;
  gdn_chunk_offsets_kernel<<<1, 1024, 0, stream>>>(CuSeqlens{p.cu_seqlens, p.cu_int64}, p.N,
                                                   p.chunk_offsets);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.T == 0 || p.H == 0) return err;
  const int64_t blocks = gdn_fwd_chunk_slots(p.T, p.N) * p.H;
  gdn_fwd_prep_kernel<<<static_cast<unsigned>(blocks), kPrepThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cake

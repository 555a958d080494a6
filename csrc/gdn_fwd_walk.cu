// Forward walk of the chunked gated delta rule with the output fused (see gdn_fwd.h).
//
// One CTA per (document, value head): two warpgroups, each holding 64 rows (value
// columns) of the transposed state S^T (64 x 128 fp32, 64 registers per thread) across
// all chunks of the document. They share the loads of q, k, v, A diag(beta), gcum and
// the gated P~ (each forms half of its columns). Per chunk, every product is a
// warpgroup MMA (wgmma, bf16 in, fp32 accumulate), B always from shared memory:
//   P    = Q K^T, this warpgroup's 32 columns      SS   m64n32k128
//   U^T  = S^T K^T                                 RS   m64n64k128
//   O^T  = S^T Q^T                                 RS   m64n64k128
//   X    = (V^T - e^gcum * U^T) (A diag(beta))^T   RS   m64n64k64, twice   (X = v_new^T)
//   O^T  = scale e^gcum_i * O^T + X P~^T           RS   m64n64k64          (P~ = gated tril P)
//   S^T  = e^gl S^T + (X * e^(gl - gcum)) K        RS   m64n128k64 (K as an MN-major operand)
// The chain S -> U -> X -> S never leaves registers: S^T, W' = -e^gcum U^T and X are
// accumulators turned into the next product's A fragment (wgmma_sm90.cuh). Q, K, V,
// A diag(beta) and gcum of chunk c + 1 load (cp.async, zero fill past the document end)
// while chunk c computes; the two warpgroups' serial chains hide each other's latency.
//
// NOTES:
// - Value columns never mix (every product contracts over the head dim or over tokens),
//   so a value column's result is the same instruction sequence whichever warpgroup runs it.
// - Two warpgroups of one (document, head) rather than two CTAs: one copy of the shared
//   tiles in shared memory (room for P~) and half the L2 traffic per head.
// - Exponents are differences of chunk-local cumsums clamped to <= 0: strong decay
//   underflows to 0, never to 0 * inf.
// - o is staged (stmatrix.trans) into the warp's own, consumed columns of the V tile and
//   stored 16 bytes per lane, real token rows only: a ragged chunk never writes into the
//   next document.

#include <cuda_bf16.h>

#include "gdn_chunks.cuh"
#include "gdn_fwd.h"
#include "mma_sm80.cuh"
#include "wgmma_sm90.cuh"

namespace cake {
namespace {

constexpr int kWalkThreads = 256;  // two warpgroups
constexpr int kBV = 64;             // value columns per warpgroup: its wgmma M
constexpr int kQOff = 0;
constexpr int kKOff = kQOff + 64 * kGdnHeadDim * 2;
constexpr int kVOff = kKOff + 64 * kGdnHeadDim * 2;
constexpr int kAOff = kVOff + 64 * kGdnHeadDim * 2;
constexpr int kGOff = kAOff + 64 * 64 * 2;
constexpr int kStageBytes = kGOff + 1024;  // gcum (256 bytes), padded: every tile stays 1024-aligned
constexpr int kPOff = 2 * kStageBytes;     // two load stages, then P~
constexpr int kSmemBytes = kPOff + 64 * 64 * 2 + 1024;  // + slack to align the base to 1024

__global__ void __launch_bounds__(kWalkThreads, 1) gdn_fwd_walk_kernel(const GdnFwdArgs p) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (mma::smem_addr(smem_raw) & 1023)) & 1023);

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7, warp = (tid >> 5) & 3;  // warpgroup, and warp within it
  const int gid = lane >> 2, t4 = lane & 3;
  const int mi = lane >> 3, r8 = lane & 7;  // ldmatrix/stmatrix: this lane's matrix and row

  const int64_t hv = blockIdx.x % p.HV;
  const int64_t n = blockIdx.x / p.HV;
  const int64_t h = hv / (p.HV / p.H);
  const int v0 = wg * kBV;

  const CuSeqlens cu{p.cu_seqlens, p.cu_int64};
  const int64_t doc_start = cu[n], doc_end = cu[n + 1];
  const int nch = doc_end > doc_start ? static_cast<int>((doc_end - doc_start + kGdnChunk - 1) / kGdnChunk) : 0;
  const int64_t first_slot = p.chunk_offsets[n];

  __nv_bfloat16* og = static_cast<__nv_bfloat16*>(p.o);
  const float scale = p.scale;

  // S^T accumulator: s[4 nt + e] is value column `col` (+8 for e >= 2), head dim 8 nt + 2 t4 + (e & 1).
  const int col = v0 + 16 * warp + gid;
  float s[64];
  if (p.initial_state != nullptr) {
    const float* h0 = p.initial_state + (n * p.HV + hv) * kGdnHeadDim * kGdnHeadDim;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int kd = 8 * nt + 2 * t4;
      s[4 * nt + 0] = h0[kd * kGdnHeadDim + col];
      s[4 * nt + 1] = h0[(kd + 1) * kGdnHeadDim + col];
      s[4 * nt + 2] = h0[kd * kGdnHeadDim + col + 8];
      s[4 * nt + 3] = h0[(kd + 1) * kGdnHeadDim + col + 8];
    }
  } else {
#pragma unroll
    for (int i = 0; i < 64; ++i) s[i] = 0.f;
  }

  // Loads of one chunk: thread tid copies 16-byte chunk `lc` of rows lr + 16 it of the
  // q, k and v tiles and of rows ar + 32 it of the A tile; rows past the document end
  // read nothing and are zero-filled. Pointers at the document's first row.
  const int lr = tid >> 4, lc = tid & 15;
  const int ar = tid >> 3, ac = tid & 7;
  const int64_t qk_row = p.H * kGdnHeadDim, v_row = p.HV * kGdnHeadDim;
  const __nv_bfloat16* qd =
      static_cast<const __nv_bfloat16*>(p.use_qk_l2norm ? p.qn : p.q) + (doc_start + lr) * qk_row + h * kGdnHeadDim + lc * 8;
  const __nv_bfloat16* kd =
      static_cast<const __nv_bfloat16*>(p.use_qk_l2norm ? p.kn : p.k) + (doc_start + lr) * qk_row + h * kGdnHeadDim + lc * 8;
  const __nv_bfloat16* vd = static_cast<const __nv_bfloat16*>(p.v) + (doc_start + lr) * v_row + hv * kGdnHeadDim + lc * 8;
  const __nv_bfloat16* ad = static_cast<const __nv_bfloat16*>(p.a) + (first_slot * p.HV + hv) * 64 * 64 + ar * 64 + ac * 8;
  const float* gd = p.gcum + (first_slot * p.HV + hv) * 64 + tid * 4;
  const int qkv_off = wgmma::sw128_offset(64, lr, lc), a_off = wgmma::sw128_offset(64, ar, ac);

  auto issue_loads = [&](int c, int stage) {
    const uint32_t st = mma::smem_addr(smem + stage * kStageBytes);
    const int left = static_cast<int>(doc_end - doc_start) - c * kGdnChunk - lr;  // rows of this thread < left are real
    const int64_t tok = static_cast<int64_t>(c) * kGdnChunk;
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const bool ok = 16 * it < left;
      const int64_t r = ok ? tok + 16 * it : 0;
      mma::cp_async_16(st + kQOff + qkv_off + 2048 * it, qd + r * qk_row, ok);
      mma::cp_async_16(st + kKOff + qkv_off + 2048 * it, kd + r * qk_row, ok);
      mma::cp_async_16(st + kVOff + qkv_off + 2048 * it, vd + r * v_row, ok);
    }
    const int64_t a_chunk = static_cast<int64_t>(c) * p.HV * 64 * 64;
#pragma unroll
    for (int it = 0; it < 2; ++it) mma::cp_async_16(st + kAOff + a_off + 4096 * it, ad + a_chunk + 32 * 64 * it, true);
    if (tid < 16) mma::cp_async_16(st + kGOff + tid * 16, gd + static_cast<int64_t>(c) * p.HV * 64, true);
  };

  const uint32_t sp = mma::smem_addr(smem + kPOff);

  if (nch > 0) issue_loads(0, 0);
  mma::cp_async_commit();

  for (int c = 0; c < nch; ++c) {
    mma::cp_async_wait_all();
    wgmma::fence_proxy_async();  // cp.async wrote the tiles that wgmma reads
    __syncthreads();             // chunk c has landed; chunk c - 1's stage and P~ are free
    if (c + 1 < nch) issue_loads(c + 1, (c + 1) & 1);
    mma::cp_async_commit();

    unsigned char* st = smem + (c & 1) * kStageBytes;
    const uint32_t sq = mma::smem_addr(st + kQOff), sk = mma::smem_addr(st + kKOff);
    const uint32_t sv = mma::smem_addr(st + kVOff), sa = mma::smem_addr(st + kAOff);
    const float* gs = reinterpret_cast<const float*>(st + kGOff);
    const int64_t t0 = doc_start + static_cast<int64_t>(c) * kGdnChunk;
    const int len = static_cast<int>(min(doc_end - t0, static_cast<int64_t>(kGdnChunk)));

    // (1) Group 1: P = Q K^T (columns 32 wg ..) and U^T = S^T K^T. Group 2: O^T = S^T Q^T.
    uint32_t sfrag[8][4];
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) wgmma::to_a_frag(sfrag[ks], s, ks);
    float pq[16], u[32], o[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) u[i] = o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) pq[i] = 0.f;
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks)
      wgmma::mma_ss_m64n32k16(pq, wgmma::desc_k_major(sq, 64, ks), wgmma::desc_k_major(sk + 32 * 128 * wg, 64, ks), ks > 0);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) wgmma::mma_rs_m64n64k16<0>(u, sfrag[ks], wgmma::desc_k_major(sk, 64, ks), ks > 0);
    wgmma::commit();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) wgmma::mma_rs_m64n64k16<0>(o, sfrag[ks], wgmma::desc_k_major(sq, 64, ks), ks > 0);
    wgmma::commit();

    // Meanwhile: V^T as A fragments (tokens = k), and this thread's gate factors. The
    // accumulator columns of this thread are tokens j = 8 jt + 2 t4 + (e & 1).
    uint32_t vfrag[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      mma::ldmatrix_x4_trans(vfrag[ks],
                             sv + wgmma::sw128_offset(64, 16 * ks + (mi >> 1) * 8 + r8, 8 * wg + 2 * warp + (mi & 1)));
    float eg[16];  // e^gcum_j
#pragma unroll
    for (int jt = 0; jt < 8; ++jt) {
      const float2 gj = *reinterpret_cast<const float2*>(gs + 8 * jt + 2 * t4);
      eg[2 * jt] = __expf(gj.x);
      eg[2 * jt + 1] = __expf(gj.y);
    }

    wgmma::wait<1>();
    wgmma::fence_operands(pq);
    wgmma::fence_operands(u);

    // (2) P~ = scale tril(P * e^(gcum_i - gcum_j)) into shared memory, bf16: rows i of
    // this thread 16 warp + gid (+8), columns j = 32 wg + 8 jt + 2 t4 (+1).
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = 16 * warp + gid + 8 * hh;
      const float gi = gs[i];
#pragma unroll
      for (int jt = 0; jt < 4; ++jt) {
        const int j = 32 * wg + 8 * jt + 2 * t4;
        const float2 gj = *reinterpret_cast<const float2*>(gs + j);
        // Computed for every element, then selected: no divergent branches.
        const float p0 = pq[4 * jt + 2 * hh] * scale * __expf(fminf(gi - gj.x, 0.f));
        const float p1 = pq[4 * jt + 2 * hh + 1] * scale * __expf(fminf(gi - gj.y, 0.f));
        *reinterpret_cast<uint32_t*>(smem + kPOff + wgmma::sw128_offset(64, i, 4 * wg + jt) + 4 * t4) =
            wgmma::pack_bf16(j <= i ? p0 : 0.f, j + 1 <= i ? p1 : 0.f);
      }
    }
    wgmma::fence_proxy_async();

    // (3) Group 3: X = V^T (A diag(beta))^T + W' (A diag(beta))^T with W' = -e^gcum_j U^T.
#pragma unroll
    for (int jt = 0; jt < 8; ++jt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) u[4 * jt + e] *= -eg[2 * jt + (e & 1)];
    }
    uint32_t wfrag[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::to_a_frag(wfrag[ks], u, ks);
    float x[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) x[i] = 0.f;
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::mma_rs_m64n64k16<0>(x, vfrag[ks], wgmma::desc_k_major(sa, 64, ks), ks > 0);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::mma_rs_m64n64k16<0>(x, wfrag[ks], wgmma::desc_k_major(sa, 64, ks), 1);
    wgmma::commit();

    // (4) O^T columns (tokens i) scaled by scale e^gcum_i, once group 2 is done.
    wgmma::wait<1>();
    wgmma::fence_operands(o);
#pragma unroll
    for (int jt = 0; jt < 8; ++jt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[4 * jt + e] *= scale * eg[2 * jt + (e & 1)];
    }
    wgmma::wait<0>();
    wgmma::fence_operands(x);
    __syncthreads();  // P~ complete from both warpgroups

    // (5) Group 4: O^T += X P~^T. Group 5: S^T = e^gl S^T + (X * e^(gl - gcum_j)) K.
    uint32_t xfrag[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::to_a_frag(xfrag[ks], x, ks);
    const float gl = gs[kGdnChunk - 1];
    const float gamma = __expf(gl);
#pragma unroll
    for (int jt = 0; jt < 8; ++jt) {
      const float2 gj = *reinterpret_cast<const float2*>(gs + 8 * jt + 2 * t4);
      const float d0 = __expf(fminf(gl - gj.x, 0.f));
      const float d1 = __expf(fminf(gl - gj.y, 0.f));
      x[4 * jt + 0] *= d0;
      x[4 * jt + 1] *= d1;
      x[4 * jt + 2] *= d0;
      x[4 * jt + 3] *= d1;
    }
    uint32_t xtfrag[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::to_a_frag(xtfrag[ks], x, ks);
#pragma unroll
    for (int i = 0; i < 64; ++i) s[i] *= gamma;
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::mma_rs_m64n64k16<0>(o, xfrag[ks], wgmma::desc_k_major(sp, 64, ks), 1);
    wgmma::commit();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      wgmma::mma_rs_m64n128k16<1>(s, xtfrag[ks], wgmma::desc_mn_major(sk, 64, ks), 1);
    wgmma::commit();
    wgmma::wait<1>();
    wgmma::fence_operands(o);

    // (6) o: stage O^T transposed into this warp's (consumed) columns of the V tile,
    // then 16-byte stores of the real rows. Overlaps the state update.
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      uint32_t r[4];
      wgmma::to_a_frag(r, o, jj);
      mma::stmatrix_x4_trans(sv + wgmma::sw128_offset(64, 16 * jj + (mi >> 1) * 8 + r8, 8 * wg + 2 * warp + (mi & 1)), r);
    }
    __syncwarp();
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int row = 16 * it + (lane >> 1), ch = lane & 1;
      if (row < len) {
        const uint4 val =
            *reinterpret_cast<const uint4*>(st + kVOff + wgmma::sw128_offset(64, row, 8 * wg + 2 * warp + ch));
        *reinterpret_cast<uint4*>(og + ((t0 + row) * p.HV + hv) * kGdnHeadDim + v0 + 16 * warp + 8 * ch) = val;
      }
    }
    wgmma::wait<0>();
    wgmma::fence_operands(s);
  }

  // Final state (also for an empty document: the initial state or zeros).
  float* fs = p.final_state + (n * p.HV + hv) * kGdnHeadDim * kGdnHeadDim;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    const int kd2 = 8 * nt + 2 * t4;
    fs[kd2 * kGdnHeadDim + col] = s[4 * nt + 0];
    fs[(kd2 + 1) * kGdnHeadDim + col] = s[4 * nt + 1];
    fs[kd2 * kGdnHeadDim + col + 8] = s[4 * nt + 2];
    fs[(kd2 + 1) * kGdnHeadDim + col + 8] = s[4 * nt + 3];
  }
}

}  // namespace

cudaError_t gdn_fwd_walk_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  const cudaError_t err =
      cudaFuncSetAttribute(gdn_fwd_walk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  const int64_t blocks = p.N * p.HV;
  gdn_fwd_walk_kernel<<<static_cast<unsigned>(blocks), kWalkThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cake

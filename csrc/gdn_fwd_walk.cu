// Forward walk of the chunked gated delta rule with the output fused (see gdn_fwd.h).
//
// One CTA per (document, value head, tile of BV = 16 * NW value columns). Warp w owns
// 16 value columns and walks the document's chunks with its slice of the transposed
// state S^T (16 x 128 fp32, 64 registers per lane) kept in registers throughout. Per
// chunk, with every product on tensor cores (mma.sync m16n8k16, bf16 in, fp32 out):
//   P    = scale tril(Q K^T * e^(gcum_i - gcum_j))            64x64, shared by the CTA
//   O^T  = scale e^gcum * (S^T Q^T)                           [BV x 64]
//   U^T  = S^T K^T;  W' = -e^gcum * U^T                       [BV x 64]
//   X    = V^T (A diag(beta))^T + W' (A diag(beta))^T = v_new^T
//   O^T += X P^T
//   S^T  = e^gl S^T + (X * e^(gl - gcum)) K
// S^T, W', X and O^T are accumulators turned into the next product's A operand in
// registers (no shared-memory round trip on the serial chain); Q, K, V, A, P are
// read with ldmatrix from swizzled tiles. Loads of chunk c + 1 (cp.async, zero fill
// past the document end) overlap the math of chunk c.
//
// NOTES:
// - Each warp's columns are independent (products contract over the head dim or over
//   tokens, never over value columns), so a column's result is the same sequence of
//   instructions whatever BV is: block_v does not change any bit. P is formed per
//   16x16 tile by whichever warp owns it, in the same order, so it is BV-independent too.
// - Triangular operands (A, P) skip the k-steps above the diagonal.
// - o is staged (stmatrix.trans) into the warp's own columns of the V tile it has
//   consumed, then stored 16 bytes per lane, rows of real tokens only: a ragged chunk
//   never writes into the next document.

#include <cuda_bf16.h>

#include "gdn_chunks.cuh"
#include "gdn_fwd.h"
#include "mma_sm80.cuh"
#include "swizzle.cuh"

namespace cake {
namespace {

template <int NW>
struct WalkConfig {
  static constexpr int kThreads = 32 * NW;
  static constexpr int kBV = 16 * NW;         // value columns per CTA
  static constexpr int kVChunks = kBV / 8;    // 16-byte chunks per V-tile row
  static constexpr int kQKBytes = 64 * kGdnHeadDim * 2;
  static constexpr int kVBytes = 64 * kBV * 2;
  static constexpr int kQOff = 0;
  static constexpr int kKOff = kQOff + kQKBytes;
  static constexpr int kVOff = kKOff + kQKBytes;
  static constexpr int kAOff = kVOff + kVBytes;
  static constexpr int kGOff = kAOff + 64 * 64 * 2;
  static constexpr int kStageBytes = kGOff + 64 * 4;
  static constexpr int kPOff = 2 * kStageBytes;  // two load stages, then P
  static constexpr int kSmemBytes = kPOff + 64 * 64 * 2;
  static_assert(kStageBytes % 128 == 0, "stages stay 128-byte aligned");
};

template <int NW>
__global__ void __launch_bounds__(32 * NW) gdn_fwd_walk_kernel(const GdnFwdArgs p) {
  using C = WalkConfig<NW>;
  constexpr int kVTiles = kGdnHeadDim / C::kBV;
  extern __shared__ __align__(128) unsigned char smem[];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int mi = lane >> 3, r8 = lane & 7;  // ldmatrix/stmatrix: this lane's matrix and row

  const int64_t bid = blockIdx.x;
  const int vt = static_cast<int>(bid % kVTiles);
  const int64_t hv = (bid / kVTiles) % p.HV;
  const int64_t n = bid / (kVTiles * p.HV);
  const int64_t h = hv / (p.HV / p.H);
  const int v0 = vt * C::kBV;

  const CuSeqlens cu{p.cu_seqlens, p.cu_int64};
  const int64_t doc_start = cu[n], doc_end = cu[n + 1];
  const int nch = doc_end > doc_start ? static_cast<int>((doc_end - doc_start + kGdnChunk - 1) / kGdnChunk) : 0;
  const int64_t first_slot = p.chunk_offsets[n];

  const __nv_bfloat16* qg = static_cast<const __nv_bfloat16*>(p.use_qk_l2norm ? p.qn : p.q);
  const __nv_bfloat16* kg = static_cast<const __nv_bfloat16*>(p.use_qk_l2norm ? p.kn : p.k);
  const __nv_bfloat16* vg = static_cast<const __nv_bfloat16*>(p.v);
  const __nv_bfloat16* ag = static_cast<const __nv_bfloat16*>(p.a);
  __nv_bfloat16* og = static_cast<__nv_bfloat16*>(p.o);
  const float scale = p.scale;

  // S^T fragment: rows = value columns (col, col + 8), columns = head dim 8 nt + 2 t4 (+1).
  const int col = v0 + 16 * warp + gid;
  float s[16][4];
  if (p.initial_state != nullptr) {
    const float* h0 = p.initial_state + (n * p.HV + hv) * kGdnHeadDim * kGdnHeadDim;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int kd = 8 * nt + 2 * t4;
      s[nt][0] = h0[kd * kGdnHeadDim + col];
      s[nt][1] = h0[(kd + 1) * kGdnHeadDim + col];
      s[nt][2] = h0[kd * kGdnHeadDim + col + 8];
      s[nt][3] = h0[(kd + 1) * kGdnHeadDim + col + 8];
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
  }

  auto chunk_t0 = [&](int c) { return doc_start + static_cast<int64_t>(c) * kGdnChunk; };
  auto chunk_len = [&](int c) {
    const int64_t left = doc_end - chunk_t0(c);
    return static_cast<int>(left < kGdnChunk ? left : kGdnChunk);
  };

  // Loads of chunk c into a stage: q, k, v rows past the document end are zero-filled.
  auto issue_loads = [&](int c, int stage) {
    unsigned char* st = smem + stage * C::kStageBytes;
    const int64_t t0 = chunk_t0(c);
    const int len = chunk_len(c);
    const int64_t slot = first_slot + c;
    const uint32_t sq = mma::smem_addr(st + C::kQOff), sk = mma::smem_addr(st + C::kKOff);
    const uint32_t sv = mma::smem_addr(st + C::kVOff), sa = mma::smem_addr(st + C::kAOff);
    for (int idx = tid; idx < 64 * 16; idx += C::kThreads) {
      const int r = idx >> 4, ch = idx & 15;
      const bool ok = r < len;
      const int64_t row = ((t0 + (ok ? r : 0)) * p.H + h) * kGdnHeadDim + ch * 8;
      mma::cp_async_16(sq + swizzle_offset<16>(r, ch), qg + row, ok);
      mma::cp_async_16(sk + swizzle_offset<16>(r, ch), kg + row, ok);
    }
    for (int idx = tid; idx < 64 * C::kVChunks; idx += C::kThreads) {
      const int r = idx / C::kVChunks, ch = idx % C::kVChunks;
      const bool ok = r < len;
      mma::cp_async_16(sv + swizzle_offset<C::kVChunks>(r, ch),
                       vg + ((t0 + (ok ? r : 0)) * p.HV + hv) * kGdnHeadDim + v0 + ch * 8, ok);
    }
    const __nv_bfloat16* a_tile = ag + (slot * p.HV + hv) * 64 * 64;
    for (int idx = tid; idx < 64 * 8; idx += C::kThreads) {
      const int r = idx >> 3, ch = idx & 7;
      mma::cp_async_16(sa + swizzle_offset<8>(r, ch), a_tile + r * 64 + ch * 8, true);
    }
    if (tid < 16)
      mma::cp_async_16(mma::smem_addr(st + C::kGOff) + tid * 16, p.gcum + (slot * p.HV + hv) * 64 + tid * 4, true);
  };

  unsigned char* s_p = smem + C::kPOff;
  const uint32_t sp = mma::smem_addr(s_p);

  if (nch > 0) issue_loads(0, 0);
  mma::cp_async_commit();

  for (int c = 0; c < nch; ++c) {
    mma::cp_async_wait_all();
    __syncthreads();  // chunk c has landed; every warp is done with chunk c - 1's stage and P
    if (c + 1 < nch) issue_loads(c + 1, (c + 1) & 1);
    mma::cp_async_commit();

    unsigned char* st = smem + (c & 1) * C::kStageBytes;
    const uint32_t sq = mma::smem_addr(st + C::kQOff), sk = mma::smem_addr(st + C::kKOff);
    const uint32_t sv = mma::smem_addr(st + C::kVOff), sa = mma::smem_addr(st + C::kAOff);
    const float* gs = reinterpret_cast<const float*>(st + C::kGOff);
    const int64_t t0 = chunk_t0(c);
    const int len = chunk_len(c);

    // (1) P = scale tril(Q K^T * D): 10 tiles of 16x16 on or below the diagonal.
    for (int item = warp; item < 10; item += NW) {
      const int mt = item < 1 ? 0 : item < 3 ? 1 : item < 6 ? 2 : 3;
      const int jp = item - mt * (mt + 1) / 2;
      float acc[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        uint32_t a[4], b[4];
        mma::ldmatrix_x4(a, sq + swizzle_offset<16>(16 * mt + (mi & 1) * 8 + r8, 2 * ks + (mi >> 1)));
        mma::ldmatrix_x4(b, sk + swizzle_offset<16>(16 * jp + (mi >> 1) * 8 + r8, 2 * ks + (mi & 1)));
        mma::mma_bf16(acc[0], a, b[0], b[1]);
        mma::mma_bf16(acc[1], a, b[2], b[3]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = 16 * mt + gid + 8 * hh;
          const int j = 16 * jp + 8 * nt + 2 * t4;
          const float gi = gs[i];
          const float e0 = scale * __expf(fminf(gi - gs[j], 0.f));
          const float e1 = scale * __expf(fminf(gi - gs[j + 1], 0.f));
          const float p0 = j <= i ? acc[nt][2 * hh] * e0 : 0.f;
          const float p1 = j + 1 <= i ? acc[nt][2 * hh + 1] * e1 : 0.f;
          *reinterpret_cast<uint32_t*>(s_p + swizzle_offset<8>(i, j >> 3) + (j & 7) * 2) = mma::pack_bf16(p0, p1);
        }
      }
    }
    __syncthreads();  // P complete

    // (2) S^T as bf16 A fragments (head dim = k).
    uint32_t sfrag[8][4];
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) mma::to_a_frag(sfrag[ks], s[2 * ks], s[2 * ks + 1]);

    // (3) O^T = S^T Q^T, then columns (tokens i) scaled by scale e^gcum_i.
    float o[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        uint32_t b[4];
        mma::ldmatrix_x4(b, sq + swizzle_offset<16>(16 * jp + (mi >> 1) * 8 + r8, 2 * ks + (mi & 1)));
        mma::mma_bf16(o[2 * jp], sfrag[ks], b[0], b[1]);
        mma::mma_bf16(o[2 * jp + 1], sfrag[ks], b[2], b[3]);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float f = scale * __expf(gs[8 * j + 2 * t4 + e]);
        o[j][e] *= f;
        o[j][2 + e] *= f;
      }
    }

    // (4) U^T = S^T K^T; W' = -e^gcum_j U^T as A fragments (tokens j = k).
    float u[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) u[j][0] = u[j][1] = u[j][2] = u[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        uint32_t b[4];
        mma::ldmatrix_x4(b, sk + swizzle_offset<16>(16 * jp + (mi >> 1) * 8 + r8, 2 * ks + (mi & 1)));
        mma::mma_bf16(u[2 * jp], sfrag[ks], b[0], b[1]);
        mma::mma_bf16(u[2 * jp + 1], sfrag[ks], b[2], b[3]);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float f = -__expf(gs[8 * j + 2 * t4 + e]);
        u[j][e] *= f;
        u[j][2 + e] *= f;
      }
    }
    uint32_t wfrag[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) mma::to_a_frag(wfrag[ks], u[2 * ks], u[2 * ks + 1]);

    // (5) X = v_new^T = (V^T + W') (A diag(beta))^T; A is lower triangular.
    uint32_t vfrag[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      mma::ldmatrix_x4_trans(vfrag[ks], sv + swizzle_offset<C::kVChunks>(16 * ks + (mi >> 1) * 8 + r8, 2 * warp + (mi & 1)));
    float x[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j][0] = x[j][1] = x[j][2] = x[j][3] = 0.f;
#pragma unroll
    for (int ip = 0; ip < 4; ++ip) {
#pragma unroll
      for (int ks = 0; ks <= ip; ++ks) {
        uint32_t b[4];
        mma::ldmatrix_x4(b, sa + swizzle_offset<8>(16 * ip + (mi >> 1) * 8 + r8, 2 * ks + (mi & 1)));
        mma::mma_bf16(x[2 * ip], vfrag[ks], b[0], b[1]);
        mma::mma_bf16(x[2 * ip], wfrag[ks], b[0], b[1]);
        mma::mma_bf16(x[2 * ip + 1], vfrag[ks], b[2], b[3]);
        mma::mma_bf16(x[2 * ip + 1], wfrag[ks], b[2], b[3]);
      }
    }

    // (6) O^T += X P^T (P lower triangular).
    uint32_t xfrag[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) mma::to_a_frag(xfrag[ks], x[2 * ks], x[2 * ks + 1]);
#pragma unroll
    for (int ip = 0; ip < 4; ++ip) {
#pragma unroll
      for (int ks = 0; ks <= ip; ++ks) {
        uint32_t b[4];
        mma::ldmatrix_x4(b, sp + swizzle_offset<8>(16 * ip + (mi >> 1) * 8 + r8, 2 * ks + (mi & 1)));
        mma::mma_bf16(o[2 * ip], xfrag[ks], b[0], b[1]);
        mma::mma_bf16(o[2 * ip + 1], xfrag[ks], b[2], b[3]);
      }
    }

    // (7) S^T = e^gl S^T + (X * e^(gl - gcum_j)) K.
    const float gl = gs[kGdnChunk - 1];
    const float gamma = __expf(gl);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float f = __expf(fminf(gl - gs[8 * j + 2 * t4 + e], 0.f));
        x[j][e] *= f;
        x[j][2 + e] *= f;
      }
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) mma::to_a_frag(xfrag[ks], x[2 * ks], x[2 * ks + 1]);
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      s[nt][0] *= gamma;
      s[nt][1] *= gamma;
      s[nt][2] *= gamma;
      s[nt][3] *= gamma;
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
      for (int np = 0; np < 8; ++np) {
        uint32_t b[4];
        mma::ldmatrix_x4_trans(b, sk + swizzle_offset<16>(16 * ks + (mi & 1) * 8 + r8, 2 * np + (mi >> 1)));
        mma::mma_bf16(s[2 * np], xfrag[ks], b[0], b[1]);
        mma::mma_bf16(s[2 * np + 1], xfrag[ks], b[2], b[3]);
      }
    }

    // (8) o: stage O^T transposed into this warp's (consumed) columns of the V tile,
    // then 16-byte stores of the real rows.
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      uint32_t r[4];
      mma::to_a_frag(r, o[2 * jj], o[2 * jj + 1]);
      mma::stmatrix_x4_trans(sv + swizzle_offset<C::kVChunks>(16 * jj + (mi >> 1) * 8 + r8, 2 * warp + (mi & 1)), r);
    }
    __syncwarp();
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int row = 16 * it + (lane >> 1), ch = lane & 1;
      if (row < len) {
        const uint4 val =
            *reinterpret_cast<const uint4*>(st + C::kVOff + swizzle_offset<C::kVChunks>(row, 2 * warp + ch));
        *reinterpret_cast<uint4*>(og + ((t0 + row) * p.HV + hv) * kGdnHeadDim + v0 + 16 * warp + 8 * ch) = val;
      }
    }
  }

  // Final state (also for an empty document: the initial state or zeros).
  float* fs = p.final_state + (n * p.HV + hv) * kGdnHeadDim * kGdnHeadDim;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    const int kd = 8 * nt + 2 * t4;
    fs[kd * kGdnHeadDim + col] = s[nt][0];
    fs[(kd + 1) * kGdnHeadDim + col] = s[nt][1];
    fs[kd * kGdnHeadDim + col + 8] = s[nt][2];
    fs[(kd + 1) * kGdnHeadDim + col + 8] = s[nt][3];
  }
}

template <int NW>
cudaError_t launch_walk(const GdnFwdArgs& p, cudaStream_t stream) {
  using C = WalkConfig<NW>;
  const cudaError_t err = cudaFuncSetAttribute(gdn_fwd_walk_kernel<NW>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int64_t blocks = p.N * p.HV * (kGdnHeadDim / C::kBV);
  gdn_fwd_walk_kernel<NW><<<static_cast<unsigned>(blocks), C::kThreads, C::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t gdn_fwd_walk_launch(const GdnFwdArgs& p, int block_v, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  switch (block_v) {
    case 32: return launch_walk<2>(p, stream);
    case 64: return launch_walk<4>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cake

#!/usr/bin/env python
"""Checks the wgmma building blocks of csrc/common/wgmma_sm90.cuh against torch on a Hopper GPU.

    python tools/wgmma_layout_check.py

Each product the GDN kernels use is run once on random bf16 tiles and compared with an
fp32 torch matmul: register A fragments from accumulators (to_a_frag), K-major and
MN-major SW128 descriptors, SS and RS forms. A layout mistake shows as a large error in
exactly one line, which is faster to read than a failing end-to-end kernel test.
"""

from __future__ import annotations

import sys

import torch

CUDA_SRC = r"""
#include <cuda_bf16.h>
#include <torch/extension.h>
#include "common/mma_sm80.cuh"
#include "common/swizzle.cuh"
#include "common/wgmma_sm90.cuh"

using namespace cake;

// Copies a row-major [rows][cols] bf16 matrix into an SW128 tile.
__device__ void to_tile(unsigned char* tile, const __nv_bfloat16* m, int rows, int cols) {
  for (int idx = threadIdx.x; idx < rows * cols / 8; idx += blockDim.x) {
    const int r = idx / (cols / 8), ch = idx % (cols / 8);
    *reinterpret_cast<uint4*>(tile + sw128_offset(rows, r, ch)) =
        *reinterpret_cast<const uint4*>(m + r * cols + ch * 8);
  }
}

// mode 0: D[64x64] = A[64x128] B[64x128]^T, A from registers (RS), B K-major.
// mode 1: D[64x64] = A[64x128] B[64x128]^T with A from shared memory (SS).
// mode 2: D[64x128] = A[64x64] B[64x128], A from registers, B MN-major (rows = K).
// mode 3: D[64x128] = A[64x128] B[128x128], both from shared memory (SS m64n128), A K-major,
//         B MN-major over a 128-row tile (as do S^T reads the S^T tape tile).
// mode 4: D[64x128] = A^T B with A stored [64 (K)][64 (M)] and B [64 (K)][128], both read
//         MN-major (SS m64n128, as A^T dw).
__global__ void probe(const __nv_bfloat16* a, const __nv_bfloat16* b, float* d, int mode) {
  extern __shared__ unsigned char raw[];
  unsigned char* sm = raw + ((1024 - (mma::smem_addr(raw) & 1023)) & 1023);
  unsigned char* ta = sm;
  unsigned char* tb = sm + 16384;
  const int ka = mode == 2 || mode == 4 ? 64 : 128;
  const int kb = mode == 3 ? 128 : 64;  // B's rows
  to_tile(ta, a, 64, ka);
  to_tile(tb, b, kb, 128);
  wgmma::fence_proxy_async();
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  // A fragments straight from global memory in the documented register layout.
  uint32_t af[8][4];
  for (int s = 0; s < ka / 16; ++s) {
    const int r0 = 16 * warp + gid, c0 = 16 * s + 2 * t4;
    auto pair = [&](int r, int c) {
      return mma::pack_bf16(__bfloat162float(a[r * ka + c]), __bfloat162float(a[r * ka + c + 1]));
    };
    af[s][0] = pair(r0, c0);
    af[s][1] = pair(r0 + 8, c0);
    af[s][2] = pair(r0, c0 + 8);
    af[s][3] = pair(r0 + 8, c0 + 8);
  }
  const uint32_t sa = mma::smem_addr(ta), sb = mma::smem_addr(tb);
  if (mode < 2) {
    float acc[32];
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;
    wgmma::fence();
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (mode == 0) wgmma::mma_rs_m64n64k16<0>(acc, af[s], wgmma::desc_k_major(sb, 64, s), s > 0);
      else wgmma::mma_ss_m64n64k16<0, 0>(acc, wgmma::desc_k_major(sa, 64, s), wgmma::desc_k_major(sb, 64, s), s > 0);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operands(acc);
    for (int i = 0; i < 32; ++i) {
      const int r = 16 * warp + gid + 8 * ((i & 3) >> 1), c = 8 * (i >> 2) + 2 * t4 + (i & 1);
      d[r * 64 + c] = acc[i];
    }
  } else {
    float acc[64];
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    wgmma::fence();
    if (mode == 2) {
#pragma unroll
      for (int s = 0; s < 4; ++s) wgmma::mma_rs_m64n128k16<1>(acc, af[s], wgmma::desc_mn_major(sb, 64, s), s > 0);
    } else if (mode == 3) {
#pragma unroll
      for (int s = 0; s < 8; ++s)
        wgmma::mma_ss_m64n128k16<0, 1>(acc, wgmma::desc_k_major(sa, 64, s), wgmma::desc_mn_major(sb, 128, s), s > 0);
    } else {
#pragma unroll
      for (int s = 0; s < 4; ++s)
        wgmma::mma_ss_m64n128k16<1, 1>(acc, wgmma::desc_mn_major(sa, 64, s), wgmma::desc_mn_major(sb, 64, s), s > 0);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operands(acc);
    for (int i = 0; i < 64; ++i) {
      const int r = 16 * warp + gid + 8 * ((i & 3) >> 1), c = 8 * (i >> 2) + 2 * t4 + (i & 1);
      d[r * 128 + c] = acc[i];
    }
  }
}

torch::Tensor run(torch::Tensor a, torch::Tensor b, int64_t mode) {
  auto d = torch::full({64, mode >= 2 ? 128 : 64}, NAN, a.options().dtype(torch::kFloat));
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 56 * 1024);
  probe<<<1, 128, 56 * 1024>>>(reinterpret_cast<const __nv_bfloat16*>(a.data_ptr()),
                               reinterpret_cast<const __nv_bfloat16*>(b.data_ptr()), d.data_ptr<float>(), mode);
  return d;
}
"""


def main() -> int:
    from cuda_inline import load

    mod = load("cake_wgmma_layout_check", "torch::Tensor run(torch::Tensor a, torch::Tensor b, int64_t mode);", CUDA_SRC)
    torch.manual_seed(0)
    failed = 0
    forms = [
        (0, "RS  K-major B  m64n64k128"),
        (1, "SS  K-major A,B m64n64k128"),
        (2, "RS  MN-major B m64n128k64"),
        (3, "SS  K-major A, MN-major B (128 rows) m64n128k128"),
        (4, "SS  MN-major A,B m64n128k64"),
    ]
    for mode, name in forms:
        a = torch.randn(64, 64 if mode in (2, 4) else 128, device="cuda").bfloat16()
        b = torch.randn(128 if mode == 3 else 64, 128, device="cuda").bfloat16()
        d = mod.run(a, b, mode)
        torch.cuda.synchronize()
        if mode in (2, 3):
            ref = a.float() @ b.float()
        elif mode == 4:
            ref = a.float().T @ b.float()
        else:
            ref = a.float() @ b.float().T
        err = ((d - ref).abs().max() / ref.abs().max()).item()
        ok = err < 1e-5
        failed += not ok
        print(f"{name}: max err / max |ref| = {err:.2e}  {'ok' if ok else 'WRONG'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

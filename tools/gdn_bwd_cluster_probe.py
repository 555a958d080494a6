#!/usr/bin/env python
"""How many clusters of G CTAs an H200 runs at once, and what summing dq and dk over a
cluster costs a chunk, on a Hopper GPU.

    python tools/gdn_bwd_cluster_probe.py [--iters 512] [--smem-kb 200]

A fused backward kernel with one CTA per (segment, value head) must sum dq and dk over
the G value heads of a q/k head in a fixed order without a reduce kernel
(docs/fused_backward.md). One way is a cluster of the G CTAs of a q/k head, walking in step:
each chunk every CTA stages its dq and dk partials (64 x 128 fp32 each, 64 KB) in its
shared memory, and each CTA sums a 1/G share of the elements over the cluster's ranks in
rank order through distributed shared memory and stores them as bf16. This probe

- asks the occupancy API how many clusters of G = 1, 2, 3 CTAs of 256 threads and
  --smem-kb KB of shared memory (one CTA an SM, as the fused kernel) are resident at once,
  so how many SMs a cluster grid can use (the GPCs' sizes decide it);
- runs one wave of such clusters doing only that stage-and-sum, --iters times, and prints
  ns an iteration (the cost per chunk of the cluster sum, beside the chunk's ~5-10 µs).

The values are meaningless; only the traffic and the barriers are the kernel's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_inline import PROBE_PRELUDE  # noqa: E402

KERNEL_SRC = PROBE_PRELUDE + r"""
namespace probe {

using namespace cake;

constexpr int kThreads = 256;
constexpr int kPartial = 64 * 128;           // floats of dq (then dk) a CTA stages
constexpr int kStaged = 2 * kPartial;        // dq and dk: 64 KB
constexpr int kPerThread = kStaged / kThreads;  // 64: as a thread of bwd_local holds dq and dk

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The same shared-memory offset in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}

__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr));
  return v;
}

// One CTA of a cluster of kG; out: the cluster's 2 x 64 x 128 bf16 sums (rewritten each
// iteration); ns[blockIdx.x]: ns an iteration.
template <int kG>
__global__ void __launch_bounds__(kThreads, 1) cluster_sum(int iters, __nv_bfloat16* out, float* ns) {
  extern __shared__ __align__(16) float staged[];
  const uint32_t rank = cluster_rank();
  const uint32_t base = mma::smem_addr(staged);
  __nv_bfloat16* sums = out + static_cast<int64_t>(blockIdx.x / kG) * kStaged;
  // This CTA's share: float4 groups [lo, hi) of the kStaged / 4.
  constexpr int kGroups = kStaged / 4;
  const int lo = kGroups * static_cast<int>(rank) / kG, hi = kGroups * (static_cast<int>(rank) + 1) / kG;
  float part[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) part[i] = 1e-3f * (i + threadIdx.x);
  cluster_sync();
  const uint64_t t0 = now_ns();
  for (int it = 0; it < iters; ++it) {
    // Stage this CTA's partials (float4 stores, thread-strided so a warp's are contiguous).
#pragma unroll
    for (int i = 0; i < kPerThread / 4; ++i)
      reinterpret_cast<float4*>(staged)[i * kThreads + threadIdx.x] =
          make_float4(part[4 * i], part[4 * i + 1], part[4 * i + 2], part[4 * i + 3]);
    cluster_sync();  // every rank's partials staged
    for (int gi = lo + static_cast<int>(threadIdx.x); gi < hi; gi += kThreads) {
      float4 acc = ld_cluster_f4(map_rank(base + 16 * gi, 0));
#pragma unroll
      for (int r = 1; r < kG; ++r) {  // rank order: the same sum on every run
        const float4 v = ld_cluster_f4(map_rank(base + 16 * gi, r));
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
      }
      uint2 packed = make_uint2(mma::pack_bf16(acc.x, acc.y), mma::pack_bf16(acc.z, acc.w));
      *reinterpret_cast<uint2*>(sums + 4 * gi) = packed;
    }
    cluster_sync();  // every rank has read the staging before it is rewritten
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) part[i] += 1e-6f;
  }
  const uint64_t t1 = now_ns();
  if (threadIdx.x == 0) ns[blockIdx.x] = static_cast<float>(t1 - t0) / iters;
}

template __global__ void cluster_sum<1>(int, __nv_bfloat16*, float*);
template __global__ void cluster_sum<2>(int, __nv_bfloat16*, float*);
template __global__ void cluster_sum<3>(int, __nv_bfloat16*, float*);

}  // namespace probe
"""

BINDING_SRC = r"""
#include <torch/extension.h>

// (max active clusters, ns an iteration per CTA) for clusters of G.
std::vector<torch::Tensor> run(int64_t G, int64_t iters, int64_t smem_bytes) {
  void (*kernel)(int, __nv_bfloat16*, float*) =
      G == 1 ? probe::cluster_sum<1> : (G == 2 ? probe::cluster_sum<2> : probe::cluster_sum<3>);
  TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) == cudaSuccess);
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(G);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cfg.blockDim = dim3(probe::kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  cfg.gridDim = dim3(static_cast<unsigned>(G));
  int clusters = 0;
  TORCH_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess, "occupancy query");
  TORCH_CHECK(clusters > 0, "no cluster of ", G, " fits");
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * G));
  auto opts = torch::TensorOptions().device(torch::kCUDA);
  auto out = torch::empty({clusters, probe::kStaged}, opts.dtype(torch::kBFloat16));
  auto ns = torch::full({clusters * G}, NAN, opts.dtype(torch::kFloat));
  TORCH_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<int>(iters),
                                 reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), ns.data_ptr<float>()) == cudaSuccess,
              "launch");
  return {torch::tensor({clusters}), ns};
}
"""


def main() -> int:
    import torch
    from cuda_inline import load

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=512)
    ap.add_argument("--smem-kb", type=int, default=200)
    args = ap.parse_args()
    mod = load("cake_gdn_bwd_cluster_probe",
               "std::vector<torch::Tensor> run(int64_t G, int64_t iters, int64_t smem_bytes);",
               KERNEL_SRC + BINDING_SRC)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for G in (1, 2, 3):
        mod.run(G, 8, args.smem_kb * 1024)  # warm-up
        clusters, ns = mod.run(G, args.iters, args.smem_kb * 1024)
        torch.cuda.synchronize()
        n = int(clusters.item())
        print(f"G = {G}: {n} clusters at once ({n * G} of {sms} SMs), "
              f"{ns.mean().item():.0f} ns an iteration (max {ns.max().item():.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

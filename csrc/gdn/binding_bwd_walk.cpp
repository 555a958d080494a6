// Torch binding of the GDN backward's reverse walk (gdn/bwd_walk.h), temporary: to be
// merged into gdn/binding.cpp. An internal op (cake_cuda::gdn_bwd_walk) for the backward
// and its tests: checks, outputs (never initialised: the kernel writes every element of
// every used slot), device and stream.

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/binding.h"
#include "gdn/bwd_walk.h"
#include "gdn/gdn.h"
#include "gdn/plan.h"

namespace cake {
namespace {

// (dS tape [NC, HV, 128, 128] bf16 ([slot, hv, v, k] = dS_end[k, v]), dv_new tape
// [NC, HV, 64, 128] bf16, dh0 [N, HV, 128, 128] fp32), NC = a.size(0).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gdn_bwd_walk(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& dout, const at::Tensor& a, const at::Tensor& gcum,
    const std::optional<at::Tensor>& qk_lrn, const std::optional<at::Tensor>& dht, const at::Tensor& chunk_offsets,
    const at::Tensor& cu_seqlens, int64_t HV, double scale) {
  constexpr const char* op = "gdn_bwd_walk";
  constexpr int64_t D = kGdnHeadDim, C = kGdnChunk;
  TORCH_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor, got ", q.device());
  TORCH_CHECK(q.dim() == 3, op, ": q must be [T, H, K], got ", q.sizes());
  const int64_t T = q.size(0), H = q.size(1);
  TORCH_CHECK(q.size(2) == D, op, ": q: the CUDA kernels need head dim K = 128, got K = ", q.size(2));
  TORCH_CHECK(H >= 1, op, ": q needs at least one head, got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, op, ": q must be bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": k must be [T, H, K] = ", q.sizes(), " like q, got ", k.sizes());
  TORCH_CHECK(k.scalar_type() == at::kBFloat16, op, ": k must be bfloat16, got ", k.scalar_type());
  check_same_device(k, q, op, "k", "q");
  TORCH_CHECK(HV >= 1 && HV % H == 0, op, ": HV = ", HV, " must be a positive multiple of q's heads H = ", H);
  TORCH_CHECK(HV < (1 << 24), op, ": HV = ", HV, " must be below 2^24");
  TORCH_CHECK(dout.dim() == 3 && dout.size(0) == T && dout.size(1) == HV && dout.size(2) == D, op,
              ": do must be [T, HV, V] = [", T, ", ", HV, ", 128], got ", dout.sizes());
  TORCH_CHECK(dout.scalar_type() == at::kBFloat16, op, ": do must be bfloat16, got ", dout.scalar_type());
  check_same_device(dout, q, op, "do", "q");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1, op, ": cu_seqlens must be [N + 1], got ",
              cu_seqlens.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong, op,
              ": cu_seqlens must be int32 or int64, got ", cu_seqlens.scalar_type());
  check_same_device(cu_seqlens, q, op, "cu_seqlens", "q");
  const int64_t N = cu_seqlens.numel() - 1;
  TORCH_CHECK(T == 0 || N >= 1, op, ": cu_seqlens: ", T, " tokens need at least one document");
  TORCH_CHECK(chunk_offsets.dim() == 1 && chunk_offsets.numel() == N + 1, op,
              ": chunk_offsets must be [N + 1] = [", N + 1, "], got ", chunk_offsets.sizes());
  TORCH_CHECK(chunk_offsets.scalar_type() == at::kInt, op, ": chunk_offsets must be int32, got ",
              chunk_offsets.scalar_type());
  check_same_device(chunk_offsets, q, op, "chunk_offsets", "q");
  TORCH_CHECK(a.dim() == 4 && a.size(1) == HV && a.size(2) == C && a.size(3) == C, op,
              ": a must be [NC, HV, 64, 64] with HV = ", HV, ", got ", a.sizes());
  const int64_t NC = a.size(0);
  // Every document's chunks fit ceil(T / 64) + N slots (plan.h): the plan's grid, or more.
  TORCH_CHECK(NC >= gdn_fwd_chunk_slots(T, N), op, ": a: NC = ", NC, " chunk slots, fewer than ceil(T / 64) + N = ",
              gdn_fwd_chunk_slots(T, N));
  TORCH_CHECK(NC * HV < (int64_t{1} << 31), op, ": a: NC * HV = ", NC * HV, " must be below 2^31");
  TORCH_CHECK(a.scalar_type() == at::kBFloat16, op, ": a must be bfloat16, got ", a.scalar_type());
  check_same_device(a, q, op, "a", "q");
  TORCH_CHECK(gcum.dim() == 3 && gcum.size(0) == NC && gcum.size(1) == HV && gcum.size(2) == C, op,
              ": gcum must be [NC, HV, 64] = [", NC, ", ", HV, ", 64], got ", gcum.sizes());
  TORCH_CHECK(gcum.scalar_type() == at::kFloat, op, ": gcum must be float32, got ", gcum.scalar_type());
  check_same_device(gcum, q, op, "gcum", "q");
  if (qk_lrn) {
    TORCH_CHECK(qk_lrn->dim() == 4 && qk_lrn->size(0) == NC && qk_lrn->size(1) == H && qk_lrn->size(2) == 2 &&
                    qk_lrn->size(3) == C,
                op, ": qk_lrn must be [NC, H, 2, 64] = [", NC, ", ", H, ", 2, 64], got ", qk_lrn->sizes());
    TORCH_CHECK(qk_lrn->scalar_type() == at::kFloat, op, ": qk_lrn must be float32, got ", qk_lrn->scalar_type());
    check_same_device(*qk_lrn, q, op, "qk_lrn", "q");
  }
  if (dht) {
    TORCH_CHECK(dht->sizes() == at::IntArrayRef({N, HV, D, D}), op, ": dht must be [N, HV, K, V] = [", N, ", ", HV,
                ", 128, 128], got ", dht->sizes());
    TORCH_CHECK(dht->scalar_type() == at::kFloat, op, ": dht must be float32, got ", dht->scalar_type());
    check_same_device(*dht, q, op, "dht", "q");
  }
  TORCH_CHECK(std::isfinite(scale) && scale > 0, op, ": scale must be finite and > 0, got ", scale);
  TORCH_CHECK(T < (int64_t{1} << 31) - C, op, ": q: T = ", T, " tokens must be below 2^31 - 64");

  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  const at::Tensor qc = dense16(q), kc = dense16(k), doc = dense16(dout), ac = dense16(a), gc = dense16(gcum);
  const at::Tensor lrn = qk_lrn ? dense16(*qk_lrn) : at::Tensor();
  const at::Tensor dhtc = dht ? dht->contiguous() : at::Tensor();
  const at::Tensor offs = chunk_offsets.contiguous(), cu = cu_seqlens.contiguous();
  at::Tensor dS = at::empty({NC, HV, D, D}, q.options().dtype(at::kBFloat16));
  at::Tensor dv_new = at::empty({NC, HV, C, D}, q.options().dtype(at::kBFloat16));
  at::Tensor dh0 = at::empty({N, HV, D, D}, q.options().dtype(at::kFloat));

  GdnBwdWalkArgs p{};
  p.q = qc.data_ptr();
  p.k = kc.data_ptr();
  p.dout = doc.data_ptr();
  p.a = ac.data_ptr();
  p.gcum = gc.data_ptr<float>();
  p.qk_lrn = lrn.defined() ? lrn.data_ptr<float>() : nullptr;
  p.dht = dhtc.defined() ? dhtc.data_ptr<float>() : nullptr;
  p.chunk_offsets = offs.data_ptr<int32_t>();
  p.cu_seqlens = cu.data_ptr();
  p.cu_int64 = cu.scalar_type() == at::kLong;
  p.dS = dS.data_ptr();
  p.dv_new = dv_new.data_ptr();
  p.dh0 = dh0.data_ptr<float>();
  p.T = T;
  p.N = N;
  p.H = H;
  p.HV = HV;
  p.scale = static_cast<float>(scale);
  const cudaError_t err = gdn_bwd_walk_launch(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return {dS, dv_new, dh0};
}

}  // namespace
}  // namespace cake

TORCH_LIBRARY_FRAGMENT(cake_cuda, m) {
  m.def(
      "gdn_bwd_walk(Tensor q, Tensor k, Tensor do, Tensor a, Tensor gcum, Tensor? qk_lrn, Tensor? dht, "
      "Tensor chunk_offsets, Tensor cu_seqlens, int HV, float scale) -> (Tensor dS, Tensor dv_new, Tensor dh0)");
}

TORCH_LIBRARY_IMPL(cake_cuda, CUDA, m) { m.impl("gdn_bwd_walk", &cake::gdn_bwd_walk); }

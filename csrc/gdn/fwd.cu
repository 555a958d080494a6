// The GDN forward: plan, prep, then (when the walk is cut into segments) the segment
// summaries and their chain, then the walk (gdn.h; docs/kernels.md, "Forward stages").
// Each stage returns at once when it has nothing to do for the call's plan. And the
// backward's recompute: the same stages with the walk in tape mode.

#include "gdn/gdn.h"

namespace cake {

cudaError_t gdn_fwd_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  for (auto stage : {gdn_fwd_plan_launch, gdn_fwd_prep_launch, gdn_fwd_summary_launch, gdn_fwd_chain_launch,
                     gdn_fwd_walk_launch}) {
    const cudaError_t err = stage(p, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t gdn_bwd_tapes_prep_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  if (p.N > 0 && p.h_tape == nullptr) return cudaErrorInvalidValue;
  const cudaError_t err = gdn_fwd_plan_launch(p, stream);
  return err != cudaSuccess ? err : gdn_fwd_prep_launch(p, stream);
}

cudaError_t gdn_bwd_tapes_walk_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  for (auto stage : {gdn_fwd_summary_launch, gdn_fwd_chain_launch, gdn_fwd_tape_walk_launch}) {
    const cudaError_t err = stage(p, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t gdn_bwd_tapes_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  const cudaError_t err = gdn_bwd_tapes_prep_launch(p, stream);
  return err != cudaSuccess ? err : gdn_bwd_tapes_walk_launch(p, stream);
}

}  // namespace cake

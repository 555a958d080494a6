// The backward's recompute of the forward's tapes: the forward's stages (plan, prep, then
// when the walk is cut the segment summaries and their chain; gdn.h) with the walk in tape
// mode. Each stage returns at once when it has nothing to do for the call's plan.

#include "gdn/gdn.h"

namespace cake {

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

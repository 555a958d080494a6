// The GDN forward: plan, prep, then (when the walk is cut into segments) the segment
// summaries and their chain, then the walk (gdn.h; docs/kernels.md, "Forward stages").
// Each stage returns at once when it has nothing to do for the call's plan.

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

}  // namespace cake

// The GDN forward: prep, then the walk (see gdn_fwd.h).

#include "gdn_fwd.h"

namespace cake {

cudaError_t gdn_fwd_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  const cudaError_t err = gdn_fwd_prep_launch(p, stream);
  if (err != cudaSuccess) return err;
  return gdn_fwd_walk_launch(p, stream);
}

}  // namespace cake

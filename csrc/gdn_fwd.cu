// The GDN forward: prep, then the walk (see gdn_fwd.h), and the one host heuristic.

#include "gdn_fwd.h"

namespace cake {
namespace {

// NOTES: 64 value columns per walk CTA (4 warps) share the q/k/A loads and the P
// product; 32 (2 warps) doubles the CTAs for shapes with few (document, value head)
// walks. Both run two CTAs per SM (about 104 and 96 KB of shared memory). The choice
// depends on shapes and the SM count only and changes no bit of the results.
int choose_block_v(const GdnFwdArgs& p) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();  // keep the sticky-free error state clean; fall back to H200's count
    sms = 132;
  }
  return p.N * p.HV * 2 >= sms ? 64 : 32;
}

}  // namespace

cudaError_t gdn_fwd_launch(const GdnFwdArgs& p, int block_v, cudaStream_t stream) {
  const cudaError_t err = gdn_fwd_prep_launch(p, stream);
  if (err != cudaSuccess) return err;
  return gdn_fwd_walk_launch(p, block_v == 0 ? choose_block_v(p) : block_v, stream);
}

}  // namespace cake

"""Fake kernels of ``cake::gdn_fwd`` and ``cake::gdn_bwd``."""

import torch

from cake_ops.checks import check_gdn, check_gdn_grads, check_scale


@torch.library.register_fake("cake::gdn_fwd")
def gdn_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic):
    T, H, K, HV, V, N = check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)
    check_scale(scale)
    o = v.new_empty(T, HV, V)
    final_state = q.new_empty(N, HV, K, V, dtype=torch.float32)
    return o, final_state


@torch.library.register_fake("cake::gdn_bwd")
def gdn_bwd(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic):
    T, H, K, HV, V, N = check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)
    check_gdn_grads(do, dht, T, HV, V, N, K)
    check_scale(scale)
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
        torch.empty_like(g, memory_format=torch.contiguous_format),
        torch.empty_like(beta, memory_format=torch.contiguous_format),
        q.new_empty(N, HV, K, V, dtype=torch.float32),
    )

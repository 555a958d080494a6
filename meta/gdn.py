"""Fake kernels of ``cake::gdn_fwd``, ``cake::gdn_fwd_full``, ``cake::gdn_fwd_final_state``,
``cake::gdn_bwd``, ``cake::gdn_bwd_initial_state``, ``cake::gdn_segment_summaries``,
``cake::gdn_segment_grad_summaries``, ``cake::gdn_state_chain`` and ``cake::gdn_state_grad_chain``."""

import torch

from cake_ops import dispatch
from cake_ops.checks import (check_doc_flags, check_gdn, check_gdn_grads, check_piece_flags, check_scale,
                             check_segment_chunks, check_state_chain)
from cake_ops.ops.gdn import gdn_tapes_bytes


@torch.library.register_fake("cake::gdn_fwd")
def gdn_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic, graph=False,
            segment_chunks=-1, doc_flags=None):
    T, H, K, HV, V, N = check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)
    check_scale(scale)
    check_segment_chunks(segment_chunks)
    check_doc_flags(doc_flags, N, q.device)
    o = v.new_empty(T, HV, V)
    final_state = q.new_empty(N, HV, K, V, dtype=torch.float32)
    return o, final_state


@torch.library.register_fake("cake::gdn_fwd_full")
def gdn_fwd_full(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic, graph=False,
                 segment_chunks=-1, doc_flags=None):
    o, final_state = gdn_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic,
                             segment_chunks=segment_chunks, doc_flags=doc_flags)
    T, H, HV, N = q.shape[0], q.shape[1], v.shape[1], cu_seqlens.shape[0] - 1
    # The tapes exist where the CUDA kernels take the call (the same static rule as the op's).
    on_cuda = q.device.type == "cuda" and dispatch.gdn_fwd_cuda_refusal(q, k, v, g, beta, cu_seqlens, scale) is None
    tapes = q.new_empty(gdn_tapes_bytes(T, N, H, HV, use_qk_l2norm) if on_cuda else 0, dtype=torch.uint8)
    return o, final_state, tapes


@torch.library.register_fake("cake::gdn_fwd_final_state")
def gdn_fwd_final_state(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic,
                        segment_chunks=-1, doc_flags=None):
    T, H, K, HV, V, N = check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)
    check_scale(scale)
    check_segment_chunks(segment_chunks)
    check_doc_flags(doc_flags, N, q.device)
    return q.new_empty(N, HV, K, V, dtype=torch.float32)


@torch.library.register_fake("cake::gdn_state_chain")
def gdn_state_chain(E, M, S_start, seg_cu):
    check_state_chain(E, M, S_start, seg_cu)
    return torch.empty_like(S_start)


@torch.library.register_fake("cake::gdn_state_grad_chain")
def gdn_state_grad_chain(F, B, dS_end, seg_cu):
    check_state_chain(F, B, dS_end, seg_cu)
    return torch.empty_like(dS_end)


@torch.library.register_fake("cake::gdn_bwd")
def gdn_bwd(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic, tapes=None,
            graph=False, segment_chunks=-1, doc_flags=None):
    T, H, K, HV, V, N = check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)
    check_gdn_grads(do, dht, T, HV, V, N, K)
    check_scale(scale)
    check_segment_chunks(segment_chunks)
    check_doc_flags(doc_flags, N, q.device)
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
        torch.empty_like(g, memory_format=torch.contiguous_format),
        torch.empty_like(beta, memory_format=torch.contiguous_format),
        q.new_empty(N, HV, K, V, dtype=torch.float32),
    )


@torch.library.register_fake("cake::gdn_bwd_initial_state")
def gdn_bwd_initial_state(do, dht, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm, deterministic,
                          segment_chunks=-1, doc_flags=None):
    T, H, K, HV, V, N = check_gdn(q, k, do, g, beta, cu_seqlens, None, v_name="do")
    check_gdn_grads(do, dht, T, HV, V, N, K)
    check_scale(scale)
    check_segment_chunks(segment_chunks)
    check_doc_flags(doc_flags, N, q.device)
    return q.new_empty(N, HV, K, V, dtype=torch.float32)


def _with_transfers(values, K: int):
    """A segment summaries op's pair: the values and their transfers [N, HV, K, K] fp32."""
    return values, values.new_empty(*values.shape[:2], K, K)


@torch.library.register_fake("cake::gdn_segment_summaries")
def gdn_segment_summaries(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, deterministic, segment_chunks=-1,
                          doc_flags=None):
    check_piece_flags(doc_flags, cu_seqlens.shape[0] - 1, q.device)
    return _with_transfers(gdn_fwd_final_state(q, k, v, g, beta, cu_seqlens, None, scale, use_qk_l2norm,
                                               deterministic, segment_chunks, doc_flags), q.shape[-1])


@torch.library.register_fake("cake::gdn_segment_grad_summaries")
def gdn_segment_grad_summaries(do, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm, deterministic, segment_chunks=-1,
                               doc_flags=None):
    check_piece_flags(doc_flags, cu_seqlens.shape[0] - 1, q.device)
    return _with_transfers(gdn_bwd_initial_state(do, None, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm,
                                                 deterministic, segment_chunks, doc_flags), q.shape[-1])

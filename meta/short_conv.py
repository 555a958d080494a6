"""Fake kernels of ``cake::short_conv_fwd`` and ``cake::short_conv_bwd``."""

import torch

from cake_ops.checks import check_short_conv


@torch.library.register_fake("cake::short_conv_fwd")
def short_conv_fwd(x, weight, bias, cu_seqlens, initial_state, silu):
    check_short_conv(x, weight, bias, cu_seqlens, initial_state)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("cake::short_conv_bwd")
def short_conv_bwd(dy, x, weight, bias, cu_seqlens, initial_state, silu):
    T, D, W, N = check_short_conv(x, weight, bias, cu_seqlens, initial_state)
    state_dtype = initial_state.dtype if initial_state is not None else x.dtype
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
        weight.new_empty(D, dtype=bias.dtype if bias is not None else weight.dtype),
        x.new_empty(N, D, W - 1, dtype=state_dtype),
    )

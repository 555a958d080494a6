"""``short_conv_kcp``: the short causal convolution over the ranks of a KCP context.

A fragment's first W - 1 outputs read the W - 1 inputs before it: the halo, held by
earlier fragments of its document (on any rank, possibly several when fragments are
short) or, before the document's first token, its initial conv state. Each rank
gathers every rank's fragment tails (the last W - 1 tokens of each fragment: bytes
independent of the sequence length), picks each local fragment's halo from them by the
context's static tables, and runs ``cake::short_conv_fwd`` on its rows with the halos as
the fragments' initial states; autograd carries the halos' gradients back to the ranks
that hold those tokens.
"""

from __future__ import annotations

import torch

from ..ops.short_conv import short_conv
from . import collectives
from .context import KcpContext


def short_conv_kcp(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ctx: KcpContext,
    *,
    initial_state: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """``cake_ops.short_conv`` of a global packed batch held across the ranks of ``ctx``
    (a collective: every rank calls it with its own rows).

    Args:
        x: [T_r, D], this rank's rows (``ctx.shard``). weight: [D, W] with W the
            context's ``conv_width``; bias: [D] or None (both replicated: their
            gradients are partial, each rank's from its own rows).
        initial_state: [N, D, W-1] of the global documents, the same on every rank
            (its gradient partial likewise).
        activation: None or "silu".
    Returns:
        y [T_r, D].
    """
    if not isinstance(ctx, KcpContext):
        raise TypeError(f"ctx must be a KcpContext (build_context_kcp), got {type(ctx).__name__}")
    if x.dim() != 2 or x.shape[0] != ctx.local_tokens:
        raise ValueError(f"x must be [T_r, D] with this rank's {ctx.local_tokens} tokens of the context "
                         f"(ctx.shard), got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != ctx.conv_width:
        raise ValueError(f"weight must be [D, W] with the context's conv_width W = {ctx.conv_width}, "
                         f"got shape {tuple(weight.shape)}")
    if ctx.cu_seqlens.device != x.device:
        raise ValueError(f"ctx's local cu_seqlens is on {ctx.cu_seqlens.device}, x on {x.device}: "
                         "build the context with device=x.device")
    W1, D = ctx.conv_width - 1, x.shape[1]
    if initial_state is not None and tuple(initial_state.shape) != (ctx.documents, D, W1):
        raise ValueError(f"initial_state must have shape [N, D, W-1] = {(ctx.documents, D, W1)}, got "
                         f"{tuple(initial_state.shape)}")
    if W1 == 0:
        return short_conv(x, weight, bias, ctx.cu_seqlens, activation=activation)
    tables = ctx.halo_tables(x.device)
    # In fp32, as the op reads an initial state: the halo rows are then exactly x's and
    # the initial state's values.
    zero = x.new_zeros(1, D, dtype=torch.float32)
    tails = torch.cat([x.float(), zero]).index_select(0, tables.tails)  # [slots * (W-1), D]
    pool = [collectives.all_gather(tails, ctx)]
    if initial_state is not None:
        pool.append(initial_state.float().transpose(1, 2).reshape(-1, D))
    pool.append(zero)
    index = (tables.halo if initial_state is not None else tables.halo_zero).view(-1, W1)
    # One gather per halo position: a pool row (a short fragment's token, an initial
    # state's) can sit in several fragments' halos, but at one position of one halo at
    # most, so each gather's backward adds into distinct rows (on CUDA, atomics that
    # never collide: the bits do not depend on their order).
    pool = torch.cat(pool)
    halo = torch.stack([pool.index_select(0, index[:, j]) for j in range(W1)], 2)  # [F, D, W-1]
    return short_conv(x, weight, bias, ctx.cu_seqlens, initial_state=halo, activation=activation)

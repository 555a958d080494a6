"""``gdn_kcp``: GDN over the ranks of a KCP context, as a composition of ``cake::gdn_fwd``
calls on each rank's fragments and one all-gather of per-fragment summaries.

The math (docs/kcp.md): a fragment's end state is affine in its start state,
``S_end = M S_start + E``, with ``E`` the end state walked from zero and ``M`` the
transfer (the end state walked from the identity with v = 0: the state update is
linear in S and acts on its K rows). Each rank forms ``E`` and ``M`` of its fragments
(two walks), all ranks gather them (fp32, ``slots`` per rank: bytes independent of the
sequence length), every rank chains each document's fragments in token order from its
initial state (fp32, the same ops in the same order on every rank), and each rank walks
its fragments again from their chained start states for the outputs. Autograd gives the
backward (the all-gather's adjoint sums in rank order: ``collectives``).

The initial and final states are replicated: every rank passes the same
``initial_state`` and receives the same final states; their gradients are partial, each
rank's from its own loss (their sum over the ranks is the gradient of the summed loss,
as for any replicated input).
"""

from __future__ import annotations

import torch

from ..ops.gdn import SAVE_MODES, gdn
from . import collectives
from .context import KcpContext


def _chain(E: torch.Tensor, M: torch.Tensor, initial_state: torch.Tensor | None, ctx: KcpContext):
    """(this rank's fragments' start states [F, HV, K, V], the documents' final states
    [N, HV, K, V]) from every rank's summaries ``E`` [W * slots, HV, K, V] and ``M``
    [W * slots, HV, K, K]: each document's fragments in token order, batched over the
    documents by the fragment's place in its document."""
    tables = ctx.chain_tables(E.device)
    N, HV, K, V = ctx.documents, E.shape[1], E.shape[2], E.shape[3]
    S = initial_state.float() if initial_state is not None else E.new_zeros(N, HV, K, V)
    entering = []
    for docs, flats in tables.steps:
        S_in = S.index_select(0, docs)
        entering.append(S_in)
        S = S.index_copy(0, docs, torch.matmul(M.index_select(0, flats), S_in) + E.index_select(0, flats))
    entering.append(E.new_zeros(1, HV, K, V))  # the start of a rank's empty stand-in
    return torch.cat(entering).index_select(0, tables.local_starts), S


def gdn_kcp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ctx: KcpContext,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    deterministic: bool = True,
    save_mode: str = "light",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GDN of a global packed batch held across the ranks of ``ctx`` (a collective:
    every rank calls it with its own rows).

    Args:
        q, k: [T_r, H, K]; v: [T_r, HV, V]; g, beta: [T_r, HV]: this rank's rows of the
            global tensors (``ctx.shard``), as ``cake_ops.gdn`` takes them.
        ctx: from ``build_context_kcp``; its local ``cu_seqlens`` on q's device.
        initial_state: [N, HV, K, V] fp32 of the global documents, the same on every
            rank. output_final_state: return the documents' final states [N, HV, K, V]
            (the same on every rank).
        scale, use_qk_l2norm, deterministic, save_mode: as ``cake_ops.gdn``'s, for every
            walk of the composition.
    Returns:
        (o, this rank's rows [T_r, HV, V]; final states or None). Gradients of the
        replicated states are partial (module docstring).
    """
    if not isinstance(ctx, KcpContext):
        raise TypeError(f"ctx must be a KcpContext (build_context_kcp), got {type(ctx).__name__}")
    if save_mode not in SAVE_MODES:
        raise ValueError(f"save_mode must be one of {SAVE_MODES}, got {save_mode!r}")
    if q.shape[0] != ctx.local_tokens:
        raise ValueError(f"q must hold this rank's {ctx.local_tokens} tokens of the context (ctx.shard), "
                         f"got {q.shape[0]} rows")
    if ctx.cu_seqlens.device != q.device:
        raise ValueError(f"ctx's local cu_seqlens is on {ctx.cu_seqlens.device}, q on {q.device}: "
                         "build the context with device=q.device")
    if initial_state is not None and initial_state.shape[0] != ctx.documents:
        raise ValueError(f"initial_state must have the context's {ctx.documents} documents in dim 0, got "
                         f"shape {tuple(initial_state.shape)}")
    cu = ctx.cu_seqlens
    K, HV, V = q.shape[-1], v.shape[1], v.shape[-1]
    walk = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, deterministic=deterministic, save_mode=save_mode)
    # Summaries of the local fragments: E from zero, M from the identity with v = 0.
    _, E = gdn(q, k, v, g, beta, cu, output_final_state=True, **walk)
    F = E.shape[0]
    eye = torch.eye(K, device=q.device).expand(F, HV, K, K).contiguous()
    _, M = gdn(q, k, v.new_zeros(v.shape[0], HV, K), g, beta, cu, initial_state=eye, output_final_state=True,
               **walk)
    summaries = torch.cat([E, M], dim=-1)
    if F < ctx.slots:
        summaries = torch.cat([summaries, summaries.new_zeros(ctx.slots - F, *summaries.shape[1:])])
    every = collectives.all_gather(summaries, ctx)
    starts, final_state = _chain(every[..., :V], every[..., V:], initial_state, ctx)
    o, _ = gdn(q, k, v, g, beta, cu, initial_state=starts, **walk)
    return o, (final_state if output_final_state else None)

"""``gdn_kcp``: GDN over the ranks of a KCP context, as a composition of ``cake::gdn_fwd``
calls on each rank's fragments and all-gathers of per-fragment summaries.

The math (docs/kcp.md): a fragment's end state is affine in its start state,
``S_end = M S_start + E``, with ``E`` the end state walked from zero and ``M`` the
transfer (the end state walked from the identity with v = 0: the state update is
linear in S and acts on its K rows). Only a *source* fragment, one that another fragment
of its document follows, needs them: each rank walks its sources twice for ``E`` and
``M``, all ranks gather them (fp32, ``source_slots`` per rank: bytes independent of the
sequence length; nothing travels where no document crosses a rank boundary), every rank
chains each document's fragments in token order from its initial state (fp32, the same
ops in the same order on every rank), and each rank walks all its fragments from their
chained start states for the outputs and, for the documents that end on it, the final
states, which a second all-gather gives every rank.

The backward (``_GdnKcp.backward``) runs the mirror in a fixed order on every rank, so
that the ranks meet in the same collectives whatever their fragments: the final states'
gradients to the ranks holding the documents' last fragments (the gathers' adjoint, an
all-to-all summed in rank order: ``collectives``), the finishing walk's GDN backward, the
chain's adjoint in fp32 (every rank forms, from its own start states' gradients, the
gradient of the state at every source's end), those gradients to the sources' ranks, and
one more GDN backward over the sources: their walk from the chained start states with
that end gradient and no output gradient. Its parameter gradients are those of
``<dS_end, M S_start + E>``, the summaries' gradients taken through one walk instead of
the walks for ``E`` and ``M`` each (its start-state gradient, ``Mᵀ dS_end``, is the
chain adjoint's own and is dropped).

The initial and final states are replicated: every rank passes the same
``initial_state`` and receives the same final states; their gradients are partial, each
rank's from its own loss (their sum over the ranks is the gradient of the summed loss,
as for any replicated input).
"""

from __future__ import annotations

import torch

from ..checks import check_gdn
from ..ops.gdn import SAVE_MODES, gdn_tapes_bytes
from . import collectives
from .context import KcpContext


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])]) if x.shape[0] < rows else x


def _chain(E, M, S0, tables):
    """This rank's fragments' start states [F, HV, K, V] from every rank's source
    summaries ``E`` [W * source_slots, HV, K, V] and ``M`` [.., K, K] and the documents'
    initial states ``S0``: each document's fragments in token order, batched over the
    documents by the fragment's place in its document."""
    S, produced = S0, [S0]
    for docs, flats in tables.steps:
        S_next = torch.matmul(M.index_select(0, flats), S.index_select(0, docs)) + E.index_select(0, flats)
        produced.append(S_next)
        S = S.index_copy(0, docs, S_next)
    produced.append(S0.new_zeros(1, *S0.shape[1:]))  # the start of a rank's empty stand-in
    return torch.cat(produced).index_select(0, tables.local_starts)


def _chain_adjoint(dstarts, M, S0, tables):
    """(dE, dS0) of ``_chain`` given its start states' gradient, in fp32, the steps in
    reverse. ``dE`` of a source is the gradient of the state at its end (``E`` enters that
    state additively), which is all its backward walk needs (module docstring); the
    gradient of ``M`` is not formed."""
    rows = [S0.shape[0]] + [docs.shape[0] for docs, _ in tables.steps] + [1]
    dproduced = dstarts.new_zeros(sum(rows), *S0.shape[1:]).index_copy(0, tables.local_starts, dstarts)
    dproduced = list(dproduced.split(rows))
    dS = torch.zeros_like(S0)  # the gradient of the state after the last step: unused
    dE = M.new_zeros(*M.shape[:-1], S0.shape[-1])
    for p in reversed(range(len(tables.steps))):
        docs, flats = tables.steps[p]
        dnext = dproduced[p + 1] + dS.index_select(0, docs)
        dE = dE.index_copy(0, flats, dnext)
        dS = dS.index_copy(0, docs, torch.matmul(M.index_select(0, flats).transpose(-1, -2), dnext))
    return dE, dS + dproduced[0]


class _GdnKcp(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, g, beta, initial_state, kcp, scale, use_qk_l2norm, deterministic, full,
                output_final_state):
        K, HV, V = q.shape[-1], v.shape[1], v.shape[-1]
        tables = kcp.chain_tables(q.device)
        S0 = (initial_state.float() if initial_state is not None
              else q.new_zeros(kcp.documents, HV, K, V, dtype=torch.float32))
        walk = (scale, use_qk_l2norm, deterministic)
        sources = tables.source_cu_seqlens.shape[0] - 1
        summaries = q.new_zeros(0, HV, K, V + K, dtype=torch.float32)
        if sources:  # E from zero, M from the identity with v = 0, over the source fragments only
            sub = [x.index_select(0, tables.source_rows) for x in (q, k, v, g, beta)]
            cu = tables.source_cu_seqlens
            eye = torch.eye(K, device=q.device).expand(sources, HV, K, K).contiguous()
            _, E = torch.ops.cake.gdn_fwd(*sub, cu, None, *walk)
            _, M = torch.ops.cake.gdn_fwd(sub[0], sub[1], sub[2].new_zeros(sub[2].shape[0], HV, K), sub[3],
                                          sub[4], cu, eye, *walk)
            summaries = torch.cat([E, M], dim=-1)
        every = (collectives.gather(_padded(summaries, kcp.source_slots), kcp) if kcp.source_slots
                 else summaries)
        E_all, M_all = every[..., :V], every[..., V:]
        starts = _chain(E_all, M_all, S0, tables)
        if full:
            o, final, tapes = torch.ops.cake.gdn_fwd_full(q, k, v, g, beta, kcp.cu_seqlens, starts, *walk)
        else:
            (o, final), tapes = torch.ops.cake.gdn_fwd(q, k, v, g, beta, kcp.cu_seqlens, starts, *walk), None
        fctx.kcp, fctx.walk, fctx.sources = kcp, walk, sources
        fctx.has_initial, fctx.output_final_state = initial_state is not None, output_final_state
        # The backward's chain adjoint reads the transfers only (a copy: not the gathered E
        # beside them); the source sub-batch is formed again there, not kept.
        fctx.save_for_backward(q, k, v, g, beta, starts, M_all.contiguous(), S0, tapes)
        if not output_final_state:
            return o, None
        # Each document's final state from the rank holding its last fragment, to every rank.
        every_final = collectives.gather(_padded(final.index_select(0, tables.last_slots), kcp.last_slots), kcp)
        return o, torch.cat([every_final, S0]).index_select(0, tables.final_rows)

    @staticmethod
    def backward(fctx, do, dfinal):
        kcp, walk, sources = fctx.kcp, fctx.walk, fctx.sources
        q, k, v, g, beta, starts, M_all, S0, tapes = fctx.saved_tensors
        tables = kcp.chain_tables(q.device)
        do = torch.zeros_like(v) if do is None else do
        dS0 = torch.zeros_like(S0)
        dht = None
        if fctx.output_final_state:
            dfinal = torch.zeros_like(S0) if dfinal is None else dfinal
            pool = kcp.world * kcp.last_slots
            dcat = dfinal.new_zeros(pool + S0.shape[0], *S0.shape[1:]).index_copy(0, tables.final_rows, dfinal)
            mine = collectives.gather_adjoint(dcat[:pool], kcp)[: tables.last_slots.shape[0]]
            dht = torch.zeros_like(starts).index_copy(0, tables.last_slots, mine)
            dS0 = dS0 + dcat[pool:]
        dq, dk, dv, dg, dbeta, dstarts = torch.ops.cake.gdn_bwd(do, dht, q, k, v, g, beta, kcp.cu_seqlens, starts,
                                                                *walk, tapes)
        dE, dS0_chain = _chain_adjoint(dstarts, M_all, S0, tables)
        dS0 = dS0 + dS0_chain
        if kcp.source_slots:
            dend = collectives.gather_adjoint(dE, kcp)
            if sources:
                # The sources' walks again, from their chained start states, with the total
                # gradient of their end states and no output gradient: the gradient of
                # <dend, M S_start + E> through the summaries (the start states' gradient
                # that walk gives is the chain's M^T dend, already counted: dropped).
                cu, rows = tables.source_cu_seqlens, tables.source_rows
                sub = [x.index_select(0, rows) for x in (q, k, v, g, beta)]
                grads = torch.ops.cake.gdn_bwd(torch.zeros_like(sub[2]), dend[:sources].contiguous(), *sub, cu,
                                               starts.index_select(0, tables.source_fragments), *walk)
                dq = dq.index_add(0, rows, grads[0])
                dk = dk.index_add(0, rows, grads[1])
                dv = dv.index_add(0, rows, grads[2])
                dg = dg.index_add(0, rows, grads[3])
                dbeta = dbeta.index_add(0, rows, grads[4])
        dh0 = dS0 if fctx.has_initial else None
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None, None


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
    check_gdn(q, k, v, g, beta, ctx.cu_seqlens, None)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _GdnKcp.apply(q, k, v, g, beta, initial_state, ctx, float(scale), use_qk_l2norm, deterministic,
                         save_mode == "full", output_final_state)


def kcp_saved_bytes(ctx: KcpContext, H: int, HV: int, K: int = 128, V: int = 128, *,
                    dtype: torch.dtype = torch.bfloat16, beta_dtype: torch.dtype = torch.float32,
                    use_qk_l2norm: bool = False, save_mode: str = "light", cuda_kernels: bool = True) -> int:
    """Bytes of the tensors one ``gdn_kcp`` call on this rank keeps from its forward to
    its backward: its rows of q, k, v (``dtype``), g (fp32) and beta; the fragments'
    start states, the gathered transfers ``M`` and the documents' initial states (the
    caller's fp32 tensor, or zeros), fp32; in the full save mode
    the finishing walk's tapes (``gdn_tapes_bytes``) where the CUDA kernels run the call
    (``cuda_kernels``). Tests compare it with what the call saves."""
    if save_mode not in SAVE_MODES:
        raise ValueError(f"save_mode must be one of {SAVE_MODES}, got {save_mode!r}")
    T, F, state = ctx.local_tokens, len(ctx.fragments[ctx.rank]), HV * K * V * 4
    saved = (2 * T * H * K + T * HV * V) * dtype.itemsize + T * HV * (4 + beta_dtype.itemsize)
    saved += F * state + ctx.documents * state
    saved += ctx.world * ctx.source_slots * HV * K * K * 4
    if save_mode == "full" and cuda_kernels:
        saved += gdn_tapes_bytes(T, F, H, HV, use_qk_l2norm)
    return saved

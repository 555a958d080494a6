"""``gdn_kcp``: GDN over the ranks of a KCP context, as a composition of ``cake::gdn_fwd``
calls on each rank's fragments and all-gathers of per-fragment summaries.

The math (docs/kcp.md): a fragment's end state is affine in its start state,
``S_end = M S_start + E``, with ``E`` the end state walked from zero and ``M`` the
transfer (the end state walked from the identity with v = 0: the state update is
linear in S and acts on its K rows). Only a *source* fragment, one that another fragment
of its document follows, needs them, and a *lead* source, one that starts its
document, not even those: its start state is its document's initial state, known before
any exchange, so it is walked with its outputs first and its walked end state is its
summary (``E``, with ``M = 0``). Each rank walks its other (*relay*) sources twice, for
``E`` and ``M``; all ranks gather the summaries (fp32, ``source_slots`` per rank: bytes
independent of the sequence length; nothing travels where no document crosses a rank
boundary); every rank chains each document's fragments in token order from its initial
state (fp32, the same ops in the same order on every rank); and each rank walks the rest
of its fragments from their chained start states for the outputs and, for the documents
that end on it, the final states, which a second all-gather gives every rank.

The backward (``_GdnKcp.backward``) runs in a fixed order on every rank, so that the
ranks meet in the same collectives whatever their fragments: the final states'
gradients to the ranks holding the documents' last fragments (the gathers' adjoint, an
all-to-all summed in rank order: ``collectives``); each *sink* fragment's (one that
follows another of its document) start-state gradient ``F`` from its own outputs and end
gradient (``cake::gdn_bwd_initial_state``: the reverse walk alone), all-gathered; the
chain's adjoint in fp32, the same on every rank, giving every source's end-state
gradient (its next fragment's ``F`` plus, where that is a source too, ``Mᵀ`` of its own
end's gradient); and one ``cake::gdn_bwd`` per forward walk (the lead sources', the
rest's) from the chained start states with those end gradients. A source's summaries
need no backward of their own: the gradient of ``<dS_end, M S_start + E>`` is that of
its walk's end state, which that backward takes. Each fragment runs one backward; a
sink also the reverse walk for ``F``.

Deterministic calls where a document spans three ranks or more chain by neighbour hops
instead (``_hop_chain``; docs/kcp.md, "Relays"), whatever the exchange: a relay's end
state is its grid segments' summaries chained by the single-GPU chain kernel
(``cake::gdn_state_chain``) from the start state the previous hop brought, and in the
backward its start gradient by the backward's (``cake::gdn_state_grad_chain``), so that
on a grid-aligned context every chained state is the single-GPU op's, bitwise.

The initial and final states are replicated: every rank passes the same
``initial_state`` and receives the same final states; their gradients are partial, each
rank's from its own loss (their sum over the ranks is the gradient of the summed loss,
as for any replicated input).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import graphs
from ..checks import check_gdn, default_scale
from ..ops.gdn import SAVE_MODES, gdn_tapes_bytes, gdn_workspace_bytes
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
    for docs, flats, _ in tables.steps:
        S_next = torch.matmul(M.index_select(0, flats), S.index_select(0, docs)) + E.index_select(0, flats)
        produced.append(S_next)
        S = S.index_copy(0, docs, S_next)
    produced.append(S0.new_zeros(1, *S0.shape[1:]))  # the start of a rank's empty stand-in
    return torch.cat(produced).index_select(0, tables.local_starts)


def _chain_adjoint(F, M, documents: int, tables):
    """The gradient of the state at every source's end [W * source_slots, HV, K, V] (fp32,
    the steps in reverse) from every rank's sink start-state gradients ``F`` [W *
    sink_slots, ..] (the backward's walk of each sink from its end gradient, or from zero
    where a source follows it) and the transfers ``M``: a source's end is its next
    fragment's start, whose gradient is that fragment's ``F`` plus, where it is a source
    itself, ``Mᵀ`` of its own end's gradient."""
    dend = F.new_zeros(M.shape[0], *F.shape[1:])
    # Per document, Mᵀ dS_end of the source of the step after the current one (zero where
    # the document has none: a step's documents include the next step's).
    carried = F.new_zeros(documents, *F.shape[1:])
    for docs, sources, sinks in reversed(tables.steps):
        d = F.index_select(0, sinks) + carried.index_select(0, docs)
        dend = dend.index_copy(0, sources, d)
        carried = carried.index_copy(0, docs, torch.matmul(M.index_select(0, sources).transpose(-1, -2), d))
    return dend


def _at_places(x, rows, step):
    """``x[rows]`` placed at this rank's sources' places among the step's documents, zeros
    elsewhere: operands of the products ``_chain`` forms over all the step's documents."""
    return x.new_zeros(step.documents, *x.shape[1:]).index_copy(0, step.src_pos, x.index_select(0, rows))


def _ring_chain(E, M, S0, tables, steps, kcp):
    """``_chain`` by neighbour shifts (``exchange="ring"``): this rank's fragments' start
    states from its own source summaries ``E``, ``M`` [sources, ...] alone. Each step
    every rank forms the end states of its sources of that step, ``M S + E``, and sends
    them to the ranks holding the next fragments. The products run over all the step's
    documents, as ``_chain``'s (zeros where another rank's source sits), so that each
    source's end state has ``_chain``'s bits: a batched product's kernel, and with it a
    row's summation order, may depend on the batch's size."""
    starts = S0.new_zeros(len(kcp.fragments[kcp.rank]), *S0.shape[1:])
    starts = starts.index_copy(0, tables.first_fragments, S0.index_select(0, tables.first_docs))
    for step in steps:
        S_next = S0.new_zeros(0, *S0.shape[1:])
        if step.src_pos.numel():
            S_next = (torch.matmul(_at_places(M, step.src_slots, step), _at_places(starts, step.src_frags, step))
                      + _at_places(E, step.src_slots, step)).index_select(0, step.src_pos)
        received = collectives.shift(S_next, step.send_splits, step.recv_splits, kcp)
        starts = starts.index_copy(0, step.recv_frags, received)
    return starts


def _ring_chain_adjoint(F, M, steps, kcp, fragments: int, after):
    """``_chain_adjoint`` by neighbour shifts: per local fragment its end state's gradient
    (zero but for sources) from this rank's sinks' ``F`` (per local fragment) and its own
    transfers ``M``. The holder of a source's next fragment forms the gradient at the
    source's end and sends it back; the products run over all the step's documents, as in
    ``_ring_chain``. ``after``: the backward's gradient, for the shifts (``collectives``)."""
    dend = F.new_zeros(fragments, *F.shape[1:])
    carried = torch.zeros_like(dend)  # per local source: Mᵀ of its end's gradient
    for step in reversed(steps):
        d = F.index_select(0, step.recv_frags) + carried.index_select(0, step.recv_frags)
        back = collectives.shift(d, step.recv_splits, step.send_splits, kcp, after=after)
        dend = dend.index_copy(0, step.src_frags, back)
        if step.src_pos.numel():
            back_all = back.new_zeros(step.documents, *back.shape[1:]).index_copy(0, step.src_pos, back)
            Mt_d = torch.matmul(_at_places(M, step.src_slots, step).transpose(-1, -2), back_all)
            carried = carried.index_copy(0, step.src_frags, Mt_d.index_select(0, step.src_pos))
    return dend


def _hop_chain(ends, relay_ends, S0, tables, steps, kcp):
    """The chain by neighbour hops (deterministic calls where a document spans three
    ranks or more: docs/kcp.md, "Relays"): each step every rank sends the end states of
    its sources of that step, a lead's its walked end (``ends``, per local fragment), a
    relay's ``relay_ends(start states of this rank's relays)`` (its segments' summaries
    chained by the chain kernel from the start state an earlier step brought), to the
    ranks holding the next fragments. Returns this rank's fragments' start states."""
    starts = S0.new_zeros(len(kcp.fragments[kcp.rank]), *S0.shape[1:])
    starts = starts.index_copy(0, tables.first_fragments, S0.index_select(0, tables.first_docs))
    relays = tables.relay.fragments
    for step in steps:
        if step.relay_sends:
            ends = ends.index_copy(0, relays, relay_ends(starts.index_select(0, relays)))
        received = collectives.shift(ends.index_select(0, step.src_frags), step.send_splits, step.recv_splits, kcp)
        starts = starts.index_copy(0, step.recv_frags, received)
    return starts


def _hop_chain_adjoint(dstarts, relay_dstarts, tables, steps, kcp, after):
    """``_hop_chain``'s mirror: per local fragment its end state's gradient (zero but for
    sources), from the steps in reverse. Each step the holders of the steps' next
    fragments send the gradients at their starts back: a tail's its own chained start
    gradient (``dstarts``), a relay's ``relay_dstarts(end gradients of this rank's
    relays)`` (its segments' reverse summaries chained from the end gradient a later
    step brought). ``after``: the backward's gradient, for the shifts (``collectives``)."""
    dend, relays = torch.zeros_like(dstarts), tables.relay.fragments
    for step in reversed(steps):
        if step.relay_receives:
            dstarts = dstarts.index_copy(0, relays, relay_dstarts(dend.index_select(0, relays)))
        back = collectives.shift(dstarts.index_select(0, step.recv_frags), step.recv_splits, step.send_splits, kcp,
                                 after=after)
        dend = dend.index_copy(0, step.src_frags, back)
    return dend


def _relay_summaries(xs, kcp, opts, forward: bool, do=None):
    """Per grid segment of this rank's relays (``KcpContext.relay_segments``) its
    summaries from one ``cake::`` op call: forward, (E, M) (``cake::gdn_segment_summaries``:
    the segments' final states from zero and their transfers); backward, (F, B = Mᵀ)
    (``cake::gdn_segment_grad_summaries``: their initial states' gradients from do with
    no end gradient, and the transposed transfers). Returns (values, transfers, seg_cu)."""
    q, k, v, g, beta = xs
    HV = v.shape[1]
    seg = kcp.relay_segments(q.device, HV, opts.segment_chunks)
    grid = dict(segment_chunks=opts.segment_chunks, doc_flags=_flags(seg, opts, HV))
    sq, sk, sv, sg, sb = seg.take(q, k, v, g, beta)
    if forward:
        values, transfers = torch.ops.cake.gdn_segment_summaries(sq, sk, sv, sg, sb, seg.cu_seqlens, *opts.walk,
                                                                 **grid)
    else:
        (sdo,) = seg.take(do)
        values, transfers = torch.ops.cake.gdn_segment_grad_summaries(sdo, sq, sk, sg, sb, seg.cu_seqlens,
                                                                      *opts.walk, **grid)
    return values, transfers, seg.seg_cu


def _walk(xs, cu_seqlens, starts, opts, part=None):
    """One ``cake::gdn_fwd`` (or, saving the tapes, ``gdn_fwd_full``) of a sub-batch:
    (o, final states, tapes or None); with ``part`` (a ``SubBatch``) its doc_flags where
    the call is deterministic (``_flags``)."""
    grid = dict(segment_chunks=opts.segment_chunks, doc_flags=_flags(part, opts, xs[2].shape[1]))
    if opts.full:
        return torch.ops.cake.gdn_fwd_full(*xs, cu_seqlens, starts, *opts.walk, **grid)
    (o, final), tapes = torch.ops.cake.gdn_fwd(*xs, cu_seqlens, starts, *opts.walk, **grid), None
    return o, final, tapes


def _join(x_lead, x_rest, tables, dim_rows):
    """A tensor over all local rows (or fragments) from its lead and rest sub-batches'
    parts: the part itself where the other group is empty, a concatenation where the rest
    are the first rows and the leads the last (layout C), else placed by index."""
    if x_lead is None:
        return x_rest
    if x_rest is None:
        return x_lead
    lead, rest = tables.lead, tables.rest
    if dim_rows and rest.span is not None and lead.span is not None and rest.span[0] == 0 and rest.span[1] == lead.span[0]:
        return torch.cat([x_rest, x_lead])
    index = (lead.rows, rest.rows) if dim_rows else (lead.fragments, rest.fragments)
    out = x_rest.new_empty(x_lead.shape[0] + x_rest.shape[0], *x_rest.shape[1:])
    return out.index_copy(0, index[0], x_lead).index_copy(0, index[1], x_rest)


def _flags(part, opts, HV):
    """A sub-batch's doc_flags for the cake:: ops: on deterministic calls, so that a
    fragment's edges are chained as its document's cut grid chains them and, on the
    plan's grid, it is cut at its document's grid class (bitwise the single-GPU op where
    the rank boundaries sit on that grid: docs/kcp.md); None otherwise (a
    non-deterministic plan may be uncut, which takes no flags)."""
    if part is None or not opts.walk[2]:
        return None
    return part.grid_flags(HV) if opts.segment_chunks == -1 else part.doc_flags


@dataclasses.dataclass(frozen=True)
class _Opts:
    """A call's options, fixed for its forward and backward (the replay key's scalars)."""

    walk: tuple  # (scale, use_qk_l2norm, deterministic), as every cake:: op takes them
    full: bool
    output_final_state: bool
    ring: bool
    save_transfer: bool
    has_initial: bool
    segment_chunks: int  # every walk's cut grid (-1: the ops' plan; ``segments``)
    hops: bool  # deterministic with relays: the chain by neighbour hops (``_hop_chain``)


def _summary_starts(xs, lead_out, S0, tables, kcp, opts):
    """This rank's fragments' start states from the sources' summaries (the relays' E
    and M from two ``cake::gdn_fwd_final_state`` calls, the leads' walked ends with M =
    0), chained by the a2a exchange (gathered, every rank chaining every document) or
    the ring; and the transfers the backward's chain adjoint reads."""
    q, v = xs[0], xs[2]
    K, HV, V = q.shape[-1], v.shape[1], v.shape[-1]
    lead, relay, walk = tables.lead, tables.relay, opts.walk
    parts = []
    if relay.count:  # E from zero, M from the identity with v = 0
        sub = relay.take(*xs)
        eye = torch.eye(K, device=q.device).expand(relay.count, HV, K, K).contiguous()
        E = torch.ops.cake.gdn_fwd_final_state(*sub, relay.cu_seqlens, None, *walk,
                                               segment_chunks=opts.segment_chunks)
        M = torch.ops.cake.gdn_fwd_final_state(sub[0], sub[1], sub[2].new_zeros(relay.tokens, HV, K),
                                               sub[3], sub[4], relay.cu_seqlens, eye, *walk,
                                               segment_chunks=opts.segment_chunks)
        parts.append((tables.relay_sources, torch.cat([E, M], dim=-1)))
    if lead.count:
        end = lead_out[1]
        parts.append((tables.lead_sources, torch.cat([end, end.new_zeros(lead.count, HV, K, K)], dim=-1)))
    summaries = q.new_zeros(0, HV, K, V + K, dtype=torch.float32)
    if len(parts) == 1:
        summaries = parts[0][1]
    elif parts:
        summaries = q.new_empty(lead.count + relay.count, HV, K, V + K, dtype=torch.float32)
        for at, x in parts:
            summaries = summaries.index_copy(0, at, x)
    if opts.ring:
        starts = _ring_chain(summaries[..., :V], summaries[..., V:], S0, tables, kcp.ring_tables(q.device), kcp)
        transfers = summaries[..., V:].contiguous()  # this rank's own: the ring's backward reads no other
    else:
        every = collectives.gather(_padded(summaries, kcp.source_slots), kcp) if kcp.source_slots else summaries
        E_all, M_all = every[..., :V], every[..., V:]
        starts = _chain(E_all, M_all, S0, tables)
        # The backward's chain adjoint reads the transfers only (a copy: not the gathered
        # E beside them); without save_transfer only this rank's, gathered again there.
        transfers = (M_all if opts.save_transfer else _padded(summaries[..., V:], kcp.source_slots)).contiguous()
    return starts, transfers


def _hop_starts(xs, lead_out, S0, tables, kcp, opts):
    """This rank's fragments' start states by neighbour hops (``_hop_chain``): the leads'
    walked ends, the relays' ends chained from their segments' summaries."""
    ends = S0.new_zeros(len(kcp.fragments[kcp.rank]), *S0.shape[1:])
    if tables.lead.count:
        ends = ends.index_copy(0, tables.lead.fragments, lead_out[1])
    relay_ends = None
    if tables.relay.count:
        E, M, seg_cu = _relay_summaries(xs, kcp, opts, forward=True)
        relay_ends = lambda S: torch.ops.cake.gdn_state_chain(E, M, S, seg_cu)  # noqa: E731
    return _hop_chain(ends, relay_ends, S0, tables, kcp.ring_tables(S0.device), kcp)


def _forward(q, k, v, g, beta, initial_state, *, kcp, opts) -> dict:
    """The forward's tensors: ``o``, ``final`` (with output_final_state) and what the
    backward reads (``starts``, ``transfers``, ``S0``, ``lead_tapes``, ``rest_tapes``;
    absent where the call has none)."""
    K, HV, V = q.shape[-1], v.shape[1], v.shape[-1]
    tables, walk, xs = kcp.chain_tables(q.device), opts.walk, (q, k, v, g, beta)
    out: dict = {}
    if kcp.source_slots == 0 and initial_state is None:
        # No document crosses a rank boundary and none has an initial state: every fragment
        # is a whole document from zero, the single-GPU op on this rank's rows (no chain,
        # no start states passed or saved, and in the backward no end gradients but the
        # final states').
        out["o"], final, out["rest_tapes"] = _walk(xs, kcp.cu_seqlens, None, opts)
        if opts.output_final_state:
            out["final"] = _final_states(final, final.new_zeros(kcp.documents, *final.shape[1:]), kcp, tables)
        return {n: x for n, x in out.items() if x is not None}
    S0 = (initial_state.float() if initial_state is not None
          else q.new_zeros(kcp.documents, HV, K, V, dtype=torch.float32))
    lead, rest = tables.lead, tables.rest
    # The lead sources start from their documents' initial states: walked with their
    # outputs before any exchange, their end states are their summaries (E, with M = 0).
    lead_out = None
    if lead.count:
        lead_out = _walk(lead.take(*xs), lead.cu_seqlens,
                         S0.index_select(0, tables.lead_docs) if initial_state is not None else None, opts, lead)
    if opts.hops:
        starts, transfers = _hop_starts(xs, lead_out, S0, tables, kcp, opts), None
    else:
        starts, transfers = _summary_starts(xs, lead_out, S0, tables, kcp, opts)
    rest_out = None
    if rest.count:  # every other fragment from its chained start state
        rest_starts = starts if not lead.count else starts.index_select(0, rest.fragments)
        rest_out = _walk(rest.take(*xs), rest.cu_seqlens, rest_starts, opts, rest)
    out["o"] = _join(lead_out and lead_out[0], rest_out and rest_out[0], tables, True)
    # The sub-batches are formed again in the backward, not kept.
    out.update(starts=starts, transfers=transfers, S0=S0, lead_tapes=lead_out and lead_out[2],
               rest_tapes=rest_out and rest_out[2])
    if opts.output_final_state:
        out["final"] = _final_states(_join(lead_out and lead_out[1], rest_out and rest_out[1], tables, False), S0,
                                     kcp, tables)
    return {n: x for n, x in out.items() if x is not None}


def _final_states(final, S0, kcp, tables):
    """Each document's final state from the rank holding its last fragment, to every rank
    (an empty document's is its initial state, S0)."""
    every_final = collectives.gather(_padded(final.index_select(0, tables.last_slots), kcp.last_slots), kcp)
    return torch.cat([every_final, S0]).index_select(0, tables.final_rows)


def _backward(do, dfinal, q, k, v, g, beta, starts, transfers, S0, lead_tapes, rest_tapes, *, kcp, opts) -> dict:
    """The gradients ``dq`` .. ``dbeta`` and, with an initial state, ``dh0``. ``do`` and
    (with output_final_state) ``dfinal`` are tensors (zeros where autograd gave none);
    ``starts``, ``transfers``, ``S0`` are None on the unchained path (``_forward``)."""
    tables, walk = kcp.chain_tables(q.device), opts.walk
    state = (kcp.documents, v.shape[1], q.shape[-1], v.shape[-1])
    dS0 = q.new_zeros(state, dtype=torch.float32) if S0 is not None else None
    # Each local fragment's end gradient: the final states' (document-last fragments) or,
    # for a source, its next fragment's start gradient (below).
    dht = q.new_zeros(kcp.cu_seqlens.shape[0] - 1, *state[1:], dtype=torch.float32) if S0 is not None else None
    if opts.output_final_state:
        pool = kcp.world * kcp.last_slots
        dcat = dfinal.new_zeros(pool + state[0], *state[1:]).index_copy(0, tables.final_rows, dfinal)
        mine = collectives.gather_adjoint(dcat[:pool], kcp, after=do)[: tables.last_slots.shape[0]]
        if dht is None:
            dht = q.new_zeros(kcp.cu_seqlens.shape[0] - 1, *state[1:], dtype=torch.float32)
        dht = dht.index_copy(0, tables.last_slots, mine)
        if dS0 is not None:
            dS0 = dS0 + dcat[pool:]
    if opts.hops:
        dht = _hop_end_gradients(do, dht, q, k, v, g, beta, starts, tables, kcp, opts)
    elif kcp.sink_slots:
        # The sinks' start-state gradients from their own outputs and end gradients, to
        # every rank. A sink that is a source too (a document's middle) walks back from
        # zero here: the gradient at its end enters through the chain, as Mᵀ dS_end.
        sinks = tables.sinks
        F = q.new_zeros(0, *starts.shape[1:], dtype=torch.float32)
        if sinks.count:
            F = torch.ops.cake.gdn_bwd_initial_state(
                *sinks.take(do), dht.index_select(0, sinks.fragments).contiguous(),
                *sinks.take(q, k, g, beta), sinks.cu_seqlens, *walk, segment_chunks=opts.segment_chunks,
                doc_flags=_flags(sinks, opts, do.shape[1]))
        if opts.ring:
            F_local = torch.zeros_like(starts).index_copy(0, sinks.fragments, F)
            picked = _ring_chain_adjoint(F_local, transfers, kcp.ring_tables(q.device), kcp, starts.shape[0], do)
        else:
            M_all = transfers if opts.save_transfer else collectives.gather(transfers, kcp, after=do)
            F_all = collectives.gather(_padded(F, kcp.sink_slots), kcp, after=do)
            dend = _chain_adjoint(F_all, M_all, kcp.documents, tables)
            picked = dend.index_select(0, tables.local_sources.clamp(min=0))
        is_source = tables.local_sources >= 0
        dht = torch.where(is_source[:, None, None, None], picked, dht)
    # One backward per forward walk (the lead sources', the rest's), each fragment from its
    # chained start state with its end gradient: a source's summaries' gradients come with
    # it (the gradient of <dS_end, M S_start + E> is that of its walk's end state).
    grads = []
    for part, tapes in ((tables.lead, lead_tapes), (tables.rest, rest_tapes)):
        whole = part.count == len(kcp.fragments[kcp.rank])
        pick = lambda x: x if x is None or whole else x.index_select(0, part.fragments)  # noqa: E731
        grads.append(torch.ops.cake.gdn_bwd(*part.take(do), pick(dht), *part.take(q, k, v, g, beta),
                                            part.cu_seqlens, pick(starts), *walk, tapes,
                                            segment_chunks=opts.segment_chunks,
                                            doc_flags=_flags(part, opts, v.shape[1]) if starts is not None else None)
                     if part.count else None)
    lead_g, rest_g = grads
    out = {n: _join(lead_g and lead_g[i], rest_g and rest_g[i], tables, True)
           for i, n in enumerate(("dq", "dk", "dv", "dg", "dbeta"))}
    if opts.has_initial:
        dstarts = _join(lead_g and lead_g[5], rest_g and rest_g[5], tables, False)
        out["dh0"] = dS0.index_add(0, tables.first_docs, dstarts.index_select(0, tables.first_fragments))
    return out


def _hop_end_gradients(do, dht, q, k, v, g, beta, starts, tables, kcp, opts):
    """``dht`` with every source's end gradient from the chain's mirror by neighbour
    hops (``_hop_chain_adjoint``): the tails' chained start gradients (the backward's
    initial-state op from their own end gradients), the relays' chained through their
    segments' reverse summaries."""
    tails, HV = tables.tails, v.shape[1]
    dstarts = torch.zeros_like(starts)
    if tails.count:
        F = torch.ops.cake.gdn_bwd_initial_state(
            *tails.take(do), dht.index_select(0, tails.fragments).contiguous(), *tails.take(q, k, g, beta),
            tails.cu_seqlens, *opts.walk, segment_chunks=opts.segment_chunks, doc_flags=_flags(tails, opts, HV))
        dstarts = dstarts.index_copy(0, tails.fragments, F)
    relay_dstarts = None
    if tables.relay.count:
        F, B, seg_cu = _relay_summaries((q, k, v, g, beta), kcp, opts, forward=False, do=do)
        relay_dstarts = lambda d: torch.ops.cake.gdn_state_grad_chain(F, B, d, seg_cu)  # noqa: E731
    dend = _hop_chain_adjoint(dstarts, relay_dstarts, tables, kcp.ring_tables(q.device), kcp, do)
    return torch.where((tables.local_sources >= 0)[:, None, None, None], dend, dht)


_replay_names: dict = {}  # a replay key -> the names of its launch's outputs, in order


def _run(fn, tensors: dict, *, kcp, opts) -> dict:
    """``fn(**tensors, kcp=kcp, opts=opts)``, a dict of tensors; with a context built for
    ``graph_replay`` and CUDA tensors, as a graph replay of its key (``cake_ops.graphs``:
    the key holds the context's serial, the options and every tensor's shape, strides and
    dtype; absent tensors, None, are part of it)."""
    names_in = sorted(tensors)
    args = [tensors[n] for n in names_in]
    if (not kcp.graph_replay or torch.compiler.is_compiling()
            or not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)):
        return fn(**tensors, kcp=kcp, opts=opts)
    op = ("gdn_kcp", fn.__name__, kcp.serial, opts, tuple(a is None for a in args))
    present = [a for a in args if a is not None]
    key = graphs.key(op, present)

    def launch(*xs):
        it = iter(xs)
        out = fn(**{n: (None if a is None else next(it)) for n, a in zip(names_in, args)}, kcp=kcp, opts=opts)
        _replay_names[key] = sorted(out)
        return tuple(out[n] for n in _replay_names[key])

    got = graphs.replay(op, launch, present)
    got = got if isinstance(got, tuple) else (got,)
    return dict(zip(_replay_names[key], got))


class _GdnKcp(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, g, beta, initial_state, kcp, opts):
        fctx.kcp, fctx.opts = kcp, opts
        out = _run(_forward, dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state), kcp=kcp, opts=opts)
        fctx.save_for_backward(q, k, v, g, beta, *(out.get(n) for n in SAVED))
        return out["o"], out.get("final")

    @staticmethod
    def backward(fctx, do, dfinal):
        kcp, opts = fctx.kcp, fctx.opts
        q, k, v, g, beta, *saved = fctx.saved_tensors
        do = torch.zeros_like(v) if do is None else do
        if opts.output_final_state and dfinal is None:
            dfinal = q.new_zeros(kcp.documents, v.shape[1], q.shape[-1], v.shape[-1], dtype=torch.float32)
        tensors = dict(do=do, dfinal=dfinal if opts.output_final_state else None, q=q, k=k, v=v, g=g, beta=beta,
                       **dict(zip(SAVED, saved)))
        out = _run(_backward, tensors, kcp=kcp, opts=opts)
        return out["dq"], out["dk"], out["dv"], out["dg"], out["dbeta"], out.get("dh0"), None, None


SAVED = ("starts", "transfers", "S0", "lead_tapes", "rest_tapes")  # what _backward reads of _forward's


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
    exchange: str = "a2a",
    save_mode: str = "light",
    save_transfer: bool = True,
    segments: int | None = None,
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
        exchange: how the chain's data travels. "a2a" (default): every rank's source
            summaries all-gathered, every rank chaining every document (one collective
            each way, W summaries received). "ring": each source's end state sent to the
            rank holding its document's next fragment, one neighbour shift per step of
            the chain (state-sized messages, as many steps as a document has fragments,
            less one), and its gradient back the same way. The same bits either way: the
            chain's products have the same shapes in both (tested on gloo). Deterministic
            calls on a context with relays (a document over three ranks or more) chain
            by such hops in either exchange, each relay's end from the chain kernel on
            its segments' summaries: bitwise the single-GPU op on a grid-aligned
            context (docs/kcp.md).
        save_transfer: keep the gathered transfers ``M`` of every rank for the backward
            (default) or only this rank's, gathered again there (W - 1 times less memory,
            one more all-gather). The ring keeps only this rank's and reads no other:
            it requires False.
        segments: the cut grid of this rank's walks on the CUDA kernels, as a count P:
            every fragment cut every ceil(C / P) chunks, C those of the rank's longest
            fragment (cut so into P segments, the others into at most P), each segment
            summarised and chained in fp32 as the single-GPU op's cut grid is. None
            (default): the single-GPU plan's grid. The grid is fixed by the plan and P,
            never the SM count, so deterministic calls stay bitwise reproducible; the
            PyTorch path walks uncut either way.
    Returns:
        (o, this rank's rows [T_r, HV, V]; final states or None). Gradients of the
        replicated states are partial (module docstring).
    """
    if not isinstance(ctx, KcpContext):
        raise TypeError(f"ctx must be a KcpContext (build_context_kcp), got {type(ctx).__name__}")
    if save_mode not in SAVE_MODES:
        raise ValueError(f"save_mode must be one of {SAVE_MODES}, got {save_mode!r}")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if not isinstance(save_transfer, bool):
        raise ValueError(f"save_transfer must be True or False, got {save_transfer!r}")
    if exchange == "ring" and save_transfer:
        raise ValueError("exchange='ring' requires save_transfer=False: the ring keeps only this rank's transfers "
                         "(no other rank's reach it)")
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
        scale = default_scale(q.shape[-1])
    opts = _Opts((float(scale), use_qk_l2norm, deterministic), save_mode == "full", output_final_state,
                 exchange == "ring", save_transfer, initial_state is not None, _segment_chunks(ctx, segments),
                 deterministic and ctx.has_relays)
    return _GdnKcp.apply(q, k, v, g, beta, initial_state, ctx, opts)


EXCHANGES = ("a2a", "ring")


def _segment_chunks(ctx: KcpContext, segments) -> int:
    """The ops' ``segment_chunks`` for ``gdn_kcp(segments=)`` on this rank (-1 for None)."""
    if segments is None:
        return -1
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments must be None (the plan's cut grid) or an int >= 1, got {segments!r}")
    longest = max(-(-f.tokens // 64) for f in ctx.fragments[ctx.rank])
    return max(1, -(-longest // segments))


def kcp_saved_bytes(ctx: KcpContext, H: int, HV: int, K: int = 128, V: int = 128, *,
                    dtype: torch.dtype = torch.bfloat16, beta_dtype: torch.dtype = torch.float32,
                    use_qk_l2norm: bool = False, save_mode: str = "light", cuda_kernels: bool = True,
                    exchange: str = "a2a", save_transfer: bool = True, initial_state: bool = False,
                    deterministic: bool = True) -> int:
    """Bytes of the tensors one ``gdn_kcp`` call on this rank keeps from its forward to
    its backward: its rows of q, k, v (``dtype``), g (fp32) and beta; the fragments'
    start states, the transfers ``M`` (every rank's, gathered, with ``save_transfer``;
    else this rank's own: padded to its source slots for the backward's all-gather in the
    a2a exchange, unpadded in the ring) and the documents' initial states (the caller's
    fp32 tensor, or zeros), fp32, unless no document crosses a rank boundary and the call
    has no ``initial_state`` (then every fragment is a whole document from zero); no
    transfers where a deterministic call chains by hops (``KcpContext.has_relays``: each
    backward forms its relays' own); in the full save mode
    the finishing walk's tapes (``gdn_tapes_bytes``) where the CUDA kernels run the call
    (``cuda_kernels``). Tests compare it with what the call saves."""
    if save_mode not in SAVE_MODES:
        raise ValueError(f"save_mode must be one of {SAVE_MODES}, got {save_mode!r}")
    T, F, state = ctx.local_tokens, len(ctx.fragments[ctx.rank]), HV * K * V * 4
    saved = (2 * T * H * K + T * HV * V) * dtype.itemsize + T * HV * (4 + beta_dtype.itemsize)
    if ctx.source_slots or initial_state:  # the fragments' start states and the documents' initial states
        saved += F * state + ctx.documents * state
    transfers = ctx.world * ctx.source_slots if exchange == "a2a" and save_transfer else (
        ctx.source_slots if exchange == "a2a" else len(ctx.sources[ctx.rank]))
    if not (deterministic and ctx.has_relays):
        saved += transfers * HV * K * K * 4
    if save_mode == "full" and cuda_kernels:  # one tapes block per forward walk: the lead sources', the rest's
        for part in _walks(ctx):
            saved += gdn_tapes_bytes(sum(f.tokens for f in part), len(part), H, HV, use_qk_l2norm)
    return saved


def _walks(ctx: KcpContext) -> list[list]:
    """The fragments of this rank's forward walks with outputs (``_GdnKcp.forward``): its
    lead sources (none where no document crosses a rank boundary), then the rest; empty
    ones left out."""
    frags, leads = ctx.fragments[ctx.rank], ctx.leads[ctx.rank]
    parts = [[frags[s] for s in leads], [f for s, f in enumerate(frags) if s not in leads]]
    return [p for p in parts if p]


def kcp_workspace_bytes(ctx: KcpContext, H: int, HV: int, *, use_qk_l2norm: bool = False, deterministic: bool = True,
                        save_mode: str = "light", direction: str = "forward", segments: int | None = None,
                        initial_state: bool = False) -> int:
    """The largest workspace one ``cake::`` op of a ``gdn_kcp`` call allocates on this
    rank, in its forward or its backward (``direction``), on the CUDA kernels (K = V =
    128; ``cake_ops.gdn_workspace_bytes`` of each op's batch, which tests hold to the
    allocator): the forward walks the lead sources, takes the relay sources' final states
    for ``E`` and ``M`` and then walks the rest of the fragments (the walks in the save
    mode's form); the backward walks the sink fragments back for their start states'
    gradients and then runs the backward of each walk's fragments. The ops
    run one after another, so this is the most workspace the call holds at once beside
    its tensors. ``initial_state``: the call passes one (then every call is chained, as
    where a document crosses a rank boundary). Needs the CUDA extension."""
    if save_mode not in SAVE_MODES:
        raise ValueError(f"save_mode must be one of {SAVE_MODES}, got {save_mode!r}")
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    frags = ctx.fragments[ctx.rank]
    segment_chunks = _segment_chunks(ctx, segments)
    opts = dict(use_qk_l2norm=use_qk_l2norm, deterministic=deterministic, segment_chunks=segment_chunks)
    # Deterministic chained calls pass doc_flags (``_flags``), which add slots to the plan.
    flags = deterministic and (ctx.source_slots > 0 or initial_state)
    # (tokens, documents, direction, doc_flags) of each op call
    calls = [(sum(f.tokens for f in part), len(part), "forward" if direction == "forward" else "backward", flags)
             for part in _walks(ctx)]
    if deterministic and ctx.has_relays:  # the hops: the relays' segments, the tails
        seg = ctx.relay_segments(torch.device("cpu"), HV, segment_chunks)
        if seg.count:
            calls.append((seg.tokens, seg.count,
                          "segment_summaries" if direction == "forward" else "segment_grad_summaries", True))
        tails = [frags[s] for s in ctx.tails[ctx.rank]]
        if direction == "backward" and tails:
            calls.append((sum(f.tokens for f in tails), len(tails), "initial_state", flags))
    else:
        relays = [frags[s] for s in ctx.relays[ctx.rank]]
        sinks = [frags[s] for s in ctx.sinks[ctx.rank]]
        if direction == "forward" and relays:
            calls.append((sum(f.tokens for f in relays), len(relays), "final_state", False))
        if direction == "backward" and sinks:
            calls.append((sum(f.tokens for f in sinks), len(sinks), "initial_state", flags))
    return max(gdn_workspace_bytes(T, N, H, HV, save_mode=save_mode, direction=d, doc_flags=fl, **opts)
               for T, N, d, fl in calls)

"""The KCP plan: which rank holds which fragment of which document, made once per batch
outside the hot path (``build_context_kcp``), and the tables every rank derives from it.

A rank holds some global token ranges (the layout, below). Cut at document boundaries
they are its *fragments*, each a contiguous piece of one document; the rank's local
tensors are its fragments' tokens in global order, and its local ``cu_seqlens`` has one
entry per fragment, so the single-GPU ops run on them unchanged. A rank that holds no
token holds one empty fragment (a document of 0 tokens) so that its ops still run.

Layouts, for W ranks and T tokens (docs/kcp.md):
- ``"C"``: contiguous equal split, rank r holds tokens [r T / W, (r + 1) T / W);
- ``"Z"``: zigzag halves, the tokens cut into 2W equal pieces, rank r holding pieces r
  and 2W - 1 - r;
- ``"D"``: per-document zigzag, every document cut so, rank r holding its pieces r and
  2W - 1 - r of every document.
With ``align`` > 1 every cut that falls inside a document moves to the nearest multiple
of ``align`` tokens from the document's start (or to its end): ``GRID_ALIGN`` puts every
rank boundary on the deterministic cut grid of the CUDA plan, which deterministic KCP's
bitwise equality with the single-GPU op needs (docs/kcp.md); a document shorter than
``align`` is never cut, and each cut moves by up to ``align / 2`` tokens.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import collectives

LAYOUTS = ("C", "Z", "D")
GRID_ALIGN = 4096  # tokens: a multiple of every deterministic cut grid of the CUDA plan (64 or 32 chunks)
# The deterministic CUDA plan's grid (csrc/gdn/plan.h kGdnDetSegChunks, kGdnDetFillWalks).
_DET_SEG_CHUNKS, _DET_FILL_WALKS = 64, 128
# doc_flags' bits (csrc/gdn/gdn.h): the fragment opens / closes inside its document; it is
# cut at the half / the full grid, its document's class.
OPENS_INSIDE, CLOSES_INSIDE, HALF_GRID, FULL_GRID = 1, 2, 4, 8
_serials = itertools.count()


@dataclasses.dataclass(frozen=True)
class Fragment:
    """Global tokens [start, end) of document ``doc`` (-1: a rank's empty stand-in)."""

    doc: int
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


def half_grid(chunks: int, HV: int) -> bool:
    """Whether the deterministic CUDA plan cuts a document of ``chunks`` 64-token chunks
    at half its grid at ``HV`` value heads (csrc/gdn/chunks.cuh ``doc_cut_chunks`` with
    plan.h ``gdn_fwd_choose_segment_long_max``): a long document whose full-grid segments
    alone would leave SMs idle."""
    long_max = _DET_SEG_CHUNKS * (-(-_DET_FILL_WALKS // HV) - 1)
    return long_max > 2 * _DET_SEG_CHUNKS and 2 * _DET_SEG_CHUNKS < chunks <= long_max


def _snap(cu: Sequence[int], t: int, align: int) -> int:
    """A cut at global token t, moved where it falls inside a document to the nearest
    multiple of ``align`` tokens from the document's start (or its end)."""
    if align == 1:
        return t
    d = bisect.bisect_right(cu, t) - 1
    if d < 0 or d >= len(cu) - 1 or t == cu[d]:
        return t
    return min(cu[d] + (t - cu[d] + align // 2) // align * align, cu[d + 1])


def _held_ranges(cu: Sequence[int], world: int, layout: str, align: int = 1) -> list[list[tuple[int, int]]]:
    """Per rank, the global token ranges it holds, in token order (each cut inside a
    document moved to the ``align`` grid from the document's start: ``_snap``)."""
    T = cu[-1]
    if layout == "C":
        cuts = [_snap(cu, r * T // world, align) for r in range(world + 1)]
        return [[(cuts[r], cuts[r + 1])] for r in range(world)]
    if layout == "Z":
        cuts = [_snap(cu, i * T // (2 * world), align) for i in range(2 * world + 1)]
        return [[(cuts[r], cuts[r + 1]), (cuts[2 * world - 1 - r], cuts[2 * world - r])] for r in range(world)]
    held: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for d in range(len(cu) - 1):
        L = cu[d + 1] - cu[d]
        cuts = [_snap(cu, cu[d] + i * L // (2 * world), align) for i in range(2 * world + 1)]
        for r in range(world):
            held[r] += [(cuts[r], cuts[r + 1]), (cuts[2 * world - 1 - r], cuts[2 * world - r])]
    return [sorted(h) for h in held]


def _fragments(cu: Sequence[int], ranges: list[tuple[int, int]]) -> tuple[Fragment, ...]:
    merged: list[tuple[int, int]] = []
    for a, b in ranges:  # adjacent ranges (Z's two middle pieces, D's) are one
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        elif a < b:
            merged.append((a, b))
    out = []
    for a, b in merged:
        for d in range(len(cu) - 1):
            s, e = max(a, cu[d]), min(b, cu[d + 1])
            if s < e:
                out.append(Fragment(d, s, e))
    return tuple(out) if out else (Fragment(-1, 0, 0),)


def _kept(cache: dict, key, make):
    """``cache[key]``, made by ``make()`` at its first use and kept there, except while
    torch.compile traces: the trace makes it in the graph and keeps nothing (a write to a
    context inside a compiled checkpoint region is a side effect Dynamo refuses)."""
    if key in cache:
        return cache[key]
    value = make()
    if not torch.compiler.is_compiling():
        cache[key] = value
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class KcpContext:
    """The plan all ranks agree on (``build_context_kcp``). ``fragments[r]``: rank r's
    fragments in token order; ``slots``: the most fragments a rank holds (the exchanged
    summaries are padded to it); ``cu_seqlens``: this rank's local ``cu_seqlens`` (int32,
    on ``device``); ``graph_replay``: ``gdn_kcp`` calls on CUDA tensors replay their
    forward's and their backward's launches from CUDA graphs (``build_context_kcp``)."""

    group_name: str
    world: int
    rank: int
    layout: str
    conv_width: int
    cu_seqlens_global: tuple[int, ...]
    fragments: tuple[tuple[Fragment, ...], ...]
    slots: int
    cu_seqlens: torch.Tensor
    graph_replay: bool = False
    align: int = 1  # cuts inside documents on multiples of this from their starts (build_context_kcp)
    serial: int = dataclasses.field(default_factory=lambda: next(_serials))  # this context's, in graph replay keys
    _tables: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        # The plan's derived views (the cached properties below), formed now rather than at
        # their first use: a first use while torch.compile traces a checkpoint region would
        # write to the context there, which Dynamo refuses (and Python 3.11's
        # cached_property takes a lock it cannot trace).
        for name, attr in type(self).__dict__.items():
            if isinstance(attr, functools.cached_property):
                getattr(self, name)

    @property
    def documents(self) -> int:
        return len(self.cu_seqlens_global) - 1

    @property
    def local_tokens(self) -> int:
        return sum(f.tokens for f in self.fragments[self.rank])

    @functools.cached_property
    def doc_fragments(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per document, its fragments as (rank, slot), in token order."""
        per_doc: list[list[tuple[int, int, int]]] = [[] for _ in range(self.documents)]
        for r, frags in enumerate(self.fragments):
            for s, f in enumerate(frags):
                if f.doc >= 0:
                    per_doc[f.doc].append((f.start, r, s))
        return tuple(tuple((r, s) for _, r, s in sorted(p)) for p in per_doc)

    @functools.cached_property
    def sources(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, the slots of its source fragments (followed by another fragment of
        their document), ascending."""
        return self._slots_where(lambda frags: frags[:-1])

    @functools.cached_property
    def sinks(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, the slots of its sink fragments (preceded by another fragment of
        their document), ascending."""
        return self._slots_where(lambda frags: frags[1:])

    def _slots_where(self, pick) -> tuple[tuple[int, ...], ...]:
        per_rank: list[list[int]] = [[] for _ in range(self.world)]
        for frags in self.doc_fragments:
            for r, s in pick(frags):
                per_rank[r].append(s)
        return tuple(tuple(sorted(slots)) for slots in per_rank)

    @functools.cached_property
    def leads(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, the slots of its lead sources: sources that start their document
        (their start state is known before any exchange), ascending."""
        firsts = {frags[0] for frags in self.doc_fragments if frags}
        return tuple(tuple(s for s in self.sources[r] if (r, s) in firsts) for r in range(self.world))

    @functools.cached_property
    def relays(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, the slots of its other sources (inside a document), ascending."""
        return tuple(tuple(s for s in self.sources[r] if s not in self.leads[r]) for r in range(self.world))

    @functools.cached_property
    def tails(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, the slots of its sinks that are no source (the last fragments of the
        documents that cross a rank boundary), ascending."""
        return tuple(tuple(s for s in self.sinks[r] if s not in self.sources[r]) for r in range(self.world))

    @functools.cached_property
    def has_relays(self) -> bool:
        """Whether a document spans three ranks or more (some rank holds a relay): then
        deterministic ``gdn_kcp`` calls chain by neighbour hops (docs/kcp.md)."""
        return any(self.relays)

    @functools.cached_property
    def source_slots(self) -> int:
        """The most source fragments a rank holds."""
        return max(len(s) for s in self.sources)

    @functools.cached_property
    def sink_slots(self) -> int:
        """The most sink fragments a rank holds."""
        return max(len(s) for s in self.sinks)

    @functools.cached_property
    def last_slots(self) -> int:
        """The most document-last fragments a rank holds."""
        count = [0] * self.world
        for frags in self.doc_fragments:
            if frags:
                count[frags[-1][0]] += 1
        return max(count)

    def chain_tables(self, device: torch.device) -> ChainTables:
        """The chain's index tensors on ``device`` (made at the first call per device)."""
        return _kept(self._tables, ("chain", device), lambda: _chain_tables(self, device))

    def relay_segments(self, device: torch.device, HV: int, segment_chunks: int) -> SubBatch:
        """This rank's relays' rows cut into the grid segments of their walks, each segment
        a document of the sub-batch (``seg_cu``: each relay's segments' rows among them),
        flagged to open and close inside its document and, on the plan's grid
        (``segment_chunks`` = -1), of the relay's document's grid class: the summaries of
        those segments are the ones a call on the relay chains (docs/kcp.md, "Relays")."""
        return _kept(self._tables, ("relay_segments", device, HV, segment_chunks),
                     lambda: _relay_segments(self, device, HV, segment_chunks))

    def ring_tables(self, device: torch.device) -> tuple[RingStep, ...]:
        """The ring exchange's steps on ``device`` (made at the first call per device)."""
        return _kept(self._tables, ("ring", device), lambda: _ring_steps(self, device))

    def halo_tables(self, device: torch.device) -> HaloTables:
        """The short convolution's halo index tensors on ``device`` (``conv_width``)."""
        return _kept(self._tables, ("halo", device), lambda: _halo_tables(self, device))

    @functools.cached_property
    def local_rows(self) -> torch.Tensor:
        """The global token index of each local row (int64, on the CPU)."""
        rows = [torch.arange(f.start, f.end) for f in self.fragments[self.rank]]
        return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global packed tensor ``x`` [T, ...] (differentiable)."""
        if x.shape[0] != self.cu_seqlens_global[-1]:
            raise ValueError(f"x must have the global token count {self.cu_seqlens_global[-1]} rows, got {x.shape[0]}")
        # One copy to the device per context, not per call.
        return x.index_select(0, _kept(self._tables, ("rows", x.device), lambda: self.local_rows.to(x.device)))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The global packed tensor [T, ...] from every rank's local rows ``x`` (a
        collective: every rank calls it; differentiable)."""
        if x.shape[0] != self.local_tokens:
            raise ValueError(f"x must have this rank's {self.local_tokens} local rows, got {x.shape[0]}")
        most = max(sum(f.tokens for f in frags) for frags in self.fragments)
        padded = torch.cat([x, x.new_zeros(most - x.shape[0], *x.shape[1:])]) if most > x.shape[0] else x
        every = collectives.all_gather(padded, self)  # [world * most, ...]

        def order():  # the global order of the gathered rows, made once per device
            rows = torch.empty(self.cu_seqlens_global[-1], dtype=torch.int64)
            for r, frags in enumerate(self.fragments):
                base = r * most
                for f in frags:
                    rows[f.start:f.end] = torch.arange(base, base + f.tokens)
                    base += f.tokens
            return rows.to(x.device)

        return every.index_select(0, _kept(self._tables, ("gather", x.device), order))


def kcp_comm_bytes(ctx: KcpContext, HV: int, K: int = 128, V: int = 128, *, output_final_state: bool = False,
                   conv_channels: int | None = None, exchange: str = "a2a", save_transfer: bool = True,
                   deterministic: bool = True) -> dict[str, int]:
    """Bytes this rank puts into each collective of one ``gdn_kcp`` forward+backward with
    HV value heads of dims K, V (and, with ``conv_channels`` = D, one ``short_conv_kcp``
    of D channels), by collective: the all-gathers (each rank receives W times its
    input: the forward's summaries, final states and conv tails; the backward's
    start-state gradients of the sink fragments and, without ``save_transfer``, the
    transfers again) and the backward's all-to-alls of W blocks (the gradients of the
    final states and of the conv tails, the adjoints of their gathers). With
    ``exchange="ring"`` the chain's states and their gradients go instead by neighbour
    shifts, one a step of the chain, summed here over the steps (this rank's own
    documents' hops: the one count that differs between the ranks); so do deterministic
    calls where a document spans three ranks or more (``KcpContext.has_relays``), in
    either exchange. Only the plan enters, never the sequence length. A collective the
    plan does not need is absent."""
    out = {}
    state = HV * K * V * 4
    if exchange == "ring" or (deterministic and ctx.has_relays):
        steps = ctx.ring_tables(ctx.cu_seqlens.device)
        if steps:
            out["gdn chain states, forward shifts"] = sum(s.src_frags.numel() for s in steps) * state
            out["gdn chain end-state gradients, backward shifts"] = sum(s.recv_frags.numel() for s in steps) * state
    elif ctx.source_slots:
        out["gdn summaries, forward all-gather"] = ctx.source_slots * HV * K * (V + K) * 4
        out["gdn sink start-state gradients, backward all-gather"] = ctx.sink_slots * state
        if not save_transfer:
            out["gdn transfers, backward all-gather"] = ctx.source_slots * HV * K * K * 4
    if output_final_state:
        out["gdn final states, forward all-gather"] = ctx.last_slots * state
        out["gdn final states, backward all-to-all"] = ctx.world * out["gdn final states, forward all-gather"]
    if conv_channels is not None and ctx.conv_width > 1:
        out["short conv tails, forward all-gather"] = ctx.slots * (ctx.conv_width - 1) * conv_channels * 4
        out["short conv tails, backward all-to-all"] = ctx.world * out["short conv tails, forward all-gather"]
    return out


@dataclasses.dataclass(frozen=True)
class ChainTables:
    """Index tensors (int64) of ``gdn_kcp``'s exchanges and chain.

    This rank's fragments fall into sub-batches of its rows (``SubBatch``): ``lead``, its
    *lead* sources (sources, followed by another fragment of their document, that start
    their document: their start state is known before any exchange), ``relay``, its other
    sources (preceded and followed by fragments of their document), ``rest``, every
    fragment that is not a lead source, ``sinks``, its sink fragments (preceded by
    another of their document: their start states' gradients are exchanged in the
    backward), and ``tails``, its sinks that are no source; ``lead_sources``, ``relay_sources``: the lead and relay sources' places
    among this rank's sources (ascending slots, the order of its summaries);
    ``lead_docs``: the lead sources' documents; ``steps[p]``: (the documents with a p-th source, those sources' flat slots
    rank * source_slots + j in the gathered summaries, the flat slots rank * sink_slots + j
    of the fragments after them in the gathered sink gradients); ``local_starts``: per
    local fragment, its start state's row among [the N initial states, the states the
    steps produce in step order, a zero state]; ``local_sources``: per local fragment, its
    flat source slot, or -1; ``first_fragments``, ``first_docs``: the local fragments that
    start a document, and those documents; ``last_slots``: this rank's document-last
    fragments (their final states are exchanged); ``final_rows``: per document, its final
    state's row among [every rank's gathered last-fragment final states (W *
    last_slots), the N initial states]."""

    lead: SubBatch
    relay: SubBatch
    rest: SubBatch
    sinks: SubBatch
    tails: SubBatch
    lead_sources: torch.Tensor
    relay_sources: torch.Tensor
    lead_docs: torch.Tensor
    steps: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]
    local_starts: torch.Tensor
    local_sources: torch.Tensor
    first_fragments: torch.Tensor
    first_docs: torch.Tensor
    last_slots: torch.Tensor
    final_rows: torch.Tensor


@dataclasses.dataclass(frozen=True)
class SubBatch:
    """Some of a rank's fragments (ascending slots) as a packed batch of its rows:
    ``rows`` (int64), ``cu_seqlens`` (int32), ``fragments`` (their local fragment indices,
    int64), ``span``: (start, stop) where the rows are one range of the local rows (then
    the sub-batch is a view: a rank's sources are its last fragments, its sinks its
    first, unless a document starts and ends on it between them), else None; ``count``:
    how many fragments, ``tokens``: how many rows; ``doc_flags``: per fragment whether it
    opens (1: a sink) and closes (2: a source) inside its document, the CUDA plan's
    ``doc_flags`` edges; ``doc_chunks``: per fragment its document's 64-token chunks, which
    decide the grid class ``grid_flags`` adds."""

    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    fragments: torch.Tensor
    span: tuple[int, int] | None
    count: int
    tokens: int
    doc_flags: torch.Tensor  # uint8 per fragment: OPENS_INSIDE, CLOSES_INSIDE (gdn.h)
    doc_chunks: tuple[int, ...]
    seg_cu: torch.Tensor | None = None  # relay_segments: each relay's rows among the segments (int32)
    _grid_flags: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def grid_flags(self, HV: int) -> torch.Tensor:
        """``doc_flags`` with each fragment's grid class (``HALF_GRID`` or ``FULL_GRID``)
        at ``HV`` value heads: a fragment is cut at its whole document's grid, not at the
        one its own length would choose (made once per HV)."""

        def make():
            bits = [HALF_GRID if half_grid(c, HV) else FULL_GRID for c in self.doc_chunks]
            return self.doc_flags | torch.tensor(bits, dtype=torch.uint8, device=self.doc_flags.device)

        return _kept(self._grid_flags, HV, make)

    def take(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        """The sub-batch's rows of each of ``xs`` [local rows, ...]: a view where they are
        one range, else a gather."""
        return [x[self.span[0]:self.span[1]] if self.span is not None else x.index_select(0, self.rows) for x in xs]


def _chain_tables(ctx: KcpContext, device: torch.device) -> ChainTables:
    per_doc = ctx.doc_fragments  # (rank, slot) per fragment, in token order
    source_index = {}  # (rank, slot) -> flat slot among the gathered source summaries
    sink_index = {}  # (rank, slot) -> flat slot among the gathered sink start-state gradients
    last_index = {}  # (rank, slot) -> flat slot among the gathered final states
    for r in range(ctx.world):
        lasts = [frags[-1] for frags in per_doc if frags and frags[-1][0] == r]
        source_index.update({(r, s): r * ctx.source_slots + j for j, s in enumerate(ctx.sources[r])})
        sink_index.update({(r, s): r * ctx.sink_slots + j for j, s in enumerate(ctx.sinks[r])})
        last_index.update({rs: r * ctx.last_slots + j for j, rs in enumerate(sorted(lasts))})
    N = ctx.documents
    as_index = lambda x, dtype=torch.int64: torch.tensor(x, dtype=dtype, device=device)  # noqa: E731
    steps, start_row, rows = [], {}, N
    for d, frags in enumerate(per_doc):
        if frags:
            start_row[frags[0]] = d
    for p in range(max((len(f) for f in per_doc), default=1) - 1):
        docs = [d for d in range(N) if len(per_doc[d]) > p + 1]
        for i, d in enumerate(docs):
            start_row[per_doc[d][p + 1]] = rows + i
        rows += len(docs)
        steps.append((as_index(docs), as_index([source_index[per_doc[d][p]] for d in docs]),
                      as_index([sink_index[per_doc[d][p + 1]] for d in docs])))
    frags = ctx.fragments[ctx.rank]

    def sub_batch(slots):
        return _sub_batch(ctx, device, [(s, 0, frags[s].tokens) for s in slots],
                          [(OPENS_INSIDE if s in my_sinks else 0) + (CLOSES_INSIDE if s in my_sources else 0)
                           for s in slots])

    my_sources, my_sinks = ctx.sources[ctx.rank], ctx.sinks[ctx.rank]
    firsts = [(s, d) for d, f in enumerate(per_doc) if f and f[0][0] == ctx.rank for s in [f[0][1]]]
    leads, relays = ctx.leads[ctx.rank], ctx.relays[ctx.rank]
    final_rows = [last_index[f[-1]] if f else ctx.world * ctx.last_slots + d for d, f in enumerate(per_doc)]
    return ChainTables(
        lead=sub_batch(leads), relay=sub_batch(relays),
        rest=sub_batch([s for s in range(len(frags)) if s not in leads]), sinks=sub_batch(my_sinks),
        tails=sub_batch(ctx.tails[ctx.rank]),
        lead_sources=as_index([j for j, s in enumerate(my_sources) if s in leads]),
        relay_sources=as_index([j for j, s in enumerate(my_sources) if s in relays]),
        lead_docs=as_index([frags[s].doc for s in leads]),
        steps=tuple(steps),
        local_starts=as_index([start_row.get((ctx.rank, s), rows) for s in range(len(frags))]),
        local_sources=as_index([source_index.get((ctx.rank, s), -1) for s in range(len(frags))]),
        first_fragments=as_index([s for s, _ in firsts]), first_docs=as_index([d for _, d in firsts]),
        last_slots=as_index(sorted(s for (r, s) in last_index if r == ctx.rank)), final_rows=as_index(final_rows))


@dataclasses.dataclass(frozen=True)
class RingStep:
    """One step of ``gdn_kcp``'s chain in the ring exchange, on this rank: the p-th
    source of every document that has one hands its end state to the rank holding the
    document's next fragment. ``src_frags``, ``src_slots``: this rank's p-th sources (local
    fragment indices, and indices among its own source summaries) in the order they are
    sent, by destination rank, then document; ``send_splits``: how many go to each rank;
    ``recv_frags``: the local fragments whose start states arrive, in arrival order (by
    source rank, then document); ``recv_splits``: how many come from each rank;
    ``src_pos``: the sent sources' places among the step's documents (``ChainTables.steps``
    order), ``documents``: how many documents the step has; ``relay_sends``,
    ``relay_receives``: whether one of the sent sources, or of the receiving fragments, is
    a relay of this rank. The backward runs the steps in reverse with the splits swapped."""

    src_frags: torch.Tensor
    src_slots: torch.Tensor
    src_pos: torch.Tensor
    documents: int
    send_splits: tuple[int, ...]
    recv_frags: torch.Tensor
    recv_splits: tuple[int, ...]
    relay_sends: bool = False  # a relay of this rank sends its end state at this step
    relay_receives: bool = False  # a relay of this rank receives its start state at this step


def _document_chunks(ctx: KcpContext, doc: int) -> int:
    """The 64-token chunks of global document ``doc`` (0 for a rank's empty stand-in, -1)."""
    cu = ctx.cu_seqlens_global
    return -(-(cu[doc + 1] - cu[doc]) // 64) if doc >= 0 else 0


def _sub_batch(ctx: KcpContext, device: torch.device, pieces, flags, seg_cu=None) -> SubBatch:
    """The sub-batch of this rank's rows whose documents are ``pieces``: (local fragment,
    first token within it, tokens), in row order, with ``doc_flags`` ``flags``."""
    frags = ctx.fragments[ctx.rank]
    offsets = [0]
    for f in frags:
        offsets.append(offsets[-1] + f.tokens)
    rows, cu = [], [0]
    for s, at, n in pieces:
        rows += range(offsets[s] + at, offsets[s] + at + n)
        cu.append(cu[-1] + n)
    span = (rows[0], rows[-1] + 1) if rows and rows == list(range(rows[0], rows[-1] + 1)) else None
    as_index = lambda x, dtype=torch.int64: torch.tensor(x, dtype=dtype, device=device)  # noqa: E731
    return SubBatch(as_index(rows), as_index(cu, torch.int32), as_index([s for s, _, _ in pieces]), span, len(pieces),
                    len(rows), as_index(flags, torch.uint8),
                    tuple(_document_chunks(ctx, frags[s].doc) for s, _, _ in pieces),
                    None if seg_cu is None else as_index(seg_cu, torch.int32))


def _relay_segments(ctx: KcpContext, device: torch.device, HV: int, segment_chunks: int) -> SubBatch:
    frags, pieces, seg_cu = ctx.fragments[ctx.rank], [], [0]
    for s in ctx.relays[ctx.rank]:
        f = frags[s]
        grid = 64 * (segment_chunks if segment_chunks >= 1 else
                     _DET_SEG_CHUNKS // 2 if half_grid(_document_chunks(ctx, f.doc), HV) else _DET_SEG_CHUNKS)
        pieces += [(s, at, min(grid, f.tokens - at)) for at in range(0, f.tokens, grid)]
        seg_cu.append(len(pieces))
    return _sub_batch(ctx, device, pieces, [OPENS_INSIDE | CLOSES_INSIDE] * len(pieces), seg_cu)


def _ring_steps(ctx: KcpContext, device: torch.device) -> tuple[RingStep, ...]:
    per_doc = ctx.doc_fragments
    own_slot = {s: j for j, s in enumerate(ctx.sources[ctx.rank])}
    relays = set(ctx.relays[ctx.rank])
    steps = []
    for p in range(max((len(f) for f in per_doc), default=1) - 1):
        hops = [(frags[p], frags[p + 1], d) for d, frags in enumerate(per_doc) if len(frags) > p + 1]
        place = {d: i for i, (_, _, d) in enumerate(hops)}  # the step's documents in ascending order
        send = sorted((dst[0], d, src[1]) for src, dst, d in hops if src[0] == ctx.rank)
        recv = sorted((src[0], d, dst[1]) for src, dst, d in hops if dst[0] == ctx.rank)
        as_index = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        steps.append(RingStep(
            src_frags=as_index([s for _, _, s in send]), src_slots=as_index([own_slot[s] for _, _, s in send]),
            src_pos=as_index([place[d] for _, d, _ in send]), documents=len(hops),
            send_splits=tuple(sum(1 for r, _, _ in send if r == q) for q in range(ctx.world)),
            recv_frags=as_index([s for _, _, s in recv]),
            recv_splits=tuple(sum(1 for r, _, _ in recv if r == q) for q in range(ctx.world)),
            relay_sends=any(s in relays for _, _, s in send), relay_receives=any(s in relays for _, _, s in recv)))
    return tuple(steps)


@dataclasses.dataclass(frozen=True)
class HaloTables:
    """``tails``: per local slot (``slots`` of them), the local rows of its fragment's
    last W - 1 tokens, oldest first (``local_tokens``: a zero row); ``halo``: per local
    fragment, the W - 1 inputs before it, oldest first, as rows of [every rank's tails
    (W * slots * (W - 1) rows), the initial conv states (N * (W - 1) rows, [N, W - 1, D]
    order), a zero row]; ``halo_zero``: the same without the initial conv states (their
    rows and the zero row after the tails)."""

    tails: torch.Tensor
    halo: torch.Tensor
    halo_zero: torch.Tensor


def _halo_tables(ctx: KcpContext, device: torch.device) -> HaloTables:
    W1, cu = ctx.conv_width - 1, ctx.cu_seqlens_global
    pool = ctx.world * ctx.slots * W1
    zero = pool + ctx.documents * W1
    tails, start = [], 0
    frags = ctx.fragments[ctx.rank]
    for s in range(ctx.slots):
        f = frags[s] if s < len(frags) else None
        for o in range(W1):
            row = start + (f.tokens - W1 + o if f else 0)
            tails.append(row if f is not None and row >= start else ctx.local_tokens)
        start += f.tokens if f else 0
    holder = {}  # global token -> (flat slot, its fragment's end)
    for r, fr in enumerate(ctx.fragments):
        for s, f in enumerate(fr):
            for t in range(max(f.start, f.end - W1), f.end):
                holder[t] = (r * ctx.slots + s, f.end)
    halo, halo_zero = [], []
    for f in frags:
        for j in range(W1):
            t = f.start - W1 + j
            if f.doc < 0:
                halo.append(zero)
                halo_zero.append(pool)
            elif t < cu[f.doc]:
                halo.append(pool + f.doc * W1 + W1 - (cu[f.doc] - t))
                halo_zero.append(pool)
            else:
                flat, end = holder[t]
                halo.append(flat * W1 + W1 - (end - t))
                halo_zero.append(halo[-1])
    as_index = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return HaloTables(as_index(tails), as_index(halo), as_index(halo_zero))


def build_context_kcp(
    cu_seqlens_global: torch.Tensor | Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    layout: str = "C",
    conv_width: int = 4,
    device: torch.device | str | None = None,
    graph_replay: bool = False,
    align: int = GRID_ALIGN,
) -> KcpContext:
    """Plans a packed global batch over the ranks of ``group`` (default: the world).

    ``cu_seqlens_global``: [N+1] document boundaries of the global batch, read once on
    the host here (a list, or a tensor: a CUDA tensor costs one sync, outside the hot
    path). ``layout``: "C", "Z" or "D" (module docstring). ``conv_width``: the short
    convolution's W that ``short_conv_kcp`` takes with this context. ``device``: where
    the local ``cu_seqlens`` goes (default: the current CUDA device if the group's
    backend is NCCL, else the CPU). ``graph_replay``: every ``gdn_kcp`` call with this
    context on CUDA tensors runs its forward, and its backward, as a CUDA graph replay per
    shape key (``cake_ops.graphs``: the first call of a key runs eagerly and captures;
    later ones copy their inputs in, replay and copy the outputs out; the same bits), the
    collectives inside the graph: that needs an NCCL group. Traced calls (torch.compile)
    and calls made inside the caller's own capture run their launches as they are. Every
    rank must call it with the same arguments. ``align``: cuts inside a document move to
    multiples of it from the document's start (module docstring). ``GRID_ALIGN`` (the
    default) puts them on the deterministic cut grid, which makes deterministic
    ``gdn_kcp`` calls bitwise the single-GPU op's (docs/kcp.md), for a shift of at most
    2048 tokens a boundary (a document under 4096 tokens is never cut); 1 keeps the
    layouts' exact cuts (deterministic calls are then reproducible run to run, within
    the contract of the single-GPU op, not bitwise it)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align must be an int >= 1, got {align!r}")
    if not isinstance(graph_replay, bool):
        raise ValueError(f"graph_replay must be True or False, got {graph_replay!r}")
    if not 1 <= conv_width <= 4:
        raise ValueError(f"conv_width must be in 1..4, got {conv_width}")
    cu = [int(c) for c in (cu_seqlens_global.tolist() if isinstance(cu_seqlens_global, torch.Tensor)
                           else cu_seqlens_global)]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens_global must start at 0 and never decrease, with N+1 >= 2 entries, got {cu}")
    group = group if group is not None else dist.group.WORLD
    if graph_replay and dist.get_backend(group) != "nccl":
        raise ValueError(f"graph_replay=True needs an NCCL group (its collectives run inside the CUDA graph); "
                         f"this group's backend is {dist.get_backend(group)!r}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    fragments = tuple(_fragments(cu, held) for held in _held_ranges(cu, world, layout, align))
    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
                  else torch.device("cpu"))
    local = [0]
    for f in fragments[rank]:
        local.append(local[-1] + f.tokens)
    ctx = KcpContext(group_name=group.group_name, world=world, rank=rank, layout=layout, conv_width=conv_width,
                     cu_seqlens_global=tuple(cu), fragments=fragments, slots=max(len(f) for f in fragments),
                     cu_seqlens=torch.tensor(local, dtype=torch.int32, device=device), graph_replay=graph_replay,
                     align=align)
    # Made here, so that no op call (traced, or captured in a CUDA graph) copies them in.
    ctx.chain_tables(ctx.cu_seqlens.device)
    ctx.ring_tables(ctx.cu_seqlens.device)
    ctx.halo_tables(ctx.cu_seqlens.device)
    return ctx

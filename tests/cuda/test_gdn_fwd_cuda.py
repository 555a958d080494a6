"""The CUDA GDN forward (``torch.ops.cake_cuda.gdn_fwd``, csrc/gdn/) on the GPU.

Checked against the FP64 token-by-token reference (docs/contract.md, Accuracy) under
NaN-poisoned allocation, stage by stage (the prep op's A diag(beta), gcum and chunk_decay
against the PyTorch chunked algorithm, then o and the final state), plus bitwise
determinism, CUDA-graph capture, the walk cut into segments (summaries, chain, walk;
exact and truncated cuts; the deterministic grid; the same bits on 16 and 64 SMs) and the six benchmark shapes (first and last document
against FP64). Every test is marked ``gpu`` and skipped without a Hopper GPU.
"""

import pytest
import torch

import cake_ops
from cake_ops import dispatch
from cake_ops.pytorch import gdn as pytorch_gdn
from cake_ops.reference import gdn_reference
from cake_ops.testing import accuracy, make_gdn_inputs, poisoned_allocations

from cases import GdnCase
from green_contexts import on_green_context, timed
from conftest import device_assert_output, kernel_ops, record_accuracy

pytestmark = pytest.mark.gpu

DOCS = (1, 63, 64, 65, 200)

CASES = [
    GdnCase("one_chunk", (64,)),
    GdnCase("ragged_chunk", (37,), l2norm=True, initial_state=True),
    GdnCase("docs_h1", DOCS),
    GdnCase("docs_h2_l2_h0", DOCS, H=2, l2norm=True, initial_state=True, cu_dtype=torch.int64),
    GdnCase("docs_gva2_bf16beta_h0", DOCS, H=2, G=2, beta_dtype=torch.bfloat16, initial_state=True),
    GdnCase("docs_gva3_strong_extreme_l2_h0", DOCS, G=3, gate="strong", beta="extreme", l2norm=True, initial_state=True),
    GdnCase("docs_h2_gva3_strong_bf16beta_l2", DOCS, H=2, G=3, gate="strong", beta_dtype=torch.bfloat16, l2norm=True, cu_dtype=torch.int64),
    GdnCase("docs_h2_gva2_slow_extreme_h0", DOCS, H=2, G=2, gate="slow", beta="extreme", initial_state=True),
    GdnCase("empty_docs", (0, 70, 0, 3, 0), G=2, beta="extreme", l2norm=True, initial_state=True),
    GdnCase("long_doc", (700,), l2norm=True, initial_state=True),
]


@pytest.fixture(scope="module")
def ops():
    return kernel_ops()


def _inputs(case: GdnCase, seed=0):
    return case.inputs("cuda", seed), case.l2norm


def _call(ops, inp, l2, scale=128**-0.5, deterministic=True, segment_chunks=-1, value_splits=-1):
    return ops.gdn_fwd(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"], inp["initial_state"],
        scale, l2, deterministic, segment_chunks, value_splits,
    )


def _reference(inp, l2, scale=128**-0.5):
    """The FP64 reference on the inputs' device (its token loop is launch-bound there)."""
    return gdn_reference(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"], scale=scale,
        initial_state=inp["initial_state"], use_qk_l2norm=l2,
    )


def _assert_matches_reference(o, ht, inp, l2, record_as, label):
    """o and the final state within the contract against FP64; both recorded."""
    ro, rht = _reference(inp, l2)
    failures = []
    for name, x, ref in (("o", o, ro), ("final_state", ht, rht)):
        acc = accuracy(x, ref)
        record_accuracy(f"{record_as} {name}", acc)
        if not acc.ok:
            failures.append(f"{name}: {acc}")
    assert not failures, f"{label}: " + "; ".join(failures)


def _used_slots(lengths):
    return sum(-(-n // 64) for n in lengths)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_prep_matches_chunked(ops, case):
    """Stage 1 alone: A (bf16), gcum, beta per row and chunk_decay against the PyTorch
    chunked algorithm."""
    inp, l2 = _inputs(case, seed=1)
    with poisoned_allocations():
        a, gcum, beta, decay = ops.gdn_fwd_prep(inp["q"], inp["k"], inp["g"], inp["beta"], inp["cu_seqlens"], l2)
    prep, _ = pytorch_gdn.prepare(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"], l2)
    used = _used_slots(case.lengths)
    assert a.shape == prep.A.shape and gcum.shape == prep.gcum.shape and beta.shape == prep.beta.shape
    acc_a = accuracy(a[:used].float(), prep.A[:used])
    acc_g = accuracy(gcum[:used], prep.gcum[:used])
    record_accuracy("cuda prep A", acc_a)
    record_accuracy("cuda prep gcum", acc_g)
    assert acc_a.ok, f"A: {acc_a}"
    assert acc_g.finite and acc_g.rel_rms < 1e-5, f"gcum: {acc_g}"
    # beta as given (fp32, or bf16 widened), 0 on the pad rows.
    assert torch.equal(beta[:used], prep.beta[:used].float()), "chunk_beta"
    # Unit keys (in-op or given) and beta in (0, 1): every chunk is a contraction.
    assert decay.shape == gcum.shape[:2]
    assert torch.equal(decay[:used], gcum[:used, :, -1])


def test_prep_chunk_decay_marks_non_contractions(ops):
    """chunk_decay is +inf exactly for the chunks with a token whose update I - beta k k^T
    is not a contraction (beta |k|^2 > 2), so no truncated cut is ever taken across them;
    document 1 has keys of norm 2, so most of its chunks have such a token."""
    lengths = [300, 200, 70]
    inp = make_gdn_inputs(lengths, 2, 4, 128, 128, normalized_qk=True, device="cuda", seed=40)
    k = inp["k"].clone()
    k[300:500] = (k[300:500].float() * 2).to(k.dtype)
    with poisoned_allocations():
        _, gcum, _, decay = ops.gdn_fwd_prep(inp["q"], k, inp["g"], inp["beta"], inp["cu_seqlens"], False)
    prep, _ = pytorch_gdn.prepare(inp["q"], k, inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"], False)
    used = _used_slots(lengths)
    bk = prep.beta[:used] * torch.diagonal(prep.kk[:used], dim1=-2, dim2=-1)  # [used, HV, 64]
    contraction = ((bk >= 0) & (bk <= 2)).all(-1)
    clear = ((bk - 2).abs() > 1e-3).all(-1)  # no token so near the bound that rounding decides
    assert (~contraction).any() and contraction.any()
    expect = torch.where(contraction, gcum[:used, :, -1], torch.full_like(decay[:used], float("inf")))
    assert torch.equal(decay[:used][clear], expect[clear])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gdn_fwd_accuracy(ops, case):
    inp, l2 = _inputs(case, seed=2)
    with poisoned_allocations():
        o, ht = _call(ops, inp, l2)
    T, HV = inp["v"].shape[:2]
    N = len(case.lengths)
    assert o.shape == (T, HV, 128) and o.dtype == torch.bfloat16
    assert ht.shape == (N, HV, 128, 128) and ht.dtype == torch.float32
    _assert_matches_reference(o, ht, inp, l2, "cuda gdn_fwd", case.id)


# Cut grids (in chunks) small enough that these documents are cut many times: segments
# of one chunk, ragged last segments, documents of one segment next to cut ones.
SEGMENT_CASES = [
    GdnCase("docs_h2_l2_h0", (1, 63, 64, 65, 200, 700), H=2, l2norm=True, initial_state=True),
    GdnCase("gva3_strong_extreme", (130, 0, 450), G=3, gate="strong", beta="extreme", l2norm=True, initial_state=True, cu_dtype=torch.int64),
    GdnCase("gva2_slow_bf16beta", (520, 3, 260), H=2, G=2, gate="slow", beta_dtype=torch.bfloat16),
]


@pytest.mark.parametrize("segment_chunks", [1, 2, 3])
@pytest.mark.parametrize("case", SEGMENT_CASES, ids=[c.id for c in SEGMENT_CASES])
def test_segmented_walk_accuracy(ops, case, segment_chunks):
    """The walk cut into segments (summaries E_s and M_s, the fp32 chain, the walk from
    the chained start states) against FP64, every output and workspace NaN-poisoned. The
    normal and strong gates truncate every cut (a chunk's log decay is far below -20);
    the slow gate truncates none."""
    inp, l2 = _inputs(case, seed=20 + segment_chunks)
    with poisoned_allocations():
        o, ht = _call(ops, inp, l2, segment_chunks=segment_chunks)
    _assert_matches_reference(o, ht, inp, l2, "cuda gdn_fwd segmented", f"{case.id} cut every {segment_chunks} chunks")


def test_truncated_and_exact_cuts_mixed(ops):
    """Cuts of one chunk where strong chunks (log decay ~ -640: truncated cuts, E_s from
    zero over the last chunk, no M_s) and slow ones (~ -0.06: exact cuts through M_s) alternate
    differently per value head, so the chain meets exact steps right after truncated ones;
    against FP64, NaN-poisoned."""
    lengths = [64 * 9 + 17, 64 * 3]
    inp = make_gdn_inputs(lengths, 1, 2, 128, 128, initial_state=True, device="cuda", seed=41)
    T = sum(lengths)
    chunk = torch.cat([torch.arange(n, device="cuda") // 64 for n in lengths])
    strong = torch.stack([chunk % 3 == 0, chunk % 2 == 1], dim=1)  # [T, HV]
    u = torch.rand(T, 2, device="cuda", generator=torch.Generator(device="cuda").manual_seed(42))
    inp["g"] = torch.where(strong, -20 * u - 0.5, -1e-3 * (u + 0.5)).contiguous()
    with poisoned_allocations():
        o, ht = _call(ops, inp, True, segment_chunks=1)
    _assert_matches_reference(o, ht, inp, True, "cuda gdn_fwd segmented", "truncated and exact cuts mixed")


def test_summary_walks_outnumber_the_sms(ops):
    """More summary walks than any Hopper has SMs (612: one-chunk cuts of two documents,
    six value heads, E and M), so each CTA of the persistent summary grid takes several
    from the queue in turn, re-initialising its load barriers between them; strong and
    slow chunks mixed per head (truncated and exact cuts). Split by value columns and
    not: the same bits, and against FP64, NaN-poisoned."""
    lengths = [64 * 40 + 9, 64 * 12]
    inp = make_gdn_inputs(lengths, 2, 6, 128, 128, initial_state=True, device="cuda", seed=43)
    T = sum(lengths)
    chunk = torch.cat([torch.arange(n, device="cuda") // 64 for n in lengths])
    strong = torch.stack([(chunk + h) % (h + 2) == 0 for h in range(6)], dim=1)  # [T, HV]
    u = torch.rand(T, 6, device="cuda", generator=torch.Generator(device="cuda").manual_seed(44))
    inp["g"] = torch.where(strong, -20 * u - 0.5, -1e-3 * (u + 0.5)).contiguous()
    results = []
    for value_splits in (1, 2):
        with poisoned_allocations():
            results.append(_call(ops, inp, True, segment_chunks=1, value_splits=value_splits))
    (o1, h1), (o2, h2) = results
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    _assert_matches_reference(o1, h1, inp, True, "cuda gdn_fwd segmented", "summary walks outnumber the SMs")


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=[c.id for c in SEGMENT_CASES])
def test_value_split_walk_is_bitwise_the_unsplit_walk(ops, case):
    """The walks split by value columns (two CTAs per (segment, value head), each with one
    state warpgroup for half the columns; the plan's choice for shapes with few walks)
    give the bits of the unsplit walks, uncut and cut (the summaries split too), and meet
    the contract; every output and workspace NaN-poisoned. The plan may then pick the
    split from the SM count, also for deterministic=True."""
    inp, l2 = _inputs(case, seed=50)
    for segment_chunks in (0, 2):
        results = []
        for value_splits in (1, 2):
            with poisoned_allocations():
                results.append(_call(ops, inp, l2, segment_chunks=segment_chunks, value_splits=value_splits))
        (o1, h1), (o2, h2) = results
        assert torch.equal(o1, o2) and torch.equal(h1, h2), f"cut every {segment_chunks} chunks"
        _assert_matches_reference(o2, h2, inp, l2, "cuda gdn_fwd value split", f"{case.id} cut {segment_chunks}")


def test_segmented_walk_is_bitwise_deterministic(ops):
    inp, l2 = _inputs(SEGMENT_CASES[0], seed=30)
    o1, h1 = _call(ops, inp, l2, segment_chunks=2)
    o2, h2 = _call(ops, inp, l2, segment_chunks=2)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


def test_deterministic_plan_depends_on_the_document_alone(ops):
    """deterministic=True cuts every document at a grid of its own length and HV, so a
    document's bits are the same alone and packed with others (any T, N, SM count); the non-deterministic
    plan (here cut differently) still meets the contract."""
    long_len = 64 * 64 * 2 + 100  # 130 chunks: five segments of the half grid (HV = 2)
    case = GdnCase("packed", (300, long_len, 4000), G=2, l2norm=True, initial_state=True)
    inp, l2 = _inputs(case, seed=31)
    o_packed, h_packed = _call(ops, inp, l2, deterministic=True)
    a, b = 300, 300 + long_len
    alone = {n: inp[n][a:b] for n in ("q", "k", "v", "g", "beta")}
    alone["cu_seqlens"] = torch.tensor([0, long_len], dtype=torch.int32, device="cuda")
    alone["initial_state"] = inp["initial_state"][1:2]
    o_alone, h_alone = _call(ops, alone, l2, deterministic=True)
    assert torch.equal(o_packed[a:b], o_alone) and torch.equal(h_packed[1:2], h_alone)
    ro, rht = _reference(inp, l2)
    for deterministic in (True, False):
        o, ht = _call(ops, inp, l2, deterministic=deterministic)
        assert accuracy(o, ro).ok and accuracy(ht, rht).ok, f"deterministic={deterministic}"


def test_deterministic_grid_is_finer_for_a_long_document(ops):
    """deterministic=True cuts a document of more than 128 chunks (8,192 tokens) every 32
    chunks while its 64-chunk segments times HV would fill fewer than 128 walks
    (csrc/gdn/plan.h; here HV = 2), and any other document every 64. Packed, the long
    document's bits are those of an explicit 32-chunk grid on it alone, the shorter one's
    those of a 64-chunk grid; against FP64, NaN-poisoned."""
    short_len, long_len = 64 * 128, 64 * 128 + 5  # 128 and 129 chunks: either side of the half grid's minimum
    case = GdnCase("short_and_long", (short_len, long_len), G=2, l2norm=True, initial_state=True)
    inp, l2 = _inputs(case, seed=45)
    with poisoned_allocations():
        o, ht = _call(ops, inp, l2)
    for n, (a, b), grid in ((0, (0, short_len), 64), (1, (short_len, short_len + long_len), 32)):
        alone = {name: inp[name][a:b] for name in ("q", "k", "v", "g", "beta")}
        alone["cu_seqlens"] = torch.tensor([0, b - a], dtype=torch.int32, device="cuda")
        alone["initial_state"] = inp["initial_state"][n : n + 1]
        o_grid, h_grid = _call(ops, alone, l2, segment_chunks=grid)
        same = torch.equal(o[a:b], o_grid) and torch.equal(ht[n : n + 1], h_grid)
        assert same, f"document {n}: not the {grid}-chunk grid"
    _assert_matches_reference(o, ht, inp, l2, "cuda gdn_fwd segmented", "long document on the finer deterministic grid")


def test_many_short_documents_need_little_segment_workspace(ops):
    """The segment workspaces (E_s and M_s, 128 KB per segment and value head) hold the
    inner segments only, at most (ceil(T / 64) - 1) / 32 of them whatever N: 2,048
    documents of 100 tokens at HV = 16 (deterministic plan, finest grid 32 chunks) need
    200 MB of them. With a pair per segment slot (NC / 32 + N) it was 4.6 GB. The call's
    peak allocation beyond its inputs must be the outputs plus the workspace parts."""
    lengths, H, HV = [100] * 2048, 4, 16
    inp = make_gdn_inputs(lengths, H, HV, 128, 128, device="cuda", seed=47)
    T, N = sum(lengths), len(lengths)
    NC = -(-T // 64) + N
    NI = (-(-T // 64) - 1) // 32
    outputs = T * HV * 128 * 2 + N * HV * 128 * 128 * 4
    per_slot = HV * (64 * 64 * 2 + 2 * 64 * 4 + 4) + H * 2 * 64 * 4  # A, gcum, chunk_beta, chunk_decay, qk_lrn
    allowed = NC * per_slot + NI * HV * (2 * 128 * 128 * 4 + 4) + 2**20  # + offsets, lists, queue
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with poisoned_allocations():
        o, ht = _call(ops, inp, True)
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - base - outputs
    assert used <= allowed, f"{used / 2**20:.0f} MB of workspace, at most {allowed / 2**20:.0f} MB expected"
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()


def test_segmented_cuda_graph_replay_equals_eager(ops):
    static, l2 = _inputs(SEGMENT_CASES[1], seed=32)
    fresh, _ = _inputs(SEGMENT_CASES[1], seed=33)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _call(ops, static, l2, segment_chunks=2)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, h_static = _call(ops, static, l2, segment_chunks=2)
    for n in ("q", "k", "v", "g", "beta", "initial_state"):
        static[n].copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()
    o_eager, h_eager = _call(ops, fresh, l2, segment_chunks=2)
    assert torch.equal(o_static, o_eager) and torch.equal(h_static, h_eager)


def test_empty_document_final_state_is_initial_state(ops):
    case = GdnCase("empty", (0, 5, 0), G=2, l2norm=True, initial_state=True)
    inp, l2 = _inputs(case, seed=3)
    with poisoned_allocations():
        _, ht = _call(ops, inp, l2)
    assert torch.equal(ht[0], inp["initial_state"][0]) and torch.equal(ht[2], inp["initial_state"][2])
    case = GdnCase("empty0", (0, 5, 0), G=2, l2norm=True)
    inp, l2 = _inputs(case, seed=3)
    with poisoned_allocations():
        _, ht = _call(ops, inp, l2)
    assert not ht[0].any() and not ht[2].any()


def test_no_tokens(ops):
    """T = 0: every final state is the initial state (or zeros); o is empty."""
    for h0 in (True, False):
        inp = make_gdn_inputs([0, 0], 1, 2, 128, 128, initial_state=h0, device="cuda", seed=4)
        with poisoned_allocations():
            o, ht = _call(ops, inp, True)
        assert o.shape == (0, 2, 128)
        expect = inp["initial_state"] if h0 else torch.zeros_like(ht)
        assert torch.equal(ht, expect)


def test_bitwise_deterministic(ops):
    case = GdnCase("det", DOCS, H=2, G=3, l2norm=True, initial_state=True)
    inp, l2 = _inputs(case, seed=5)
    o1, h1 = _call(ops, inp, l2)
    o2, h2 = _call(ops, inp, l2)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


def test_deterministic_bits_do_not_depend_on_the_sm_count(ops):
    """deterministic=True on the whole GPU and on green contexts of 64 and 16 SMs: bitwise
    the same o and final state. The plan reads the device's SM count (value splits, the
    persistent summary grid), and neither may change the bits; here a long document is
    cut (summaries with exact cuts under the slow gate, the chain) beside shorter ones.
    The 16-SM run must take at least twice as long, or the green context did not hold the
    kernels to its SMs and the test proved nothing."""
    case = GdnCase("sm_count", (64 * 256 + 37, 64 * 70 + 3, 4096), H=4, G=4, gate="slow", l2norm=True, initial_state=True)
    inp, l2 = _inputs(case, seed=46)
    run = lambda: _call(ops, inp, l2)  # noqa: E731
    (o_full, h_full), ms_full = timed(run, 3)
    for num_sms in (64, 16):
        (o, h), ms = on_green_context(num_sms, run, 3)
        assert torch.equal(o, o_full) and torch.equal(h, h_full), f"{num_sms} SMs: other bits than the whole GPU's"
        if num_sms == 16:
            assert ms >= 2 * ms_full, f"16 SMs took {ms:.3f} ms, the whole GPU {ms_full:.3f} ms: not held to 16 SMs?"


def test_documents_are_isolated(ops):
    """Changing one document's tokens changes no other document's outputs (no reads or
    writes across a document boundary, also for ragged chunks)."""
    case = GdnCase("iso", (65, 37, 130), G=2, l2norm=True, initial_state=True)
    inp, l2 = _inputs(case, seed=6)
    o1, h1 = _call(ops, inp, l2)
    inp2 = dict(inp)
    for n in ("q", "k", "v"):
        x = inp[n].clone()
        x[65:102] = torch.randn_like(x[65:102].float()).to(x.dtype)
        inp2[n] = x
    o2, h2 = _call(ops, inp2, l2)
    assert torch.equal(o1[:65], o2[:65]) and torch.equal(o1[102:], o2[102:])
    assert torch.equal(h1[0], h2[0]) and torch.equal(h1[2], h2[2])
    assert not torch.equal(o1[65:102], o2[65:102])


@pytest.mark.parametrize("segment_chunks", [-1, 1], ids=["plan", "cut_every_chunk"])
def test_non_finite_neighbours_do_not_leak(ops, segment_chunks):
    """The walk's loads (TMA boxes of 64 rows) read past a ragged document's end into the
    next document; those rows must count as zeros. With inf and NaN in the next document's
    q, k and v, the first document's bits equal those it gets alone; uncut and cut."""
    case = GdnCase("nan_next", (100, 64, 37), G=2, gate="slow", l2norm=True, initial_state=True)
    inp, l2 = _inputs(case, seed=7)
    for n, bad in (("q", float("inf")), ("k", float("nan")), ("v", float("-inf"))):
        x = inp[n].clone()
        x[100:] = bad
        inp[n] = x
    o, ht = _call(ops, inp, l2, segment_chunks=segment_chunks)
    alone = {n: inp[n][:100] for n in ("q", "k", "v", "g", "beta")}
    alone["cu_seqlens"] = torch.tensor([0, 100], dtype=torch.int32, device="cuda")
    alone["initial_state"] = inp["initial_state"][:1]
    o_alone, h_alone = _call(ops, alone, l2, segment_chunks=segment_chunks)
    assert torch.isfinite(o_alone).all() and torch.isfinite(h_alone).all()
    assert torch.equal(o[:100], o_alone) and torch.equal(ht[:1], h_alone)


def test_cuda_graph_replay_equals_eager(ops):
    case = GdnCase("graph", DOCS, H=2, G=2, l2norm=True, initial_state=True)
    static, l2 = _inputs(case, seed=7)
    fresh, _ = _inputs(case, seed=8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _call(ops, static, l2)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, h_static = _call(ops, static, l2)
    for n in ("q", "k", "v", "g", "beta", "initial_state"):
        static[n].copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()
    o_eager, h_eager = _call(ops, fresh, l2)
    assert torch.equal(o_static, o_eager) and torch.equal(h_static, h_eager)


@pytest.mark.parametrize(
    "cu", [[1, 50, 130], [0, 90, 50, 130], [0, 50, 129]], ids=["not_from_0", "decreasing", "not_to_T"]
)
def test_bad_cu_seqlens_values_stop_the_kernels(ops, cu):
    """The kernels' plan stage checks cu_seqlens's values on the device (no torch check
    kernels, no host sync): a bad array fails the call with an assert naming it. The CUDA
    context is unusable afterwards, so each case runs in its own process."""
    out = device_assert_output(
        f"inp = make_gdn_inputs([50, 80], 1, 2, 128, 128, device='cuda', seed=0)\n"
        f"cu = torch.tensor({cu}, dtype=torch.int32, device='cuda')",
        "cake_ops.gdn(inp['q'], inp['k'], inp['v'], inp['g'], inp['beta'], cu)")
    assert "cu_seqlens must start at 0, be non-decreasing and end at T = 130" in out, out


def test_other_head_dims_fall_back_to_pytorch(ops):
    """cake::gdn_fwd sends what the kernels do not cover (K = V = 64 here) to the PyTorch
    path instead of the kernel, and stays within the contract."""
    inp = make_gdn_inputs([10, 70], 1, 2, 64, 64, device="cuda", seed=9)
    o, ht = cake_ops.gdn(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"],
                         output_final_state=True, use_qk_l2norm=True)
    ro, rht = gdn_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"],
                            use_qk_l2norm=True)
    assert accuracy(o, ro).ok and accuracy(ht, rht).ok


def test_non_positive_scale_falls_back_to_pytorch(ops):
    """The kernels fold log2(scale) into the gate exponents; cake::gdn_fwd sends scale <= 0
    to the PyTorch path, which stays within the contract."""
    inp = make_gdn_inputs([70, 10], 1, 2, 128, 128, device="cuda", seed=10)
    for scale in (-0.05, 0.0):
        o, ht = cake_ops.gdn(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"],
                             scale=scale, output_final_state=True, use_qk_l2norm=True)
        ro, rht = gdn_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"],
                                scale=scale, use_qk_l2norm=True)
        assert accuracy(ht, rht).ok, f"scale={scale}"
        if scale != 0.0:
            assert accuracy(o, ro).ok, f"scale={scale}"
        else:
            assert not o.any()


REFUSALS = ["fp16_qkv", "head_dim_64", "v_dim_64", "scale_zero", "scale_negative"]


def _refusal(name):
    """A call that cake_ops.dispatch sends away from the CUDA forward, one per condition
    of its rule: (inputs, scale)."""
    base = make_gdn_inputs([70, 10], 1, 2, 128, 128, device="cuda", seed=12)
    if name == "fp16_qkv":
        return {n: (t.half() if n in ("q", "k", "v") else t) for n, t in base.items()}, 0.1
    if name == "head_dim_64":
        return make_gdn_inputs([70, 10], 1, 2, 64, 64, device="cuda", seed=12), 0.125
    if name == "v_dim_64":
        return dict(base, v=torch.randn(80, 2, 64, device="cuda").bfloat16()), 0.1
    return base, {"scale_zero": 0.0, "scale_negative": -0.1}[name]


@pytest.mark.parametrize("name", REFUSALS)
def test_dispatch_rule_and_binding_agree(ops, name):
    """Every call the Python rule refuses, the binding refuses too (RuntimeError naming
    what is wrong), so the two cannot drift apart; the op itself then runs PyTorch."""
    inp, scale = _refusal(name)
    args = [inp[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")]
    why = dispatch.gdn_fwd_cuda_refusal(*args, scale)
    assert why is not None and "pytorch_implementation" not in why, why
    with pytest.raises(RuntimeError, match="gdn_fwd: "):
        ops.gdn_fwd(*args, None, scale, False, True, -1, -1)
    o, _ = torch.ops.cake.gdn_fwd(*args, None, scale, False, True)  # falls back, no error
    assert o.shape == inp["v"].shape
    good = make_gdn_inputs([70, 10], 1, 2, 128, 128, device="cuda", seed=12)
    assert dispatch.gdn_fwd_cuda_refusal(*(good[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")), 0.1) is None


def test_full_reset_gate_on_the_kernels(ops):
    """g = -inf (e^g = 0) resets the state on the CUDA forward too (the prep clamps g to
    the floor, csrc/gdn/gdn.h kGdnGateFloor): o and the final state are the FP64
    recurrence's, also with the walk cut at every chunk (summaries and chain see it)."""
    case = GdnCase("resets", (70, 300, 5), G=2, l2norm=True, initial_state=True)
    inp, l2 = _inputs(case, seed=13)
    g = inp["g"].clone()
    g[[0, 30, 70 + 63, 70 + 64, 70 + 200, 70 + 201, 370]] = float("-inf")
    inp["g"] = g
    for segment_chunks in (-1, 1):
        with poisoned_allocations():
            o, ht = _call(ops, inp, l2, segment_chunks=segment_chunks)
        _assert_matches_reference(o, ht, inp, l2, "cuda gdn_fwd (g = -inf)", f"cut {segment_chunks}")


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nd"])
@pytest.mark.parametrize("name", ["s32k_h16", "s64k_h16", "s16k_long", "s256k_h2", "s16k_h8", "s32k_h2"])
def test_bench_shapes_against_fp64(ops, name, deterministic):
    """The six benchmark shapes (docs/benchmark.md, Shapes) with the benchmark's own inputs (mamba gate, in-op L2 norm)
    plus an initial state, whole shape through the kernels (each variant's own plan) under
    NaN poisoning; the first and the last document checked against the FP64 reference
    (run on the GPU)."""
    from cake_ops.bench import SHAPES, make_inputs

    shape = SHAPES[name]
    dev = torch.device("cuda")
    inp = make_inputs(shape, dev, "mamba", seed=11)
    N = len(shape.docs)
    h0 = torch.randn(N, shape.HV, 128, 128, device=dev, generator=torch.Generator(device=dev).manual_seed(12)) * 0.1
    scale = 128**-0.5
    with poisoned_allocations():
        o, ht = ops.gdn_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_seqlens, h0, scale, True, deterministic)
    torch.cuda.synchronize()
    assert torch.isfinite(o.float()).all() and torch.isfinite(ht).all(), "an element was left unwritten"
    bounds = shape.cu_seqlens
    for n in sorted({0, N - 1}):
        a, b = bounds[n], bounds[n + 1]
        ro, rht = gdn_reference(inp.q[a:b], inp.k[a:b], inp.v[a:b], inp.g[a:b], inp.beta[a:b], scale=scale,
                                initial_state=h0[n : n + 1], use_qk_l2norm=True)
        for tname, x, ref in (("o", o[a:b], ro), ("final_state", ht[n : n + 1], rht)):
            acc = accuracy(x, ref)
            record_accuracy(f"cuda gdn_fwd bench {tname}", acc)
            assert acc.ok, f"{name} deterministic={deterministic} document {n} {tname}: {acc}"

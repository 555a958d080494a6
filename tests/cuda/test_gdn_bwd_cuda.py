"""The CUDA GDN backward end to end (``torch.ops.cake_cuda.gdn_bwd`` and ``cake::gdn_bwd``
on Hopper: the tape walk, the reverse walk and the chunk-local gradients of csrc/gdn/).

Every gradient against FP64 autograd of the token-by-token reference (docs/contract.md,
Accuracy) under NaN-poisoned allocation, over the contract's cases; bitwise repeats, a
document's bits alone = packed, the same bits on 16 and 64 SMs, the forward's cut grid
and value split, the whole training step of a GDN layer in one CUDA graph and under
torch.compile(fullgraph=True). Every test is marked ``gpu``.
"""

import random
import pytest
import torch

import cake_ops
from cake_ops import dispatch
from cake_ops.reference import gdn_reference
from cake_ops.testing import accuracy, poisoned_allocations

from cases import GdnCase, params
from conftest import device_assert_output, kernel_ops, record_accuracy
from green_contexts import on_green_context, slowdown_on

pytestmark = pytest.mark.gpu

EDGES = (0, 1, 63, 64, 65)
_rng = random.Random(7)
CASES = [
    GdnCase("edges_l2_h0", EDGES + (130,), H=2, l2norm=True, initial_state=True),
    GdnCase("edges_unit_keys", EDGES + (200,), H=2),
    GdnCase("pack_gva2_bf16beta_l2", tuple(_rng.randint(1, 300) for _ in range(6)), H=2, G=2,
            beta_dtype=torch.bfloat16, l2norm=True),
    GdnCase("gva3_strong_extreme_l2_h0", (65, 1, 300), G=3, gate="strong", beta="extreme", l2norm=True,
            initial_state=True),
    GdnCase("gva3_slow_extreme_h0", (64, 130, 7), H=2, G=3, gate="slow", beta="extreme", initial_state=True),
    GdnCase("long_doc_cut_l2_h0", (64 * 70 + 5,), G=2, gate="slow", l2norm=True, initial_state=True,
            cu_dtype=torch.int64),
    GdnCase("empty_docs_l2", (0, 70, 0, 3, 0), G=2, beta="extreme", l2norm=True, initial_state=True),
]
LEAVES = ("q", "k", "v", "g", "beta", "initial_state")
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.fixture(scope="module")
def ops():
    return kernel_ops()


def _grad_inputs(inp, seed):
    gen = torch.Generator().manual_seed(seed)
    T, HV, V = inp["v"].shape
    N = inp["cu_seqlens"].shape[0] - 1
    do = torch.randn(T, HV, V, generator=gen).to("cuda", torch.bfloat16)
    dht = torch.randn(N, HV, V, V, generator=gen).cuda()
    return do, dht


def _bwd(ops, inp, l2, do, dht, deterministic=True, segment_chunks=-1, value_splits=-1, head_slices=-1):
    return ops.gdn_bwd(do, dht, inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"],
                       inp["initial_state"], 128**-0.5, l2, deterministic, segment_chunks, value_splits,
                       head_slices, None)


def _reference_grads(inp, l2, do, dht):
    """The FP64 reference's gradients, computed on the inputs' device (the token loop's
    small ops are launch-bound there, where the CPU took tens of seconds for a long
    document)."""
    ref = {n: inp[n].detach().double().requires_grad_() for n in LEAVES if inp[n] is not None}
    o, ht = gdn_reference(*(ref[n] for n in LEAVES[:5]), inp["cu_seqlens"],
                          initial_state=ref.get("initial_state"), use_qk_l2norm=l2)
    torch.autograd.backward([o, ht], [do.double(), dht.double()])
    return {d: ref[n].grad for d, n in zip(GRADS, LEAVES) if n in ref}


def _assert_within_contract(grads, ref, record_as=None):
    """Every gradient (dq, dk, dv, dg, dbeta, dh0) within the accuracy contract against
    the FP64 reference; recorded for the run's worst-case table under record_as."""
    for name, x in zip(GRADS, grads):
        acc = accuracy(x, ref[name])
        if record_as is not None:
            record_accuracy(f"cuda gdn_bwd {name} ({record_as})", acc)
        assert acc.ok, f"{name}: {acc}"


@pytest.mark.parametrize("case", params(CASES))
def test_every_gradient_matches_fp64(ops, case):
    inp = case.inputs("cuda")
    do, dht = _grad_inputs(inp, case.seed)
    with poisoned_allocations():
        grads = _bwd(ops, inp, case.l2norm, do, dht)
    ref = _reference_grads(inp, case.l2norm, do, dht)
    failures = []
    for name, x in zip(GRADS, grads):
        if name == "dbeta":
            assert x.dtype == case.beta_dtype
        if name not in ref:  # no initial state: dh0 is still written (the op drops it)
            assert torch.isfinite(x).all()
            continue
        acc = accuracy(x, ref[name])
        record_accuracy(f"cuda gdn_bwd {name}", acc)
        if not acc.ok:
            failures.append(f"{name}: {acc}")
    assert not failures, f"{case.id}: " + "; ".join(failures)


def test_without_final_state_gradient(ops):
    case = CASES[0]
    inp = case.inputs("cuda")
    do, _ = _grad_inputs(inp, 3)
    with poisoned_allocations():
        grads = _bwd(ops, inp, case.l2norm, do, None)
    ref = _reference_grads(inp, case.l2norm, do, torch.zeros(inp["initial_state"].shape, device="cuda"))
    _assert_within_contract(grads, ref)


def test_bitwise_repeats_and_every_plan_alike(ops):
    """Repeats are bitwise equal; so are the forward's value splits, and the cut grid
    forced to every 2 chunks gives the contract's accuracy (its tapes are the forward's)."""
    case = CASES[5]
    inp = case.inputs("cuda")
    do, dht = _grad_inputs(inp, 4)
    first = _bwd(ops, inp, case.l2norm, do, dht)
    for again in (_bwd(ops, inp, case.l2norm, do, dht), _bwd(ops, inp, case.l2norm, do, dht, value_splits=1),
                  _bwd(ops, inp, case.l2norm, do, dht, value_splits=2)):
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    cut = _bwd(ops, inp, case.l2norm, do, dht, segment_chunks=2)
    ref = _reference_grads(inp, case.l2norm, do, dht)
    _assert_within_contract(cut, ref)


def test_repeats_at_a_benchmark_shape_back_to_back(ops):
    """At the s16k_h8 benchmark shape (2080 CTAs in the local stage), six backward calls queued back to
    back, without a sync: every stage's CTAs start on shared memory that other stages'
    CTAs left. Bitwise equal, finite. (A load barrier waited on before its initialisation
    faulted in the benchmark's timing loop of forward+backward calls, while the stage tests
    passed.)"""
    case = GdnCase("s16k_h8_like", (4096,) * 4, H=8, G=2, l2norm=True, initial_state=True)
    inp = case.inputs("cuda")
    do, dht = _grad_inputs(inp, 5)
    runs = [_bwd(ops, inp, case.l2norm, do, dht) for _ in range(6)]
    torch.cuda.synchronize()
    assert all(torch.isfinite(x.float()).all() for x in runs[0])
    for again in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], again))


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "nondeterministic"])
def test_full_save_mode_gives_the_same_bits(ops, deterministic):
    """The full save mode: gdn_fwd_full's o and final state are bitwise gdn_fwd's, its
    tapes are gdn_tapes_bytes long, and the backward reading them (NaN-poisoned) gives
    bitwise the gradients of the backward that recomputes them; a wrong tapes tensor is
    refused before any kernel runs."""
    from cake_ops.ops.gdn import gdn_tapes_bytes

    case = GdnCase("full_mode", (64 * 70 + 5, 1, 300, 0, 64), H=2, G=3, gate="slow", beta="extreme", l2norm=True,
                   initial_state=True)
    inp = case.inputs("cuda")
    do, dht = _grad_inputs(inp, 14)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"], inp["initial_state"],
            128**-0.5, True, deterministic)
    with poisoned_allocations():
        o, ht, tapes = ops.gdn_fwd_full(*args)
        o_light, ht_light = ops.gdn_fwd(*args)
        light = _bwd(ops, inp, True, do, dht, deterministic)
        full = ops.gdn_bwd(do, dht, *args, -1, -1, -1, tapes)
    assert torch.equal(o, o_light) and torch.equal(ht, ht_light)
    T, H, HV, N = inp["q"].shape[0], case.H, case.HV, len(case.lengths)
    assert tapes.dtype == torch.uint8 and tapes.numel() == gdn_tapes_bytes(T, N, H, HV, True)
    for name, a, b in zip(GRADS, light, full):
        assert torch.equal(a, b), f"full save mode: {name} has other bits"
    with pytest.raises(RuntimeError, match="tapes must be"):
        ops.gdn_bwd(do, dht, *args, -1, -1, -1, tapes[:-256])


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "nondeterministic"])
def test_head_slices_give_the_same_bits(ops, deterministic):
    """The backward run one head slice at a time (1, 2 or 4 slices of 4 q/k heads, each
    with its 2 value heads; NaN-poisoned) gives bitwise the gradients of the unsliced
    run, and the plan's own choice too; cut documents and GVA, within the contract."""
    case = GdnCase("slices", (64 * 70 + 5, 1, 300, 0, 64), H=4, G=2, gate="slow", beta="extreme", l2norm=True,
                   initial_state=True, beta_dtype=torch.bfloat16)
    inp = case.inputs("cuda")
    do, dht = _grad_inputs(inp, 13)
    with poisoned_allocations():
        whole = _bwd(ops, inp, True, do, dht, deterministic, head_slices=1)
        for slices in (2, 4, -1):
            got = _bwd(ops, inp, True, do, dht, deterministic, head_slices=slices)
            for name, a, b in zip(GRADS, whole, got):
                assert torch.equal(a, b), f"{slices} head slices: {name} has other bits"
    _assert_within_contract(whole, _reference_grads(inp, True, do, dht), "head slices")
    with pytest.raises(RuntimeError, match="head_slices"):
        _bwd(ops, inp, True, do, dht, deterministic, head_slices=3)


@pytest.mark.parametrize("gate", ["normal", "window4"], ids=["truncated_cuts", "truncated_and_exact_cuts"])
def test_cut_reverse_walk_matches_fp64(ops, gate):
    """The reverse walk cut at a forced grid of 8 chunks (bwd_walk.h): with the normal gate
    every cut truncates (one-chunk windows); with a constant log decay of -0.08 a token
    a window takes 4 chunks, so a document's last, shorter segment cuts exactly. Every
    gradient within the contract, under NaN poisoning, bitwise repeatable."""
    case = GdnCase(f"cut_{gate}", (64 * 40 + 5, 64 * 19, 70), H=2, G=2, l2norm=True, initial_state=True)
    inp = case.inputs("cuda")
    if gate == "window4":
        inp["g"] = torch.full_like(inp["g"], -0.08)
    do, dht = _grad_inputs(inp, 12)
    with poisoned_allocations():
        grads = _bwd(ops, inp, True, do, dht, segment_chunks=8)
    again = _bwd(ops, inp, True, do, dht, segment_chunks=8)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    _assert_within_contract(grads, _reference_grads(inp, True, do, dht), "cut reverse walk")


@pytest.mark.parametrize("gate", ["normal", "window4"], ids=["truncated_cuts", "truncated_and_exact_cuts"])
@pytest.mark.parametrize("segment_chunks, value_splits", [(-1, -1), (8, 1), (8, 2), (2, 1)])
@pytest.mark.parametrize("deterministic", [True, False])
def test_end_states_alone_are_the_full_calls_bits(ops, gate, segment_chunks, value_splits, deterministic):
    """gdn_fwd_final_state (the documents' last segments walked alone) is bitwise
    gdn_fwd's final state, and gdn_bwd_initial_state (their first segments walked back
    alone) bitwise gdn_bwd's dh0, on cut grids: the plan's own (a 17,000-token document
    is cut on every device) and forced ones with truncated and exact cuts, empty and
    one-token documents among them; outputs NaN-poisoned."""
    case = GdnCase(f"ends_{gate}", (17000, 64 * 19, 70, 0, 1), H=2, G=2, l2norm=True, initial_state=True)
    inp = case.inputs("cuda")
    if gate == "window4":
        inp["g"] = torch.full_like(inp["g"], -0.08)
    do, dht = _grad_inputs(inp, 31)
    q, k, v, g, beta, cu, h0 = (inp[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state"))
    plan = (128**-0.5, True, deterministic, segment_chunks, value_splits)
    with poisoned_allocations():
        final = ops.gdn_fwd_final_state(q, k, v, g, beta, cu, h0, *plan)
        dh0 = ops.gdn_bwd_initial_state(do, dht, q, k, g, beta, cu, *plan)
    assert torch.equal(final, ops.gdn_fwd(q, k, v, g, beta, cu, h0, *plan)[1])
    assert torch.equal(dh0, ops.gdn_bwd(do, dht, q, k, v, g, beta, cu, h0, *plan, -1, None)[5])


@pytest.mark.parametrize("gate", ["normal", "window4", "slow"], ids=["truncated", "truncated_and_exact", "exact"])
@pytest.mark.parametrize("segment_chunks, deterministic, split_chunks, value_splits",
                         [(-1, True, 64, -1), (-1, True, 128, -1), (8, True, 24, 1), (8, False, 8, 2), (2, True, 2, -1)])
@pytest.mark.parametrize("G", [1, 3])
def test_doc_flags_pieces_are_the_whole_calls_bits(ops, gate, segment_chunks, deterministic, split_chunks,
                                                   value_splits, G):
    """doc_flags (csrc/gdn/gdn.h): a document cut on its grid into a piece that closes
    inside it (the left call) and one that opens inside it (the right call, from the
    left's final state) gives bitwise the whole call's outputs and final states, and, the
    right call walked back first and the left from its dh0, bitwise the whole backward's
    gradients, light and full save modes; other documents packed beside each piece; grids
    of the deterministic plan and forced ones, truncated and exact cuts, GVA; NaN-poisoned
    allocations."""
    lengths = (700, 13288, 300)  # the middle document (208 chunks) is cut at split_chunks
    case = GdnCase(f"flags_{gate}", lengths, H=2, G=G, gate="slow" if gate == "slow" else "normal", l2norm=True,
                   initial_state=True)
    inp = case.inputs("cuda")
    if gate == "window4":
        inp["g"] = torch.full_like(inp["g"], -0.08)
    own = lambda n: _grid_class(n, 2 * G, segment_chunks)  # noqa: E731
    _pieces_are_the_whole_call(ops, inp, lengths, 64 * split_chunks, (128**-0.5, True, deterministic, segment_chunks,
                                                                       value_splits),
                               (own(lengths[0]), 2 | own(lengths[1])), (1 | own(lengths[1]), own(lengths[2])))


def _grid_class(tokens, HV, segment_chunks):
    """The doc_flags grid-class bit that gives a piece of a document of ``tokens`` tokens
    its document's grid under the deterministic plan (segment_chunks -1; at these HV it
    halves the grid of a document of more than 128 chunks, csrc/gdn/plan.h), or 0 under a
    forced grid, which has one class."""
    from cake_ops.kcp.context import FULL_GRID, HALF_GRID, half_grid

    if segment_chunks != -1:
        return 0
    return HALF_GRID if half_grid(-(-tokens // 64), HV) else FULL_GRID


def _pieces_are_the_whole_call(ops, inp, lengths, cut, plan, flags_left, flags_right):
    """The middle of three documents cut `cut` tokens from its start: the left call (the
    first document and the left piece, doc_flags ``flags_left``) and the right call (the
    right piece from the left's final state and the third document, ``flags_right``)
    give the whole call's outputs and final states bitwise, and, the right call walked
    back first and the left from its dh0, the whole backward's gradients, light and full
    save modes, on NaN-poisoned allocations."""
    do, dht = _grad_inputs(inp, 41)
    q, k, v, g, beta, h0 = (inp[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    at = lengths[0] + cut  # the cut, a token row
    T = sum(lengths)

    def cu(*n):
        return torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def flags(f):
        return torch.tensor(f, dtype=torch.uint8, device="cuda")

    left, right = slice(0, at), slice(at, T)
    cu_l, cu_r = cu(lengths[0], at - lengths[0]), cu(lengths[1] - (at - lengths[0]), lengths[2])
    fl_l, fl_r = flags(flags_left), flags(flags_right)
    xs = lambda rows: tuple(x[rows] for x in (q, k, v, g, beta))  # noqa: E731
    whole_o, whole_final = ops.gdn_fwd(q, k, v, g, beta, inp["cu_seqlens"], h0, *plan)
    whole = ops.gdn_bwd(do, dht, q, k, v, g, beta, inp["cu_seqlens"], h0, *plan, -1, None)
    for full in (False, True):
        with poisoned_allocations():
            fwd = ops.gdn_fwd_full if full else ops.gdn_fwd
            out_l = fwd(*xs(left), cu_l, h0[:2].contiguous(), *plan, fl_l)
            h0_r = torch.stack([out_l[1][1], h0[2]])
            out_r = fwd(*xs(right), cu_r, h0_r, *plan, fl_r)
            tapes = (out_l[2], out_r[2]) if full else (None, None)
            grads_r = ops.gdn_bwd(do[right], dht[1:].contiguous(), *xs(right), cu_r, h0_r, *plan, -1, tapes[1], fl_r)
            dht_l = torch.stack([dht[0], grads_r[5][0]])
            grads_l = ops.gdn_bwd(do[left], dht_l, *xs(left), cu_l, h0[:2].contiguous(), *plan, -1, tapes[0], fl_l)
        where = f"full={full}"
        assert torch.equal(torch.cat([out_l[0], out_r[0]]), whole_o), where
        assert torch.equal(torch.stack([out_l[1][0], out_r[1][0], out_r[1][1]]), whole_final), where
        for i, name in enumerate(GRADS[:5]):
            assert torch.equal(torch.cat([grads_l[i], grads_r[i]]), whole[i]), (name, where)
        assert torch.equal(torch.stack([grads_l[5][0], grads_l[5][1], grads_r[5][1]]), whole[5]), ("dh0", where)


# (middle document's tokens, the cut, G): at H = 2 the deterministic plan halves the grid
# of a document of 129 .. long_max chunks (long_max 4032 chunks at HV = 2, 1344 at HV = 6).
# A piece of at most 128 chunks of a half-grid document, and pieces in that range of a longer
# one, fall in the other class by their own lengths: the grid bits give them their
# document's (csrc/gdn/chunks.cuh doc_cut_chunks).
@pytest.mark.parametrize("middle, cut, G", [(20480, 4096, 1), (20480, 16384, 1), (89600, 20480, 3)],
                         ids=["half_left_short", "half_right_short", "full_pieces_in_half_range"])
def test_doc_flags_grid_class_pieces_are_the_whole_calls_bits(ops, middle, cut, G):
    from cake_ops.kcp.context import FULL_GRID, HALF_GRID, half_grid

    HV = 2 * G
    klass = HALF_GRID if half_grid(middle // 64, HV) else FULL_GRID
    assert half_grid(middle // 64, HV) != half_grid(min(cut, middle - cut) // 64, HV)  # a piece in the other class
    lengths = (300, middle, 500)
    inp = GdnCase(f"flags_class_{middle}", lengths, H=2, G=G, l2norm=True, initial_state=True).inputs("cuda")
    own = lambda n: HALF_GRID if half_grid(-(-n // 64), HV) else FULL_GRID  # noqa: E731
    _pieces_are_the_whole_call(ops, inp, lengths, cut, (128**-0.5, True, True, -1, -1),
                               (own(lengths[0]), 2 | klass), (1 | klass, own(lengths[2])))


@pytest.mark.parametrize("segment_chunks, a, b, gate", [(-1, 4096, 12288, "normal"), (8, 1024, 6144, "normal"),
                                                     (8, 1024, 6144, "window4")])
@pytest.mark.parametrize("G", [1, 3])
def test_relay_pieces_from_segment_summaries_are_the_whole_calls_bits(ops, segment_chunks, a, b, gate, G):
    """A document cut on its grid into three pieces, the middle one (a relay, opening and
    closing inside it) chained from its segments' summaries alone: E_s and M_s as final
    states of its segments taken as documents (doc_flags 3; from zero, and from the
    identity with v = 0), S_end by cake::gdn_state_chain from the left piece's final
    state; in the backward F_s and B_s as the segments' dh0 (do with no dht, and dht = I
    with do = 0), dS_start by cake::gdn_state_grad_chain from the right piece's dh0. The
    chains give the relay call's own final state and dh0 bitwise, and the three pieces'
    calls give the whole call's outputs, final states and gradients bitwise (deterministic
    KCP's relays, docs/kcp.md); forced grids with exact and truncated cuts; NaN-poisoned."""
    lengths = (300, 13288, 500)
    case = GdnCase(f"relay_{gate}", lengths, H=2, G=G, l2norm=True, initial_state=True)
    inp = case.inputs("cuda")
    if gate == "window4":
        inp["g"] = torch.full_like(inp["g"], -0.08)  # windows of 4 chunks: truncated cuts
    do, dht = _grad_inputs(inp, 43)
    q, k, v, g, beta, h0 = (inp[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    plan = (128**-0.5, True, True, segment_chunks, -1)
    HV, D, T = v.shape[1], 128, sum(lengths)
    from cake_ops.kcp.context import HALF_GRID

    own = lambda n: _grid_class(n, HV, segment_chunks)  # noqa: E731
    klass = own(lengths[1])  # the plan's 208-chunk document takes the half grid (32 chunks)
    grid = 64 * (segment_chunks if segment_chunks != -1 else 32 if klass == HALF_GRID else 64)  # in tokens
    A, Bt = lengths[0] + a, lengths[0] + b  # the cuts, token rows

    def cu(*n):
        return torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def flags(*f):
        return torch.tensor(f, dtype=torch.uint8, device="cuda")

    left, mid, right = slice(0, A), slice(A, Bt), slice(Bt, T)
    xs = lambda rows: tuple(x[rows] for x in (q, k, v, g, beta))  # noqa: E731
    R = (b - a) // grid
    cu_seg, fl_seg, seg_cu = cu(*[grid] * R), flags(*[3 | klass] * R), torch.tensor([0, R], dtype=torch.int32, device="cuda")
    eye = torch.eye(D, device="cuda").expand(R, HV, D, D).contiguous()
    whole_o, whole_final = ops.gdn_fwd(q, k, v, g, beta, inp["cu_seqlens"], h0, *plan)
    whole = ops.gdn_bwd(do, dht, q, k, v, g, beta, inp["cu_seqlens"], h0, *plan, -1, None)
    with poisoned_allocations():
        out_l = ops.gdn_fwd(*xs(left), cu(lengths[0], a), h0[:2].contiguous(), *plan, flags(own(lengths[0]), 2 | klass))
        S_a = out_l[1][1:2].contiguous()
        qm, km, vm, gm, bm = xs(mid)
        E = ops.gdn_fwd_final_state(qm, km, vm, gm, bm, cu_seg, None, *plan, fl_seg)
        M = ops.gdn_fwd_final_state(qm, km, torch.zeros_like(vm), gm, bm, cu_seg, eye, *plan, fl_seg)
        S_b = ops.gdn_state_chain(E, M, S_a, seg_cu)
        out_m = ops.gdn_fwd(qm, km, vm, gm, bm, cu(b - a), S_a, *plan, flags(3 | klass))
        h0_r = torch.cat([S_b, h0[2:]])
        out_r = ops.gdn_fwd(*xs(right), cu(lengths[1] - b, lengths[2]), h0_r, *plan, flags(1 | klass, own(lengths[2])))
        grads_r = ops.gdn_bwd(do[right], dht[1:].contiguous(), *xs(right), cu(lengths[1] - b, lengths[2]), h0_r,
                              *plan, -1, None, flags(1 | klass, own(lengths[2])))
        dS_b = grads_r[5][0:1].contiguous()
        F = ops.gdn_bwd_initial_state(do[mid], None, qm, km, gm, bm, cu_seg, *plan, fl_seg)
        B = ops.gdn_bwd_initial_state(torch.zeros_like(do[mid]), eye, qm, km, gm, bm, cu_seg, *plan, fl_seg)
        dS_a = ops.gdn_state_grad_chain(F, B, dS_b, seg_cu)
        E1, M1 = ops.gdn_segment_summaries(qm, km, vm, gm, bm, cu_seg, *plan, fl_seg)
        F1, B1 = ops.gdn_segment_grad_summaries(do[mid], qm, km, gm, bm, cu_seg, *plan, fl_seg)
        grads_m = ops.gdn_bwd(do[mid], dS_b, qm, km, vm, gm, bm, cu(b - a), S_a, *plan, -1, None, flags(3 | klass))
        dht_l = torch.cat([dht[0:1], dS_a])
        grads_l = ops.gdn_bwd(do[left], dht_l, *xs(left), cu(lengths[0], a), h0[:2].contiguous(), *plan, -1, None,
                              flags(own(lengths[0]), 2 | klass))
    for name, one, two in (("E", E1, E), ("M", M1, M), ("F", F1, F), ("B", B1, B)):
        assert torch.equal(one, two), f"the one-call summary {name} is not the two calls' value"
    assert torch.equal(S_b, out_m[1]), "the chain of the summaries is not the relay call's chained end"
    assert torch.equal(dS_a, grads_m[5]), "the gradient chain is not the relay call's dh0"
    assert torch.equal(torch.cat([out_l[0], out_m[0], out_r[0]]), whole_o)
    assert torch.equal(torch.stack([out_l[1][0], out_r[1][0], out_r[1][1]]), whole_final)
    for i, name in enumerate(GRADS[:5]):
        assert torch.equal(torch.cat([grads_l[i], grads_m[i], grads_r[i]]), whole[i]), name
    assert torch.equal(torch.stack([grads_l[5][0], grads_l[5][1], grads_r[5][1]]), whole[5]), "dh0"


def test_segment_summaries_of_empty_and_short_pieces(ops):
    """gdn_segment_summaries and gdn_segment_grad_summaries on pieces of 0, 1, 64, 65 and
    4096 tokens (doc_flags 3, NaN-poisoned, GVA 3) give the values of the two
    gdn_fwd_final_state and the two gdn_bwd_initial_state calls they replace; an empty
    piece's summaries are E = F = 0 and M = B = I."""
    inp = GdnCase("pieces", (0, 1, 64, 65, 4096, 0), H=2, G=3, l2norm=True).inputs("cuda")
    q, k, v, g, beta, cu = (inp[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens"))
    do, _ = _grad_inputs(inp, 7)
    N, T, HV, D = cu.shape[0] - 1, q.shape[0], v.shape[1], 128
    plan = (D**-0.5, True, True, -1, -1)
    flags = torch.full((N,), 3, dtype=torch.uint8, device="cuda")
    eye = torch.eye(D, device="cuda").expand(N, HV, D, D).contiguous()
    with poisoned_allocations():
        E, M = ops.gdn_segment_summaries(q, k, v, g, beta, cu, *plan, flags)
        F, B = ops.gdn_segment_grad_summaries(do, q, k, g, beta, cu, *plan, flags)
        wants = (ops.gdn_fwd_final_state(q, k, v, g, beta, cu, None, *plan, flags),
                 ops.gdn_fwd_final_state(q, k, torch.zeros_like(v), g, beta, cu, eye, *plan, flags),
                 ops.gdn_bwd_initial_state(do, None, q, k, g, beta, cu, *plan, flags),
                 ops.gdn_bwd_initial_state(torch.zeros_like(do), eye, q, k, g, beta, cu, *plan, flags))
    for name, got, want in zip("EMFB", (E, M, F, B), wants):
        assert torch.equal(got, want), name
    for n in (0, N - 1):
        assert not E[n].any() and not F[n].any() and torch.equal(M[n], eye[n]) and torch.equal(B[n], eye[n])


def test_segment_summaries_refuse_a_piece_of_two_segments(ops):
    """A piece longer than one segment of its grid (8192 tokens at the deterministic grid
    of 4096) fails gdn_segment_summaries on the device with a message (its own process);
    doc_flags is required, and a plan that cuts, on the host before any kernel."""
    out = device_assert_output(
        "from cake_ops import build\n"
        "inp = make_gdn_inputs([8192, 300], 1, 2, 128, 128, device='cuda', seed=0)\n"
        "flags = torch.full((2,), 3, dtype=torch.uint8, device='cuda')",
        "build.load().gdn_segment_summaries(*(inp[n] for n in ('q', 'k', 'v', 'g', 'beta', 'cu_seqlens')), "
        "128**-0.5, False, True, -1, -1, flags)")
    assert "document 0 has 2 segments; each must be flagged to open and close inside" in out, out
    inp = GdnCase("no_flags", (300, 70), H=2).inputs("cuda")
    xs = [inp[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")]
    with pytest.raises(RuntimeError, match="doc_flags must be given"):
        ops.gdn_segment_summaries(*xs, 128**-0.5, False, True, -1, -1, None)
    # Non-deterministic, 5 and 2 chunks a document: that plan does not cut, so it has no summaries.
    flags = torch.full((2,), 3, dtype=torch.uint8, device="cuda")
    do = torch.randn_like(inp["v"])
    uncut = r"needs a cut plan \(deterministic=True, or segment_chunks > 0\); this call's plan is uncut"
    with pytest.raises(RuntimeError, match=uncut):
        ops.gdn_segment_summaries(*xs, 128**-0.5, False, False, -1, -1, flags)
    with pytest.raises(RuntimeError, match=uncut):
        ops.gdn_segment_grad_summaries(do, *xs[:2], *xs[3:], 128**-0.5, False, False, -1, -1, flags)


def test_doc_flags_bits_the_call_cannot_honour_stop_the_kernels(ops):
    """A half-grid bit in a call without a half grid (HV = 48) fails the call with an
    assert naming doc_flags, on the device (its own process: the CUDA context is unusable
    afterwards)."""
    out = device_assert_output(
        "from cake_ops import build\n"
        "inp = make_gdn_inputs([300, 500], 1, 48, 128, 128, device='cuda', seed=0)\n"
        "flags = torch.tensor([4, 0], dtype=torch.uint8, device='cuda')",
        "build.load().gdn_fwd(*(inp[n] for n in ('q', 'k', 'v', 'g', 'beta', 'cu_seqlens')), None, "
        "128**-0.5, False, True, -1, -1, flags)")
    assert "doc_flags[0] = 4: its bits must be of 1, 2, 4, 8" in out, out


def test_doc_flags_errors_name_the_argument(ops):
    inp = GdnCase("flags_errors", (300, 70), H=2).inputs("cuda")
    args = tuple(inp[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")) + (None, 128**-0.5, False)
    with pytest.raises(RuntimeError, match="doc_flags must be a contiguous uint8 \\[N\\] = \\[2\\]"):
        ops.gdn_fwd(*args, True, -1, -1, torch.zeros(3, dtype=torch.uint8, device="cuda"))
    with pytest.raises(RuntimeError, match="doc_flags needs a cut plan"):
        ops.gdn_fwd(*args, False, 0, -1, torch.zeros(2, dtype=torch.uint8, device="cuda"))


@pytest.mark.parametrize("case, segment_chunks", [(CASES[5], 8), (CASES[2], 2)],
                         ids=["long_doc_grid8", "pack_gva2_grid2"])
def test_forced_cut_grids_match_fp64(ops, case, segment_chunks):
    """Cut grids the plan does not choose for these shapes (segments of 8 and of 2 chunks:
    many cuts, chains of many steps): every gradient within the contract against FP64
    under NaN poisoning, bitwise repeatable, and both value splits alike."""
    inp = case.inputs("cuda")
    do, dht = _grad_inputs(inp, 21)
    run = lambda splits=-1: _bwd(ops, inp, case.l2norm, do, dht, segment_chunks=segment_chunks,  # noqa: E731
                                 value_splits=splits)
    with poisoned_allocations():
        grads = run()
    ref = _reference_grads(inp, case.l2norm, do, dht)
    for name, x in zip(GRADS, grads):
        if name in ref:  # (no initial state: no dh0 to compare)
            acc = accuracy(x, ref[name])
            record_accuracy(f"cuda gdn_bwd {name} (cut grid {segment_chunks})", acc)
            assert acc.ok, f"{case.id} grid {segment_chunks}: {name}: {acc}"
    for again in (run(), run(1), run(2)):
        assert all(torch.equal(a, b) for a, b in zip(grads, again))


def test_document_bits_alone_equal_packed(ops):
    """A document's gradients are bitwise the same alone and packed with others."""
    case = GdnCase("iso", (65, 4100, 37), G=2, gate="slow", l2norm=True, initial_state=True)
    inp = case.inputs("cuda")
    do, dht = _grad_inputs(inp, 5)
    packed = _bwd(ops, inp, True, do, dht)
    t0, t1 = 65, 65 + 4100
    alone_inp = {n: (inp[n][t0:t1] if n not in ("initial_state", "cu_seqlens") else None) for n in inp}
    alone_inp["initial_state"] = inp["initial_state"][1:2]
    alone_inp["cu_seqlens"] = torch.tensor([0, t1 - t0], dtype=inp["cu_seqlens"].dtype, device="cuda")
    alone = _bwd(ops, alone_inp, True, do[t0:t1].contiguous(), dht[1:2].contiguous())
    for name, p, a in zip(("dq", "dk", "dv", "dg", "dbeta"), packed[:5], alone[:5]):
        assert torch.equal(p[t0:t1], a), name
    assert torch.equal(packed[5][1:2], alone[5])


def test_deterministic_bits_do_not_depend_on_the_sm_count(ops):
    """The backward on the whole GPU and on green contexts of 64 and 16 SMs: bitwise the
    same gradients (the tapes walk with the forward's plan, which reads the SM count)."""
    case = GdnCase("sm_count", (64 * 256 + 37, 64 * 70 + 3, 4096), H=2, G=2, gate="slow", l2norm=True,
                   initial_state=True)
    inp = case.inputs("cuda")
    do, dht = _grad_inputs(inp, 6)
    run = lambda: _bwd(ops, inp, True, do, dht)  # noqa: E731
    full = run()
    for num_sms in (64, 16):
        got, _ = on_green_context(num_sms, run, 2)
        assert all(torch.equal(a, b) for a, b in zip(got, full)), f"{num_sms} SMs: other bits"
    # The backward's own time is no check that the context held: its reverse walks, one per
    # (document, value head), are latency-bound and as many as 16 SMs.
    slowdown = slowdown_on(16)
    assert slowdown >= 2, f"a matmul on 16 SMs took {slowdown:.2f}x its whole-GPU time: not held?"


def test_nondeterministic_plan_within_contract(ops):
    case = CASES[3]
    inp = case.inputs("cuda")
    do, dht = _grad_inputs(inp, 8)
    grads = _bwd(ops, inp, case.l2norm, do, dht, deterministic=False)
    again = _bwd(ops, inp, case.l2norm, do, dht, deterministic=False)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))  # reproducible for a fixed plan
    ref = _reference_grads(inp, case.l2norm, do, dht)
    _assert_within_contract(grads, ref)


def test_full_reset_gate(ops):
    """g = -inf resets the state: every gradient is the FP64 recurrence's, dg 0 there."""
    case = GdnCase("resets", (70, 300, 5), G=2, l2norm=True, initial_state=True)
    inp = case.inputs("cuda")
    resets = [0, 30, 70 + 63, 70 + 64, 70 + 200, 370]
    inp["g"] = inp["g"].clone()
    inp["g"][resets] = float("-inf")
    do, dht = _grad_inputs(inp, 9)
    with poisoned_allocations():
        grads = _bwd(ops, inp, True, do, dht)
    ref = _reference_grads(inp, True, do, dht)
    _assert_within_contract(grads, ref, "g = -inf")
    assert not grads[3][resets].any()


@pytest.mark.parametrize("case", [CASES[2], CASES[0]], ids=["gva2_bf16beta", "with_initial_state"])
@pytest.mark.parametrize("save_mode", ["light", "full"])
def test_op_dispatches_its_backward_to_cuda(ops, case, save_mode):
    """cake_ops.gdn's autograd runs the CUDA backward for a call the rule takes, with an
    initial state or without, in either save mode (every gradient, dh0 included, bitwise
    the binding's light backward); and the rule refuses an fp16 call (whose autograd runs
    the PyTorch backward)."""
    inp = case.inputs("cuda")
    do, dht = _grad_inputs(inp, 10)
    args = [inp[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")]
    assert dispatch.gdn_bwd_cuda_refusal(do, dht, *args, 128**-0.5) is None
    leaves = {n: inp[n].clone().requires_grad_() for n in LEAVES if inp[n] is not None}
    o, ht = cake_ops.gdn(*(leaves[n] for n in LEAVES[:5]), inp["cu_seqlens"], initial_state=leaves.get("initial_state"),
                         output_final_state=True, use_qk_l2norm=case.l2norm, save_mode=save_mode)
    torch.autograd.backward([o, ht], [do, dht])
    direct = _bwd(ops, inp, case.l2norm, do, dht)
    for n, d in zip(LEAVES, direct):
        if n in leaves:
            assert torch.equal(leaves[n].grad, d), n
    assert dispatch.gdn_bwd_cuda_refusal(do.half(), dht, *[a.half() if a.dtype == torch.bfloat16 else a
                                                           for a in args], 128**-0.5) is not None


@pytest.mark.parametrize("seed", [0, 2])
def test_large_first_state_and_last_state_gradient(ops, seed):
    """The cases where e^gl <dS_end, S> dominates dg at a one-token document (strong decay,
    random initial state and final-state gradient): with S and dS_end from the bf16 tapes,
    the CPU emulation puts dg at rel-RMS 1.2e-2 (tools/gdn_bwd_tape_precision.py, case
    gva3_strong; seed 0 from the h tape, seed 2 from the dS tape). The chunk-local kernel
    reads both from their fp32 inputs there."""
    from cake_ops.testing import make_gdn_inputs

    inp = make_gdn_inputs([65, 1, 300], 1, 3, 128, 128, gate="strong", beta="extreme", normalized_qk=False,
                          initial_state=True, device="cuda", seed=seed)
    do, dht = _grad_inputs(inp, seed + 1)
    with poisoned_allocations():
        grads = _bwd(ops, inp, True, do, dht)
    ref = _reference_grads(inp, True, do, dht)
    _assert_within_contract(grads, ref, "large first state")


def _layer_step(layer, x, cu):
    y = layer(x, cu)
    loss = y.float().square().mean()
    grads = torch.autograd.grad(loss, [x] + list(layer.parameters()))
    return (loss.detach(),) + grads


def _layer_and_batch(seed, save_mode="light"):
    torch.manual_seed(seed)
    layer = cake_ops.GatedDeltaNet(hidden_size=256, num_heads=2, num_v_heads=4, save_mode=save_mode).cuda().bfloat16()
    x = torch.randn(1, 700, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 100, 101, 500, 700], dtype=torch.int32, device="cuda")
    return layer, x, cu


@pytest.mark.parametrize("save_mode", ["light", "full"])
def test_training_step_replays_in_one_cuda_graph(ops, save_mode):
    """A GDN layer's forward and backward (short conv and GDN on their CUDA kernels)
    captured in one CUDA graph replays bitwise equal to eager: no host sync inside."""
    layer, x, cu = _layer_and_batch(0, save_mode)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _layer_step(layer, x, cu)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _layer_step(layer, x, cu)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    eager = _layer_step(layer, x, cu)
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("save_mode", ["light", "full"])
def test_training_step_compiles_to_one_graph(ops, save_mode):
    """torch.compile(fullgraph=True) of the layer (its forward, and the backward AOT
    autograd derives from it, with the CUDA kernels inside) gives eager's gradients."""
    torch._dynamo.reset()
    layer, x, cu = _layer_and_batch(1, save_mode)
    eager = _layer_step(layer, x, cu)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = _layer_step(compiled, x, cu)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)

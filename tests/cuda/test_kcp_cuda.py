"""KCP on the CUDA kernels: several ranks as threads of one process on one GPU (torch's
threaded process group), bf16 with K = V = 128, GVA, documents crossing rank boundaries,
layouts C, Z and D: each rank's outputs and gradients against the FP64 reference and
against the single-GPU ``cake_ops.gdn`` of the global batch (both within the accuracy
contract: the chain's fp32 states replace the single-GPU cut grid's), bitwise the same on
a repeat and across the forms (full save mode, exchanges
a2a and ring, save_transfer), with NaN-poisoned allocations; kcp_workspace_bytes against the workspaces of the ops a call runs."""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import cake_ops
from cake_ops.kcp import GRID_ALIGN, build_context_kcp, gdn_kcp, kcp_workspace_bytes
from cake_ops.kcp.context import _fragments, _held_ranges, half_grid
from cake_ops.reference import gdn_reference
from cake_ops.testing import accuracy, make_gdn_inputs, poisoned_allocations

from conftest import record_accuracy
from cake_ops.testing import run_rank_threads

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _case(rank, world, layout, lengths, H, HV, seed, single):
    inp = make_gdn_inputs(lengths, H, HV, 128, 128, initial_state=True, device="cuda", seed=seed)
    ctx = build_context_kcp(inp["cu_seqlens"].cpu(), layout=layout, device="cuda", align=1)
    do, dht, refs, refs64 = single

    def run(save_mode="light", exchange="a2a", save_transfer=True, segments=None):
        local = [ctx.shard(inp[n]).clone().requires_grad_(True) for n in NAMES[:5]]
        h0 = inp["initial_state"].clone().requires_grad_(True)
        o, ht = gdn_kcp(*local, ctx, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                        save_mode=save_mode, exchange=exchange, save_transfer=save_transfer, segments=segments)
        grads = torch.autograd.grad((o, ht), local + [h0], (ctx.shard(do), dht if rank == 0 else torch.zeros_like(dht)))
        return [o, ht, *grads]

    names = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta")

    def check(got, where, label=""):
        dh0 = got[7].clone()
        dist.all_reduce(dh0)
        for against, every in (("FP64", refs64), ("single GPU", refs)):
            for name, g_, r_ in zip(names, got, every):
                acc = accuracy(g_, r_ if name == "final_state" else ctx.shard(r_))
                record_accuracy(f"kcp {name} vs {against}{label}", acc)
                assert acc.ok, (name, against, where, acc)
            acc = accuracy(dh0, every[7])
            record_accuracy(f"kcp dh0 vs {against}{label}", acc)
            assert acc.ok, ("dh0", against, where, acc)

    got = run()
    where = f"layout {layout}, lengths {lengths}, rank {rank}/{world}"
    check(got, where)
    # A forced cut grid (segments): other fp32 chains, so other bits, within the contract;
    # bitwise on a repeat.
    for P in (1, 3):
        cut = run(segments=P)
        check(cut, f"{where}, segments={P}", ", segments")
        assert all(torch.equal(a, b) for a, b in zip(cut, run(segments=P))), f"segments={P} not bitwise ({where})"
    for a, b in zip(got, run()):
        assert torch.equal(a, b), f"not bitwise on a repeat ({where})"
    for form in (("full",), ("light", "a2a", False), ("light", "ring", False)):
        for a, b in zip(got, run(*form)):
            assert torch.equal(a, b), f"the form {form} differs from the default one ({where})"


def _single_gpu(lengths, H, HV, seed, fp64=True):
    """(do, dht, the single-GPU op's outputs and gradients, the FP64 reference's or None
    without fp64: the bitwise tests compare with the op alone)."""
    inp = make_gdn_inputs(lengths, H, HV, 128, 128, initial_state=True, device="cuda", seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    do = torch.randn(inp["v"].shape, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(inp["initial_state"].shape, device="cuda", generator=gen)
    leaves = [inp[n].clone().requires_grad_(True) for n in NAMES]
    o, ht = cake_ops.gdn(*leaves[:5], inp["cu_seqlens"], initial_state=leaves[5], output_final_state=True,
                         use_qk_l2norm=True)
    refs = [o, ht, *torch.autograd.grad((o, ht), leaves, (do, dht))]
    if not fp64:
        return do, dht, [r.detach() for r in refs], None
    leaves64 = [inp[n].detach().double().requires_grad_(True) for n in NAMES]
    o64, ht64 = gdn_reference(*leaves64[:5], inp["cu_seqlens"], initial_state=leaves64[5], use_qk_l2norm=True)
    refs64 = [o64, ht64, *torch.autograd.grad((o64, ht64), leaves64, (do.double(), dht.double()))]
    return do, dht, [r.detach() for r in refs], [r.detach() for r in refs64]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", ["C", "Z", "D"])
def test_kcp_cuda_on_rank_threads(world, layout):
    lengths, H, HV = [3000, 65, 1, 2100], 2, 6
    single = _single_gpu(lengths, H, HV, seed=world)
    with poisoned_allocations():  # process-wide: set once around all the rank threads
        run_rank_threads(_case, world, layout, lengths, H, HV, world, single, timeout=300)


class _CakeCalls(TorchDispatchMode):
    """Records the workspace each cake:: GDN op call of this thread needs
    (cake_ops.gdn_workspace_bytes of its batch and form; tests/cuda/test_gdn_byte_queries.py
    holds those to the allocator)."""

    def __init__(self):
        super().__init__()
        self.bytes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name in ("cake::gdn_fwd", "cake::gdn_fwd_full", "cake::gdn_fwd_final_state", "cake::gdn_bwd",
                    "cake::gdn_bwd_initial_state", "cake::gdn_segment_summaries", "cake::gdn_segment_grad_summaries"):
            if name in ("cake::gdn_segment_summaries", "cake::gdn_segment_grad_summaries"):
                q = args[0] if name == "cake::gdn_segment_summaries" else args[1]
                g, cu, l2, det, form = args[3], args[5], args[7], args[8], ("light", name.removeprefix("cake::gdn_"))
            elif name == "cake::gdn_bwd_initial_state":
                q, g, cu, l2, det, form = args[2], args[4], args[6], args[8], args[9], ("light", "initial_state")
            elif name == "cake::gdn_bwd":
                q, g, cu, l2, det = args[2], args[5], args[7], args[10], args[11]
                tapes = args[12] if len(args) > 12 else None
                form = ("full" if tapes is not None and tapes.numel() else "light", "backward")
            else:
                q, g, cu, l2, det = args[0], args[3], args[5], args[8], args[9]
                form = ("full" if name == "cake::gdn_fwd_full" else "light",
                        "final_state" if name == "cake::gdn_fwd_final_state" else "forward")
            names = [a.name for a in func._schema.arguments]

            def arg(name, default):  # (gdn_fwd_final_state takes no doc_flags)
                at = names.index(name) if name in names else len(args)
                return (kwargs or {}).get(name, args[at] if len(args) > at else default)

            self.bytes.append((form[1], cake_ops.gdn_workspace_bytes(
                q.shape[0], cu.shape[0] - 1, q.shape[1], g.shape[1], use_qk_l2norm=l2, deterministic=det,
                save_mode=form[0], direction=form[1], segment_chunks=arg("segment_chunks", -1),
                doc_flags=arg("doc_flags", None) is not None)))
        return func(*args, **(kwargs or {}))


def _workspace_case(rank, world, lengths, H, HV):
    inp = make_gdn_inputs(lengths, H, HV, 128, 128, device="cuda", seed=5)
    ctx = build_context_kcp(inp["cu_seqlens"].cpu(), layout="D", device="cuda", align=1)
    for save_mode, segments in (("light", None), ("full", None), ("light", 2)):
        local = [ctx.shard(inp[n]).clone().requires_grad_(True) for n in NAMES[:5]]
        calls = _CakeCalls()
        with calls:
            o, _ = gdn_kcp(*local, ctx, use_qk_l2norm=True, save_mode=save_mode, segments=segments)
            forward = list(calls.bytes)
            torch.autograd.grad(o, local, torch.ones_like(o))
        backward = calls.bytes[len(forward):]
        tables = ctx.chain_tables(torch.device("cuda"))
        # A relay (deterministic, so chained by hops): its segments' summaries, both ways.
        # The start-state gradients walked back from an end: with hops, the tails'; else the sinks'.
        relay = bool(tables.relay.count)
        ends = tables.tails if ctx.has_relays else tables.sinks
        assert {d for d, _ in forward} == {"forward"} | ({"segment_summaries"} if relay else set())
        assert {d for d, _ in backward} == ({"backward"} | ({"initial_state"} if ends.count else set())
                                            | ({"segment_grad_summaries"} if relay else set()))
        walks = 2 if tables.lead.count and tables.rest.count else 1
        assert [d for d, _ in forward].count("forward") == walks and [d for d, _ in backward].count("backward") == walks
        for direction, recorded in (("forward", forward), ("backward", backward)):
            want = max(b for _, b in recorded)
            got = kcp_workspace_bytes(ctx, H, HV, use_qk_l2norm=True, save_mode=save_mode, direction=direction,
                                      segments=segments)
            assert got == want, (rank, save_mode, direction, got, recorded)


@pytest.mark.gpu
def test_kcp_workspace_bytes_are_its_ops_largest():
    """kcp_workspace_bytes is the largest workspace of the cake:: ops a gdn_kcp forward or
    backward runs on each rank (layout D: rank 0 holds every document's lead source and
    its last fragment, the others relays)."""
    run_rank_threads(_workspace_case, 3, [5000, 700, 2100], 2, 6, timeout=300)


@pytest.fixture
def one_rank_nccl_group():
    """A one-rank NCCL group in this process (the collectives are then copies, but NCCL's:
    graph_replay captures them as a multi-GPU run would)."""
    assert not dist.is_initialized()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.gpu
def test_kcp_graph_replay_is_the_eager_bits(one_rank_nccl_group):
    """build_context_kcp(graph_replay=True): gdn_kcp's forward and backward as graph replays
    (the first call of a key eager and capturing, then replays), bitwise the eager calls'
    outputs and gradients on NaN-poisoned allocations, with and without initial states (the
    chained path and its collectives, or the single-GPU op's), in the save modes and
    exchanges; one graph per key."""
    from cake_ops import graphs

    lengths, H, HV = [3000, 65, 1, 2100], 2, 6
    inp = make_gdn_inputs(lengths, H, HV, 128, 128, initial_state=True, device="cuda", seed=11)
    cu = inp["cu_seqlens"].cpu()
    eager, replayed = (build_context_kcp(cu, device="cuda", graph_replay=r, align=1) for r in (False, True))
    gen = torch.Generator(device="cuda").manual_seed(12)
    do = torch.randn(inp["v"].shape, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(inp["initial_state"].shape, device="cuda", generator=gen)

    def run(ctx, initial, **form):
        leaves = [inp[n].clone().requires_grad_(True) for n in NAMES[: 6 if initial else 5]]
        h0 = leaves[5] if initial else None
        o, ht = gdn_kcp(*leaves[:5], ctx, initial_state=h0, output_final_state=True, use_qk_l2norm=True, **form)
        return [o, ht, *torch.autograd.grad((o, ht), leaves, (do, dht))]

    graphs.clear()
    forms = ({}, {"save_mode": "full"}, {"exchange": "ring", "save_transfer": False})
    with poisoned_allocations():
        for initial in (True, False):
            for form in forms:
                want = run(eager, initial, **form)
                for call in range(3):  # eager and capturing, then two replays
                    for a, b in zip(want, run(replayed, initial, **form)):
                        assert torch.equal(a, b), (initial, form, call)
    assert graphs.keys() == min(graphs.MAX_KEYS, 2 * 2 * len(forms))  # a forward and a backward key per form
    graphs.clear()


def _bitwise_case(rank, world, layout, lengths, H, HV, seed, single):
    inp = make_gdn_inputs(lengths, H, HV, 128, 128, initial_state=True, device="cuda", seed=seed)
    ctx = build_context_kcp(inp["cu_seqlens"].cpu(), layout=layout, device="cuda", align=GRID_ALIGN)
    assert any(len(f) >= 2 for f in ctx.doc_fragments), "no document crosses a rank boundary"
    do, dht, refs, _ = single

    def run(save_mode="light", exchange="a2a", save_transfer=True):
        local = [ctx.shard(inp[n]).clone().requires_grad_(True) for n in NAMES[:5]]
        h0 = inp["initial_state"].clone().requires_grad_(True)
        o, ht = gdn_kcp(*local, ctx, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                        save_mode=save_mode, exchange=exchange, save_transfer=save_transfer)
        grads = torch.autograd.grad((o, ht), local + [h0], (ctx.shard(do), dht if rank == 0 else torch.zeros_like(dht)))
        dh0 = grads[5].clone()
        dist.all_reduce(dh0)
        return [o, ht, *grads[:5], dh0]

    names = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    for form in (("light",), ("full",), ("light", "a2a", False), ("light", "ring", False)):
        for name, got, want in zip(names, run(*form), refs):
            want = want if name in ("final_state", "dh0") else ctx.shard(want)
            assert torch.equal(got, want), f"{name} not the single GPU's bits (layout {layout}, rank {rank}/{world}, {form})"


@pytest.mark.gpu
@pytest.mark.parametrize("world, layout", [(2, "C"), (3, "C"), (4, "C"), (2, "Z"), (3, "Z")])
def test_deterministic_kcp_is_the_single_gpu_bits(world, layout):
    """Deterministic KCP on a grid-aligned context (align=GRID_ALIGN) where every document
    spans at most two ranks (a lead and a tail): every rank's outputs, the final states and every gradient
    (dh0 summed over the ranks) bitwise the single-GPU deterministic cake_ops.gdn's of the
    global batch, in the save modes and exchanges, on NaN-poisoned allocations (the
    pieces' calls chain their edges as the whole document's grid does: doc_flags)."""
    lengths, H, HV = [9000, 65, 1, 12000, 300, 7000], 2, 6  # 9000 and 12000: the half grid at HV = 6
    single = _single_gpu(lengths, H, HV, seed=20 + world, fp64=False)
    with poisoned_allocations():
        run_rank_threads(_bitwise_case, world, layout, lengths, H, HV, 20 + world, single, timeout=300)


@pytest.mark.gpu
@pytest.mark.parametrize("world, layout, lengths", [
    (2, "C", [20480, 300, 20480, 300, 20480]), (3, "C", [24576, 65, 20480, 1, 16384]),
    (4, "C", [20480, 300, 20480, 300, 20480]), (2, "Z", [20480, 300, 20480, 300, 20480]),
    (3, "Z", [20480, 300, 20480, 300, 20480])])
def test_deterministic_kcp_of_half_grid_documents_is_the_single_gpu_bits(world, layout, lengths):
    """As above, for documents of 16,384 tokens or more at HV = 6 (the half grid takes those over 8,192), which the deterministic
    plan cuts at half its grid, split where a fragment's own length would take the full
    grid: the fragments' doc_flags carry their documents' class (SubBatch.grid_flags)."""
    H, HV = 2, 6
    per_doc = _aligned_fragments([0, *torch.tensor(lengths).cumsum(0).tolist()], world, layout)
    assert any(len(f) == 2 and half_grid(-(-lengths[d] // 64), HV) != half_grid(-(-min(f) // 64), HV)
               for d, f in enumerate(per_doc)), "no fragment falls in the other class by its own length"
    single = _single_gpu(lengths, H, HV, seed=40 + world, fp64=False)
    with poisoned_allocations():
        run_rank_threads(_bitwise_case, world, layout, lengths, H, HV, 40 + world, single, timeout=300)


@pytest.mark.gpu
@pytest.mark.parametrize("world, layout", [(3, "C"), (4, "C"), (2, "Z"), (3, "Z"), (2, "D"), (3, "D")])
def test_deterministic_kcp_with_relays_is_the_single_gpu_bits(world, layout):
    """As above, where a document spans three ranks or more (up to five fragments): the
    relays chained by neighbour hops from their grid segments' summaries
    (cake::gdn_state_chain, cake::gdn_state_grad_chain; docs/kcp.md, "Relays"); the long
    document of the half-grid class at HV = 6."""
    lengths, H, HV = [40960, 65, 1, 9000, 300], 2, 6
    assert max(len(f) for f in _aligned_fragments([0, *torch.tensor(lengths).cumsum(0).tolist()], world,
                                                    layout)) >= 3, "no relay in the case's plan"
    single = _single_gpu(lengths, H, HV, seed=60 + world, fp64=False)
    with poisoned_allocations():
        run_rank_threads(_bitwise_case, world, layout, lengths, H, HV, 60 + world, single, timeout=300)


def _aligned_fragments(cu, world, layout):
    """Per document, the token counts of its fragments on a grid-aligned context."""
    per_doc = [[] for _ in range(len(cu) - 1)]
    for held in _held_ranges(cu, world, layout, GRID_ALIGN):
        for f in _fragments(cu, held):
            if f.doc >= 0:
                per_doc[f.doc].append(f.tokens)
    return per_doc


def _layer_case(rank, world, layer, x, cu, w):
    """GatedDeltaNet(x_r, kcp=ctx) under bf16 autocast against the layer on the whole row:
    output rows, dx and the parameters' gradients summed over the ranks, within the
    contract (two bf16 computations of the same model)."""
    import copy

    layer = copy.deepcopy(layer)
    params = list(layer.parameters())
    x_all = x.clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_all = layer(x_all, cu)
    refs = torch.autograd.grad((y_all.float() * w).sum(), [x_all, *params])
    ctx = build_context_kcp(cu.cpu(), layout="D", device="cuda", align=1)
    x_r = ctx.shard(x[0])[None].clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):  # (no NaN poisoning: it would make cuBLAS refuse)
        y_r = layer(x_r, kcp=ctx)
    grads = torch.autograd.grad((y_r.float() * ctx.shard(w[0])[None]).sum(), [x_r, *params])
    checks = [("y", y_r[0], ctx.shard(y_all[0].detach())), ("dx", grads[0][0], ctx.shard(refs[0][0]))]
    for (name, _), g_, r_ in zip(layer.named_parameters(), grads[1:], refs[1:]):
        g_ = g_.clone()
        dist.all_reduce(g_)
        checks.append((f"d{name}", g_, r_))
    for name, got, want in checks:
        acc = accuracy(got, want)
        record_accuracy(f"kcp layer {name} vs the whole row", acc)
        assert acc.ok, (name, rank, acc)


@pytest.mark.gpu
def test_gated_deltanet_layer_with_kcp_on_the_cuda_kernels():
    """The layer context parallel on three rank threads of one GPU (layout D: every
    document over every rank), head dims 128 and GVA 3, so GDN and the convolution run on
    the CUDA kernels."""
    from cake_ops import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(256, 2, 6).cuda()
    lengths = [5000, 700, 2100]
    cu = torch.tensor([0, 5000, 5700, 7800], dtype=torch.int32, device="cuda")
    x, w = torch.randn(1, sum(lengths), 256, device="cuda"), torch.randn(1, sum(lengths), 256, device="cuda")
    run_rank_threads(_layer_case, 3, layer, x, cu, w, timeout=300)

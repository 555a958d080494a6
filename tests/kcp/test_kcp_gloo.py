"""KCP on the CPU with gloo (2, 3 and 4 spawned ranks): ``gdn_kcp`` and ``short_conv_kcp``
give, on each rank's rows, the single-process ``cake_ops.gdn`` / ``cake_ops.short_conv``
outputs and every gradient (fp32, so the only difference is the chain's order of
operations), within the accuracy contract of the FP64 reference, bitwise the same on a
repeat and across the forms (save modes, exchanges a2a and ring, save_transfer); layouts
C, Z and D; documents inside one rank, crossing one or several rank
boundaries, shorter than the ranks, empty; a rank holding no token; initial states; GVA."""

import pytest
import torch
import torch.distributed as dist

import cake_ops
from cake_ops.kcp import LAYOUTS, build_context_kcp, gdn_kcp, short_conv_kcp
from cake_ops.reference import gdn_reference
from cake_ops.testing import accuracy, make_gdn_inputs

from distributed import run_ranks

# (lengths, H, HV): one long document over every rank, a mix with short and empty ones, GVA.
CASES = [([300], 1, 1), ([130, 3, 0, 97, 1, 64], 2, 4), ([5, 200, 70], 1, 3)]
K = V = 32


def _close(name, got, want):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


def _sum_over_ranks(x):
    x = x.clone()
    dist.all_reduce(x)
    return x


def _gdn_case(rank, world, layout, lengths, H, HV, seed, align=1):
    inp = make_gdn_inputs(lengths, H, HV, K, V, dtype=torch.float32, initial_state=True, seed=seed)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    cu = inp["cu_seqlens"]
    gen = torch.Generator().manual_seed(seed + 100)
    do = torch.randn(inp["v"].shape, generator=gen)
    dht = torch.randn(inp["initial_state"].shape, generator=gen)
    leaves = [inp[n].clone().requires_grad_(True) for n in names]
    o_ref, ht_ref = cake_ops.gdn(*leaves[:5], cu, initial_state=leaves[5], output_final_state=True,
                                 use_qk_l2norm=True)
    refs = [o_ref, ht_ref, *torch.autograd.grad((o_ref, ht_ref), leaves, (do, dht))]
    o64, ht64 = gdn_reference(*(inp[n].double() for n in names[:5]), cu, initial_state=inp["initial_state"].double(),
                              use_qk_l2norm=True)

    ctx = build_context_kcp(cu, layout=layout, align=align)

    def run(save_mode="light", exchange="a2a", save_transfer=True):
        local = [ctx.shard(inp[n]).clone().requires_grad_(True) for n in names[:5]]
        h0 = inp["initial_state"].clone().requires_grad_(True)
        o, ht = gdn_kcp(*local, ctx, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                        save_mode=save_mode, exchange=exchange, save_transfer=save_transfer)
        # Only rank 0's loss reads the final states; the others' backward still meets it in
        # the final states' exchange.
        outs, douts = ((o, ht), (ctx.shard(do), dht)) if rank == 0 else ((o,), (ctx.shard(do),))
        grads = torch.autograd.grad(outs, local + [h0], douts, allow_unused=True)
        return [o, ht, *grads[:5], grads[5] if grads[5] is not None else torch.zeros_like(h0)]

    got = run()
    where = f"layout {layout}, lengths {lengths}, rank {rank}/{world}"
    for name, g_, r_ in zip(("o", "final_state", "dq", "dk", "dv", "dg", "dbeta"), got, refs):
        _close(f"{name} ({where})", g_, ctx.shard(r_) if name not in ("final_state",) else r_)
    _close(f"dh0 ({where})", _sum_over_ranks(got[7]), refs[7])
    assert accuracy(ctx.gather(got[0].detach()), o64).ok, where
    assert accuracy(got[1].detach(), ht64).ok, where
    for a, b in zip(got, run()):
        assert torch.equal(a, b), f"not bitwise on a repeat ({where})"
    for form in (("full",), ("light", "a2a", False), ("full", "ring", False)):
        for a, b in zip(got, run(*form)):
            assert torch.equal(a, b), f"the form {form} differs from the default one ({where})"


def _short_conv_case(rank, world, layout, lengths, seed):
    for W in (4, 2, 1):
        _short_conv_width(rank, world, layout, lengths, seed, W)


def _short_conv_width(rank, world, layout, lengths, seed, W):
    D = 6
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    x, w, b = torch.randn(T, D, generator=gen), torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    h0, dy = torch.randn(N, D, W - 1, generator=gen), torch.randn(T, D, generator=gen)
    for init in ((None, h0) if W > 1 else (None,)):
        leaves = [t.clone().requires_grad_(True) for t in ((x, w, b) if init is None else (x, w, b, init))]
        y_ref = cake_ops.short_conv(*leaves[:3], cu, initial_state=leaves[3] if init is not None else None,
                                    activation="silu")
        refs = [y_ref, *torch.autograd.grad(y_ref, leaves, dy)]
        ctx = build_context_kcp(cu, layout=layout, conv_width=W, align=1)
        xl = ctx.shard(x).clone().requires_grad_(True)
        rep = [t.clone().requires_grad_(True) for t in leaves[1:]]
        y = short_conv_kcp(xl, rep[0], rep[1], ctx, initial_state=rep[2] if init is not None else None,
                           activation="silu")
        grads = torch.autograd.grad(y, [xl, *rep], ctx.shard(dy))
        where = f"layout {layout}, W {W}, lengths {lengths}, initial state {init is not None}, rank {rank}/{world}"
        _close(f"y ({where})", y, ctx.shard(refs[0]))
        _close(f"dx ({where})", grads[0], ctx.shard(refs[1]))
        for name, g_, r_ in zip(("dweight", "dbias", "dinitial_state"), grads[1:], refs[2:]):
            _close(f"{name} ({where})", _sum_over_ranks(g_), r_)


def _all_cases(rank, world):
    for layout in LAYOUTS:
        for i, (lengths, H, HV) in enumerate(CASES):
            _gdn_case(rank, world, layout, lengths, H, HV, seed=10 * world + i)
        _short_conv_case(rank, world, layout, [40, 1, 2, 0, 37, 3], seed=world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_kcp_matches_single_process(world):
    run_ranks(_all_cases, world, timeout=600)


def _aligned(rank, world):
    # Cuts moved to a grid (64 tokens here; GRID_ALIGN on the CUDA path): documents still
    # cross, and the fragments start and end on it.
    _gdn_case(rank, world, "C", [300, 64, 1, 500], 2, 4, seed=9, align=64)


def test_kcp_on_an_aligned_context():
    run_ranks(_aligned, 3, timeout=300)


def _tiny(rank, world):
    # Fewer tokens than ranks: some ranks hold nothing.
    _gdn_case(rank, world, "C", [2], 1, 2, seed=7)
    _short_conv_case(rank, world, "C", [2], seed=7)


def test_kcp_ranks_without_tokens():
    run_ranks(_tiny, 4, timeout=300)


def _multicast_off(rank, world):
    import os

    from cake_ops.testing import NO_NVLINK_MULTICAST

    wrong = {k: os.environ.get(k) for k, v in NO_NVLINK_MULTICAST.items() if os.environ.get(k) != v}
    assert not wrong, f"rank {rank}: NVLink multicast not off: {wrong}"


def test_spawned_ranks_keep_nvlink_multicast_off(monkeypatch):
    """Every spawned rank (gloo here, NCCL on the multi-GPU machines) starts with NVLink
    multicast off, whatever the caller's environment holds (and keeps)."""
    import os

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    run_ranks(_multicast_off, 2, timeout=120)
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"  # the ranks' environment, not the caller's


def _unchained(rank, world):
    """No document crosses a rank boundary and no initial state: each rank runs the
    single-process op on its rows (no chain, no start states). The outputs, final states
    and gradients are the single-process ones, with and without output_final_state."""
    lengths, H, HV = [17, 23, 0] * world, 1, 2
    inp = make_gdn_inputs(lengths, H, HV, K, V, dtype=torch.float32, seed=4)
    names = ("q", "k", "v", "g", "beta")
    ctx = build_context_kcp(inp["cu_seqlens"], layout="C", align=1)
    assert ctx.source_slots == 0
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(inp["v"].shape, generator=gen)
    dht = torch.randn(len(lengths), HV, K, V, generator=gen)
    leaves = [inp[n].clone().requires_grad_(True) for n in names]
    o_ref, ht_ref = cake_ops.gdn(*leaves, inp["cu_seqlens"], output_final_state=True)
    for with_final in (True, False):
        outs_ref, douts_ref = ((o_ref, ht_ref), (do, dht)) if with_final else ((o_ref,), (do,))
        refs = torch.autograd.grad(outs_ref, leaves, douts_ref, retain_graph=True)
        local = [ctx.shard(inp[n]).clone().requires_grad_(True) for n in names]
        o, ht = gdn_kcp(*local, ctx, output_final_state=with_final)
        where = f"final state {with_final}, rank {rank}/{world}"
        _close(f"o ({where})", o, ctx.shard(o_ref))
        if with_final:
            _close(f"final_state ({where})", ht, ht_ref)
        # Only rank 0's loss reads the final states (their gradient is the sum over the ranks).
        outs, douts = ((o, ht), (ctx.shard(do), dht)) if with_final and rank == 0 else ((o,), (ctx.shard(do),))
        for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), torch.autograd.grad(outs, local, douts), refs):
            _close(f"{name} ({where})", a, ctx.shard(b))


def test_kcp_without_crossing_documents():
    run_ranks(_unchained, 3, timeout=300)


def _traced_and_checkpointed(rank, world, layout):
    """torch.compile(fullgraph=True) of a KCP GDN + short conv forward, the same under a
    non-reentrant checkpoint, and both together: outputs and gradients bitwise the eager
    ones. aot_eager partitions as inductor does (min-cut): at layout C rank 0 holds no
    sink, so its backward's sink-gradient gather has no gradient in its input, and at
    layout D on three ranks the relays' hops send zeros from some ranks: without the
    collectives' ``after`` the partitioner ran those in one rank's forward and the
    ranks hung."""
    lengths, H, HV, D = [90, 7, 60], 1, 2, 2 * K
    inp = make_gdn_inputs(lengths, H, HV, K, V, dtype=torch.float32, initial_state=True, seed=3)
    ctx = build_context_kcp(inp["cu_seqlens"], layout=layout, align=1)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(D, 4, generator=gen)
    x_global = torch.randn(sum(lengths), D, generator=gen)

    def layer(x, g, beta, h0, w, exchange="a2a"):
        y = short_conv_kcp(x, w, None, ctx, activation="silu")
        q, k = y[:, :K].unsqueeze(1), y[:, K:].unsqueeze(1)
        v = torch.cat([y[:, :K], y[:, K:]], 1).view(-1, HV, V)
        o, ht = gdn_kcp(q, k, v, g, beta, ctx, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                        exchange=exchange, save_transfer=exchange == "a2a")
        return o, ht

    def step(fn):
        leaves = [ctx.shard(x_global), ctx.shard(inp["g"]), ctx.shard(inp["beta"]), inp["initial_state"], w]
        leaves = [t.clone().requires_grad_(True) for t in leaves]
        o, ht = fn(*leaves)
        do = torch.ones_like(o) * 0.1
        return [o, ht, *torch.autograd.grad((o, ht), leaves, (do, torch.ones_like(ht) * (rank == 0)))]

    def ring(*x):
        return layer(*x, exchange="ring")

    def checkpointed_layer(*x):
        return torch.utils.checkpoint.checkpoint(layer, *x, use_reentrant=False)

    # Compiled and checkpointed first, on the fresh context: a table the context made and
    # kept at its first use inside the traced checkpoint region was a side effect Dynamo
    # refused.
    torch._dynamo.reset()
    compiled_checkpointed = step(torch.compile(checkpointed_layer, fullgraph=True, backend="aot_eager"))
    eager = step(layer)
    torch._dynamo.reset()
    compiled = step(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    compiled_ring = step(torch.compile(ring, fullgraph=True, backend="aot_eager"))
    checkpointed = step(checkpointed_layer)
    for name, got in (("compiled", compiled), ("compiled ring", compiled_ring), ("checkpointed", checkpointed),
                      ("compiled and checkpointed", compiled_checkpointed)):
        for i, (a, b) in enumerate(zip(got, eager)):
            assert torch.equal(a, b), f"{name} output {i} differs from eager (rank {rank})"


@pytest.mark.parametrize("world, layout", [(2, "Z"), (2, "C"), (3, "D")])
def test_kcp_traces_and_checkpoints(world, layout):
    run_ranks(_traced_and_checkpointed, world, layout, timeout=600)


@pytest.fixture
def one_intra_op_thread():
    """Rank threads share this process's intra-op thread pool; with one thread each op's
    split of its work (and so its bits) cannot depend on what the other ranks run."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_kcp_on_rank_threads(one_intra_op_thread):
    """The same checks with the ranks as threads of one process (the harness the GPU
    tests use to run several ranks on one GPU)."""
    from cake_ops.testing import run_rank_threads

    run_rank_threads(_gdn_case, 3, "D", [130, 3, 0, 97], 2, 4, 5, timeout=300)


def _fails_on_rank_two(rank, world):
    if rank == 2:
        raise ValueError("rank two's own error")
    dist.all_reduce(torch.ones(2))  # the others wait here until the group wakes them


def test_rank_threads_report_the_failing_rank():
    """A rank's failure is reported with its own error, not the termination the threaded
    group then raises in the ranks it wakes (lower ranks among them)."""
    from cake_ops.testing import run_rank_threads

    with pytest.raises(AssertionError, match="rank 2 of 3 failed: ValueError: rank two's own error"):
        run_rank_threads(_fails_on_rank_two, 3, timeout=60)


def _counted_exchange(rank, world, expected, exchange, save_transfer, deterministic):
    """One gdn_kcp (final states on) and one short_conv_kcp forward+backward; ``expected``
    [rank] gets kcp_comm_bytes of the call."""
    from cake_ops.kcp import kcp_comm_bytes

    lengths, H, HV, D = [130, 3, 0, 97, 1, 64], 1, 2, 6
    inp = make_gdn_inputs(lengths, H, HV, K, V, dtype=torch.float32, initial_state=True, seed=1)
    ctx = build_context_kcp(inp["cu_seqlens"], layout="D", conv_width=4, align=1)
    local = [ctx.shard(inp[n]).requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
    o, ht = gdn_kcp(*local, ctx, initial_state=inp["initial_state"], output_final_state=True, exchange=exchange,
                    save_transfer=save_transfer, deterministic=deterministic)
    x, w = ctx.shard(torch.randn(sum(lengths), D)).requires_grad_(True), torch.randn(D, 4)
    y = short_conv_kcp(x, w, None, ctx)
    torch.autograd.grad((o, ht, y), local + [x], (torch.ones_like(o), torch.ones_like(ht), torch.ones_like(y)))
    expected[rank] = kcp_comm_bytes(ctx, HV, K, V, output_final_state=True, conv_channels=D, exchange=exchange,
                                    save_transfer=save_transfer, deterministic=deterministic)
    assert ctx.has_relays  # layout D at 3 ranks: the deterministic calls chain by hops


# Deterministic calls on this plan (documents over three ranks) chain by hops in either
# exchange; the others by the exchange asked for.
@pytest.mark.parametrize("exchange, save_transfer, deterministic", [
    ("a2a", True, False), ("a2a", False, False), ("ring", False, False), ("a2a", True, True), ("ring", False, True)])
def test_kcp_comm_bytes_are_what_the_collectives_take(monkeypatch, one_intra_op_thread, exchange, save_transfer,
                                                      deterministic):
    from cake_ops.kcp import collectives

    log = {}
    real_gather, real_adjoint, real_shift = collectives.gather, collectives.gather_adjoint, collectives.shift

    def gather(x, ctx, after=None):
        log.setdefault(ctx.rank, []).append(("all-gather", x.numel() * x.element_size()))
        return real_gather(x, ctx, after)

    def gather_adjoint(g, ctx, after=None):
        log.setdefault(ctx.rank, []).append(("all-to-all", g.numel() * g.element_size()))
        return real_adjoint(g, ctx, after)

    def shift(x, send_splits, recv_splits, ctx, after=None):
        log.setdefault(ctx.rank, []).append(("shifts", x.numel() * x.element_size()))
        return real_shift(x, send_splits, recv_splits, ctx, after)

    monkeypatch.setattr(collectives, "gather", gather)
    monkeypatch.setattr(collectives, "gather_adjoint", gather_adjoint)
    monkeypatch.setattr(collectives, "shift", shift)
    from cake_ops.testing import run_rank_threads

    expected_by_rank = {}
    run_rank_threads(_counted_exchange, 3, expected_by_rank, exchange, save_transfer, deterministic, timeout=300)
    shifted = exchange == "ring" or deterministic
    assert sorted(log) == sorted(expected_by_rank) == [0, 1, 2]
    for rank, expected in expected_by_rank.items():
        # Every exchange of the plan (documents cross rank boundaries, final states and a
        # conv are on): a2a, the forward's three gathers, the backward's gather of the
        # sinks' start-state gradients (and of the transfers without save_transfer) and
        # the two adjoints; ring, the chain's shifts both ways instead of the summaries'
        # and the sinks' gathers (the shifts summed over the chain's steps), as the hops.
        assert len(expected) == (6 if shifted else 7 - save_transfer), expected
        calls = log[rank]
        if shifted:
            shifts = sum(1 for kind, _ in calls if kind == "shifts")  # one a step of the chain, each way
            assert shifts % 2 == 0 and shifts > 0, calls
            shifted = sum(n for kind, n in calls if kind == "shifts")
            calls = [c for c in calls if c[0] != "shifts"] + [("shifts", shifted)]
            want = [(name.rsplit(" ", 1)[-1], n) for name, n in expected.items() if not name.endswith("shifts")]
            want.append(("shifts", sum(n for name, n in expected.items() if name.endswith("shifts"))))
        else:
            want = [(name.rsplit(" ", 1)[-1], n) for name, n in expected.items()]
        assert sorted(calls) == sorted(want), (rank, calls, want)


def _saved(rank, world, result):
    """The bytes one gdn_kcp call saves for its backward (unique storages through the
    saved-tensor hooks) against kcp_saved_bytes, with and without initial states."""
    from cake_ops.kcp import kcp_saved_bytes

    lengths, H, HV = [130, 3, 0, 97, 1, 64], 1, 2
    inp = make_gdn_inputs(lengths, H, HV, K, V, dtype=torch.float32, initial_state=True, seed=2)
    ctx = build_context_kcp(inp["cu_seqlens"], layout="D", align=1)
    for h0 in (None, inp["initial_state"]):
        local = [ctx.shard(inp[n]).requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        for exchange, save_transfer in (("a2a", True), ("a2a", False), ("ring", False)):
            storages.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                gdn_kcp(*local, ctx, initial_state=h0, exchange=exchange, save_transfer=save_transfer)
            want = kcp_saved_bytes(ctx, H, HV, K, V, dtype=torch.float32, cuda_kernels=False, exchange=exchange,
                                   save_transfer=save_transfer, initial_state=h0 is not None)
            result.setdefault(rank, []).append((sum(storages.values()), want))
    # Without crossing documents and initial states: no start states are kept.
    lengths = [17, 23] * world
    inp = make_gdn_inputs(lengths, H, HV, K, V, dtype=torch.float32, initial_state=True, seed=3)
    ctx = build_context_kcp(inp["cu_seqlens"], layout="C", align=1)
    for h0 in (None, inp["initial_state"]):
        local = [ctx.shard(inp[n]).requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
        storages.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            gdn_kcp(*local, ctx, initial_state=h0)
        want = kcp_saved_bytes(ctx, H, HV, K, V, dtype=torch.float32, cuda_kernels=False,
                               initial_state=h0 is not None)
        result.setdefault(rank, []).append((sum(storages.values()), want))


def test_kcp_saved_bytes_are_what_the_call_saves(one_intra_op_thread):
    from cake_ops.testing import run_rank_threads

    result = {}
    run_rank_threads(_saved, 3, result, timeout=300)
    assert sorted(result) == [0, 1, 2]
    for rank, pairs in result.items():
        for got, want in pairs:
            assert got == want, (rank, got, want)


def _layer_case(rank, world, layout, layer, x, cu, w):
    """``GatedDeltaNet(x_r, kcp=ctx)`` on this rank's rows against the layer on the whole
    packed row: the output rows and dx, and the parameters' gradients summed over the ranks."""
    import copy

    layer = copy.deepcopy(layer)
    params = list(layer.parameters())
    x_all = x.clone().requires_grad_(True)
    y_all = layer(x_all, cu)
    refs = torch.autograd.grad((y_all * w).sum(), [x_all, *params])

    ctx = build_context_kcp(cu, layout=layout, conv_width=layer.conv_weight.shape[1], align=1)
    x_r = ctx.shard(x[0])[None].clone().requires_grad_(True)
    y_r = layer(x_r, kcp=ctx)
    grads = torch.autograd.grad((y_r * ctx.shard(w[0])[None]).sum(), [x_r, *params])
    where = f"layout {layout}, rank {rank}/{world}"
    _close(f"y ({where})", y_r[0], ctx.shard(y_all[0].detach()))
    _close(f"dx ({where})", grads[0][0], ctx.shard(refs[0][0]))
    for (name, _), g_, r_ in zip(layer.named_parameters(), grads[1:], refs[1:]):
        _close(f"d{name} ({where})", _sum_over_ranks(g_), r_)
    with pytest.raises(ValueError, match="with kcp, x must be"):
        layer(x_r, cu, kcp=ctx)


@pytest.mark.parametrize("layout", ["C", "D"])
def test_gated_deltanet_layer_with_kcp_matches_the_whole_row(one_intra_op_thread, layout):
    """The layer context parallel (short_conv_kcp and gdn_kcp inside, the rest per token)
    on three rank threads: documents crossing the ranks (layout D: each over every rank)."""
    from cake_ops import GatedDeltaNet
    from cake_ops.testing import run_rank_threads

    torch.manual_seed(0)
    layer = GatedDeltaNet(48, 1, 2, head_k_dim=K, head_v_dim=V)
    lengths = [130, 3, 0, 97]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x, w = torch.randn(1, sum(lengths), 48), torch.randn(1, sum(lengths), 48)
    run_rank_threads(_layer_case, 3, layout, layer, x, cu, w, timeout=300)


def _fla_case(rank, world, inp, options):
    """cake_ops.chunk_gated_delta_rule with cp_context=ctx on this rank's rows ([1, T_r,
    ...], as FLA's context parallel call takes them) against the drop-in on the whole row:
    outputs, final states, and every gradient (the replicated ones summed over the ranks)."""
    from cake_ops import chunk_gated_delta_rule

    names = ("q", "k", "v", "g", "beta")
    extra = {n: inp[n] for n in ("A_log", "dt_bias", "initial_state")}
    cu = inp["cu_seqlens"]
    whole = [inp[n][None].clone().requires_grad_(True) for n in names]
    reps = {n: x.clone().requires_grad_(True) for n, x in extra.items()}
    o_all, ht_all = chunk_gated_delta_rule(*whole, cu_seqlens=cu, output_final_state=True, **reps, **options)
    do = torch.randn(o_all.shape, generator=torch.Generator().manual_seed(3))
    refs = torch.autograd.grad((o_all * do).sum() + ht_all.sum(), [*whole, *reps.values()])

    ctx = build_context_kcp(cu, layout="D", align=1)
    local = [ctx.shard(inp[n])[None].clone().requires_grad_(True) for n in names]
    mine = {n: x.clone().requires_grad_(True) for n, x in extra.items()}
    o, ht = chunk_gated_delta_rule(*local, cp_context=ctx, output_final_state=True, **mine, **options)
    loss = (o * ctx.shard(do[0])[None]).sum() + (ht.sum() if rank == 0 else 0)
    grads = torch.autograd.grad(loss, [*local, *mine.values()])
    where = f"rank {rank}/{world}"
    _close(f"o ({where})", o[0], ctx.shard(o_all[0].detach()))
    _close(f"final state ({where})", ht, ht_all.detach())
    for name, g_, r_ in zip(names, grads, refs):
        _close(f"d{name} ({where})", g_[0], ctx.shard(r_[0]))
    for name, g_, r_ in zip(extra, grads[5:], refs[5:]):
        _close(f"d{name} ({where})", _sum_over_ranks(g_), r_)
    with pytest.raises(ValueError, match="cu_seqlens is None"):
        chunk_gated_delta_rule(*local, cp_context=ctx, cu_seqlens=ctx.cu_seqlens, **options)


def test_fla_drop_in_takes_a_kcp_context(one_intra_op_thread):
    """The FLA drop-in's cp_context: a cake KcpContext runs gdn_kcp behind FLA's call, its
    input options (the gate in kernel, beta's sigmoid, state_v_first) around it."""
    from cake_ops.testing import run_rank_threads

    lengths, H, HV = [130, 3, 0, 97], 1, 2
    inp = make_gdn_inputs(lengths, H, HV, K, V, dtype=torch.float32, initial_state=True, seed=8)
    gen = torch.Generator().manual_seed(9)
    inp["A_log"], inp["dt_bias"] = torch.rand(HV, generator=gen), torch.randn(HV, generator=gen)
    inp["g"] = torch.randn(inp["g"].shape, generator=gen)  # the raw gate input
    inp["beta"] = torch.randn(inp["beta"].shape, generator=gen)  # logits
    options = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
                   use_qk_l2norm_in_kernel=True)
    run_rank_threads(_fla_case, 3, inp, options, timeout=300)


def _compiled_across_plans(rank, world):
    """One compiled GatedDeltaNet step taking the context as an argument, over packs of
    other documents (a new plan each step, as packed training makes): each step's output
    and gradients the eager ones' bits; Dynamo recompiles as the plan's sizes change and
    then takes them as dynamic."""
    import copy
    import random

    from cake_ops import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 1, 2, head_k_dim=16, head_v_dim=16)
    twin = copy.deepcopy(layer)

    def step(fn, params, x, ctx):
        x = x.clone().requires_grad_(True)
        y = fn(x, ctx)
        return [y, *torch.autograd.grad((y * y).sum(), [x, *params])]

    torch._dynamo.reset()
    forward = torch.compile(lambda x, ctx: twin(x, kcp=ctx), fullgraph=True, backend="aot_eager")
    rng = random.Random(1)
    for i in range(4):
        lengths = [rng.randint(20, 200) for _ in range(4)]
        cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        ctx = build_context_kcp(cu, layout="C", align=1)
        x = torch.randn(1, ctx.local_tokens, 32, generator=torch.Generator().manual_seed(i))
        got = step(forward, list(twin.parameters()), x, ctx)
        want = step(lambda x, ctx: layer(x, kcp=ctx), list(layer.parameters()), x, ctx)
        for j, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"step {i} ({lengths}), output {j} (rank {rank})"


def test_kcp_layer_compiled_across_plans():
    run_ranks(_compiled_across_plans, 2, timeout=600)


def test_collectives_after_changes_no_bit_when_traced():
    """The dependency ``after`` adds to a backward collective's input when traced is
    ``+ (-0.0)``: every value keeps its bits, signed zeros and NaN included."""
    from cake_ops.kcp import collectives

    x = torch.tensor([-0.0, 0.0, 1.5, -2.25e-40, float("nan"), float("inf"), -float("inf"), 3e38])
    after = torch.randn(5).bfloat16()
    torch._dynamo.reset()
    traced = torch.compile(lambda x, a: collectives._after(x, a), fullgraph=True, backend="aot_eager")(x, after)
    assert traced is not x and torch.equal(traced.view(torch.int32), x.view(torch.int32))
    assert collectives._after(x, after) is x  # eager: the input itself

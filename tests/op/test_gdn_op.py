"""The cake::gdn_fwd / cake::gdn_bwd ops through their public entries (cake_ops.gdn,
torch.ops.cake.*, the FLA shim) on every device: accuracy against the FP64 reference,
opcheck, torch.compile, input validation, CUDA-graph capture."""

import random
import warnings

import pytest
import torch
import torch.utils.checkpoint

import cake_ops
from cake_ops.ops import gdn as gdn_ops
from cake_ops.reference import gdn_reference
from cake_ops.testing import accuracy, make_gdn_inputs, poisoned_allocations

from cases import GdnCase, params
from conftest import DEVICES, assert_within_contract, record_accuracy

_rng = random.Random(1234)
CASES = [
    GdnCase("edges_h2_l2_h0", (1, 63, 64, 65), H=2, l2norm=True, initial_state=True),
    GdnCase("pack_gva2_bf16beta", tuple(_rng.randint(1, 150) for _ in range(5)), H=2, G=2, beta_dtype=torch.bfloat16),
    GdnCase("strong_extreme_gva3_l2_h0", (65, 1, 130), G=3, gate="strong", beta="extreme", l2norm=True,
            initial_state=True),
    GdnCase("small_head_gva3_l2_bf16beta", tuple(_rng.randint(1, 120) for _ in range(4)), H=2, G=3, K=32, V=64,
            beta_dtype=torch.bfloat16, l2norm=True),
    GdnCase("slow_extreme_k64_h0", (64, 64, 7), H=2, G=2, K=64, V=64, gate="slow", beta="extreme", initial_state=True),
    GdnCase("one_long_doc_strong_l2_h0", (200,), gate="strong", beta_dtype=torch.bfloat16, l2norm=True,
            initial_state=True),
    GdnCase("empty_docs_gva2_l2_h0", (0, 70, 0, 3, 0), G=2, K=64, V=32, beta="extreme", l2norm=True,
            initial_state=True),
]

def _gdn_args(device, seed=0, initial_state=True, beta_dtype=torch.float32):
    inp = make_gdn_inputs([5, 64, 30], 2, 4, 16, 16, initial_state=initial_state, beta_dtype=beta_dtype,
                          device=device, seed=seed)
    return inp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("initial_state", [True, False])
@pytest.mark.parametrize("op", ["gdn_fwd", "gdn_fwd_final_state"])
def test_opcheck_gdn_fwd(device, initial_state, op):
    i = _gdn_args(device, initial_state=initial_state)
    args = [i["q"], i["k"], i["v"], i["g"], i["beta"], i["cu_seqlens"], i["initial_state"], 0.25, True, True]
    for n in (0, 1, 2, 3, 4, 6):
        if args[n] is not None:
            args[n] = args[n].requires_grad_()
    torch.library.opcheck(getattr(torch.ops.cake, op).default, args)
    torch.library.opcheck(getattr(torch.ops.cake, op).default, args, {"segment_chunks": 1})  # a forced cut grid


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_gdn_bwd(device):
    i = _gdn_args(device)
    T = i["q"].shape[0]
    do = torch.randn(T, 4, 16, device=device).bfloat16()
    dht = torch.randn(3, 4, 16, 16, device=device)
    for d in (dht, None):
        args = [do, d, i["q"], i["k"], i["v"], i["g"], i["beta"], i["cu_seqlens"], i["initial_state"], 0.25, False, True]
        torch.library.opcheck(torch.ops.cake.gdn_bwd.default, args)
        torch.library.opcheck(torch.ops.cake.gdn_bwd_initial_state.default,
                              [do, d, i["q"], i["k"], i["g"], i["beta"], i["cu_seqlens"], 0.25, True, True])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_gdn_fwd_full(device):
    i = _gdn_args(device)
    args = [i["q"], i["k"], i["v"], i["g"], i["beta"], i["cu_seqlens"], i["initial_state"], 0.25, True, True]
    for n in (0, 1, 2, 3, 4, 6):
        args[n] = args[n].requires_grad_()
    torch.library.opcheck(torch.ops.cake.gdn_fwd_full.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_save_modes_give_the_same_bits(device):
    """save_mode="full" through cake_ops.gdn and the FLA shim: o, the final state and
    every gradient bitwise those of the light mode, eager, compiled and under
    non-reentrant checkpointing; a mode that does not exist is refused."""
    torch._dynamo.reset()
    i = _gdn_args(device)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def step(save_mode, compiled=False, checkpointed=False):
        leaves = [i[n].clone().requires_grad_() for n in names]

        def f(q, k, v, g, beta, h0):
            return cake_ops.gdn(q, k, v, g, beta, i["cu_seqlens"], initial_state=h0, output_final_state=True,
                                use_qk_l2norm=True, save_mode=save_mode)

        if checkpointed:
            o, ht = torch.utils.checkpoint.checkpoint(f, *leaves, use_reentrant=False)
        else:
            o, ht = (torch.compile(f, fullgraph=True, backend="aot_eager") if compiled else f)(*leaves)
        (o.float().square().sum() + ht.sum()).backward()
        return [o, ht] + [t.grad for t in leaves]

    light = step("light")
    for got in (step("full"), step("full", compiled=True), step("full", checkpointed=True)):
        for a, b in zip(light, got):
            assert torch.equal(a, b)
    o, _ = cake_ops.chunk_gated_delta_rule(i["q"][None], i["k"][None], i["v"][None], i["g"][None], i["beta"][None],
                                           cu_seqlens=i["cu_seqlens"], save_mode="full")
    assert torch.equal(o[0], cake_ops.gdn(i["q"], i["k"], i["v"], i["g"], i["beta"], i["cu_seqlens"])[0])
    with pytest.raises(ValueError, match="save_mode"):
        cake_ops.gdn(i["q"], i["k"], i["v"], i["g"], i["beta"], i["cu_seqlens"], save_mode="heavy")


def _run_case(case: GdnCase, device):
    inp = case.inputs(device)
    seed, l2, h0 = case.seed, case.l2norm, case.initial_state
    names = ["q", "k", "v", "g", "beta"] + (["initial_state"] if h0 else [])
    leaves = {n: inp[n].clone().requires_grad_() for n in names}
    gen = torch.Generator().manual_seed(seed + 1)
    with poisoned_allocations():
        o, ht = cake_ops.gdn(
            leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], inp["cu_seqlens"],
            initial_state=leaves.get("initial_state"), output_final_state=True, use_qk_l2norm=l2,
        )
        do = torch.randn(o.shape, generator=gen).to(device, o.dtype)
        dht = torch.randn(ht.shape, generator=gen).to(device)
        torch.autograd.backward([o, ht], [do, dht])

    ref_leaves = {n: inp[n].detach().double().requires_grad_() for n in names}
    ro, rht = gdn_reference(
        ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], ref_leaves["g"], ref_leaves["beta"],
        inp["cu_seqlens"], initial_state=ref_leaves.get("initial_state"), use_qk_l2norm=l2,
    )
    torch.autograd.backward([ro, rht], [do.double(), dht.double()])
    pairs = {"o": (o, ro), "final_state": (ht, rht)}
    for n in names:
        pairs["d" + ("h0" if n == "initial_state" else n)] = (leaves[n].grad, ref_leaves[n].grad)
    return pairs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", params(CASES))
def test_gdn_accuracy(case, device):
    pairs = _run_case(case, device)
    assert_within_contract("gdn", pairs, f"{case.id} on {device}")
    assert pairs["dbeta"][0].dtype == case.beta_dtype


@pytest.mark.parametrize("device", DEVICES)
def test_gdn_unused_final_state(device):
    """Without output_final_state the op returns no final state, and the gradients are
    those of o alone (the FP64 reference's, which has no final-state term)."""
    inp = make_gdn_inputs([40, 90], 2, 4, 64, 64, initial_state=True, device=device, seed=7)
    leaves = {n: inp[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")}
    o, ht = cake_ops.gdn(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), inp["cu_seqlens"],
                         initial_state=leaves["initial_state"], use_qk_l2norm=True)
    assert ht is None
    do = torch.randn_like(o)
    o.backward(do)
    ref = {n: inp[n].detach().double().requires_grad_() for n in leaves}
    ro, _ = gdn_reference(*(ref[n] for n in ("q", "k", "v", "g", "beta")), inp["cu_seqlens"],
                          initial_state=ref["initial_state"], use_qk_l2norm=True)
    ro.backward(do.double())
    for n in leaves:
        assert accuracy(leaves[n].grad, ref[n].grad).ok, n


def test_gdn_batched_layout_equals_packed():
    """[B, T, ...] is the packed case with cu_seqlens = arange(B+1) * T."""
    inp = make_gdn_inputs([50, 50, 50], 2, 4, 32, 32, seed=3, initial_state=True)
    packed, ht = cake_ops.gdn(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"],
                              initial_state=inp["initial_state"], output_final_state=True, use_qk_l2norm=True)
    bt = [inp[n].unflatten(0, (3, 50)) for n in ("q", "k", "v", "g", "beta")]
    batched, ht_b = cake_ops.gdn(*bt, initial_state=inp["initial_state"], output_final_state=True, use_qk_l2norm=True)
    assert batched.shape == (3, 50, 4, 32)
    assert torch.equal(batched.flatten(0, 1), packed) and torch.equal(ht_b, ht)


def test_gdn_bwd_writes_every_element():
    """gdn_bwd called directly under NaN-poisoned allocation returns only finite values,
    also when dht is None."""
    inp = make_gdn_inputs([3, 64, 66], 1, 2, 32, 32, seed=11)
    T = inp["q"].shape[0]
    do = torch.randn(T, 2, 32, dtype=torch.bfloat16)
    with poisoned_allocations():
        grads = torch.ops.cake.gdn_bwd(do, None, inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                       inp["cu_seqlens"], None, 32**-0.5, True, True)
    for x in grads:
        assert torch.isfinite(x.float()).all()


@pytest.mark.gpu
def test_gdn_and_short_conv_capture_in_cuda_graph():
    """No host sync inside the ops: a forward+backward captured in a CUDA graph and
    replayed on new inputs of the same shape equals eager."""
    lengths = [100, 1, 150]

    def make(seed):
        inp = make_gdn_inputs(lengths, 2, 4, 128, 128, initial_state=True, device="cuda", seed=seed)
        x = torch.randn(sum(lengths), 64, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        return inp, x

    inp, x = make(0)
    leaves = {n: inp[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")}
    conv_w = torch.randn(64, 4, device="cuda")

    def step():
        o, ht = cake_ops.gdn(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), inp["cu_seqlens"],
                             initial_state=leaves["initial_state"], output_final_state=True, use_qk_l2norm=True)
        y = cake_ops.short_conv(x, conv_w, None, inp["cu_seqlens"], activation="silu")
        grads = torch.autograd.grad([o.float().square().sum(), ht.sum()], list(leaves.values()))
        return (o, ht, y) + grads

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture (lazy init, kernel build)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    new_inp, new_x = make(1)
    with torch.no_grad():
        for n in leaves:
            leaves[n].copy_(new_inp[n])
        x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


def test_compile_fullgraph_ops_directly():
    """torch.ops.cake.gdn_fwd called directly in a compiled function carries autograd."""
    torch._dynamo.reset()
    i = _gdn_args("cpu")

    def f(q, k, v, g, beta, h0):
        o, ht = torch.ops.cake.gdn_fwd(q, k, v, g, beta, i["cu_seqlens"], h0, 0.25, True, True)
        return o.float().square().sum() + ht.sum()

    leaves = [i[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
    f(*leaves).backward()
    eager = [t.grad for t in leaves]
    leaves2 = [t.detach().clone().requires_grad_() for t in leaves]
    torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves2).backward()
    for compiled, plain in zip([t.grad for t in leaves2], eager):
        assert torch.equal(compiled, plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic"])
def test_compile_across_pack_shapes(device, dynamic):
    """A compiled step (plain and under a non-reentrant checkpoint) over packs of other
    lengths and document counts: with dynamic=True every size is symbolic (the default
    scale K ** -0.5 too, which the scale check must not take), with the default the second
    pack recompiles with T and N dynamic. Gradients bitwise the eager step's."""
    K = 128 if device == "cuda" else 32  # the CUDA kernels' head dim (the CPU runs any)

    def step(q, k, v, g, beta, cu):
        o, ht = cake_ops.gdn(q, k, v, g, beta, cu, use_qk_l2norm=True, output_final_state=True)
        return o.float().square().sum() + ht.sum()

    def checkpointed(*x):
        return torch.utils.checkpoint.checkpoint(step, *x, use_reentrant=False)

    torch._dynamo.reset()
    compiled = [torch.compile(f, fullgraph=True, dynamic=dynamic, backend="aot_eager") for f in (step, checkpointed)]
    for seed, lengths in enumerate(([100, 37], [64, 1, 200], [300])):
        inp = make_gdn_inputs(lengths, 2, 4, K, K, device=device, seed=seed)
        names = ("q", "k", "v", "g", "beta")
        eager_leaves = [inp[n].detach().clone().requires_grad_(True) for n in names]
        step(*eager_leaves, inp["cu_seqlens"]).backward()
        for f in compiled:
            leaves = [inp[n].detach().clone().requires_grad_(True) for n in names]
            f(*leaves, inp["cu_seqlens"]).backward()
            for name, got, want in zip(names, leaves, eager_leaves):
                assert torch.equal(got.grad, want.grad), f"d{name} differs from eager at {lengths}"


def test_use_deterministic_algorithms_overrides_and_warns_once(monkeypatch):
    monkeypatch.setattr(gdn_ops, "_warned_nondeterministic", False)
    i = _gdn_args("cpu")
    args = (i["q"], i["k"], i["v"], i["g"], i["beta"], i["cu_seqlens"])
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cake_ops.gdn(*args, deterministic=False)
            cake_ops.gdn(*args, deterministic=False)
    finally:
        torch.use_deterministic_algorithms(was)
    msgs = [str(w.message) for w in caught if "deterministic" in str(w.message)]
    assert len(msgs) == 1 and "running the deterministic variant" in msgs[0]
    assert gdn_ops.effective_deterministic(False) is False  # the flag is off again


# ---------------------------------------------------------------- bad input


def _bad_gdn_calls():
    i = _gdn_args("cpu")
    q, k, v, g, beta, cu, h0 = (i[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state"))
    T = q.shape[0]
    yield "q dtype", TypeError, "q must have dtype", dict(q=q.to(torch.float64))
    yield "k dtype", TypeError, "k must have the dtype of q", dict(k=k.float())
    yield "q rank", ValueError, "q must be \\[T, H, K\\]", dict(q=q[:, 0])
    yield "k shape", ValueError, "k must have shape", dict(k=k[:, :1])
    yield "v T", ValueError, "v must be \\[T, HV, V\\]", dict(v=v[1:])
    yield "HV not multiple", ValueError, "multiple of the q/k heads", dict(v=v[:, :3], g=g[:, :3], beta=beta[:, :3])
    yield "g dtype", TypeError, "g must have dtype", dict(g=g.bfloat16())
    yield "g shape", ValueError, "g must have shape", dict(g=g[:, :2])
    yield "beta dtype", TypeError, "beta must have dtype", dict(beta=beta.double())
    yield "cu dtype", TypeError, "cu_seqlens must have dtype", dict(cu_seqlens=cu.float())
    yield "cu rank", ValueError, "cu_seqlens must be 1-D", dict(cu_seqlens=cu[:1])
    yield "cu start", ValueError, "cu_seqlens must start at 0", dict(cu_seqlens=cu + 1)
    yield "cu end", ValueError, "end at T", dict(cu_seqlens=torch.tensor([0, 5, 50, T - 1], dtype=torch.int32))
    yield "cu decreasing", ValueError, "non-decreasing", dict(cu_seqlens=torch.tensor([0, 50, 40, T], dtype=torch.int32))
    yield "h0 shape", ValueError, "initial_state must have shape", dict(initial_state=h0[:2])
    yield "h0 dtype", TypeError, "initial_state must have dtype", dict(initial_state=h0.bfloat16())
    yield "device", ValueError, "must be on cpu", dict(g=g.to("meta"))
    yield "cu list", TypeError, "cu_seqlens must be a torch.Tensor", dict(cu_seqlens=cu.tolist())
    yield "scale nan", ValueError, "scale must be finite", dict(scale=float("nan"))
    yield "scale inf", ValueError, "scale must be finite", dict(scale=float("inf"))
    yield "scale str", TypeError, "scale must be a float", dict(scale="0.1")
    empty = q[..., :0]
    yield "K = 0", ValueError, "head dims K = q.shape\\[-1\\] .* must be positive", dict(q=empty, k=empty)


@pytest.mark.parametrize("what,exc,match,override", list(_bad_gdn_calls()), ids=[c[0] for c in _bad_gdn_calls()])
def test_gdn_bad_input(what, exc, match, override):
    i = _gdn_args("cpu")
    args = dict(q=i["q"], k=i["k"], v=i["v"], g=i["g"], beta=i["beta"], cu_seqlens=i["cu_seqlens"],
                initial_state=i["initial_state"])
    args.update(override)
    with pytest.raises(exc, match=match):
        cake_ops.gdn(**args)


def test_gdn_bad_scale_from_torch_ops():
    """The op itself refuses a non-finite scale (compiled models call it directly)."""
    i = _gdn_args("cpu")
    with pytest.raises(ValueError, match="scale must be finite"):
        torch.ops.cake.gdn_fwd(i["q"], i["k"], i["v"], i["g"], i["beta"], i["cu_seqlens"], None, float("nan"),
                               False, True)


def test_gdn_bad_input_under_compile():
    """Static checks also fire while torch.compile traces (Dynamo may wrap the error)."""
    torch._dynamo.reset()
    i = _gdn_args("cpu")
    f = torch.compile(cake_ops.gdn, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="g must have dtype"):
        f(i["q"], i["k"], i["v"], i["g"].bfloat16(), i["beta"], i["cu_seqlens"])


def test_gdn_batched_with_cu_seqlens_refused():
    i = _gdn_args("cpu")
    q = i["q"][:90].unflatten(0, (2, 45))
    with pytest.raises(ValueError, match="batch of 1"):
        cake_ops.gdn(q, q, q.repeat(1, 1, 2, 1), torch.zeros(2, 45, 4) - 1, torch.rand(2, 45, 4), i["cu_seqlens"])




def test_cuda_rules_by_condition(monkeypatch):
    """The dispatch rules condition by condition, with the kernels taken as available (on
    this machine they are not): the forward takes bf16, K = V = 128, a finite scale > 0;
    the backward besides needs do in bf16 and dht in fp32."""
    from cake_ops import dispatch

    monkeypatch.setattr(dispatch, "_kernels_unavailable", lambda: None)
    i = make_gdn_inputs([5, 64, 30], 1, 2, 128, 128, initial_state=True, seed=3)
    args = [i[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")]
    do = torch.randn_like(i["v"].float()).bfloat16()
    dht = torch.randn(3, 2, 128, 128)
    assert dispatch.gdn_fwd_cuda_refusal(*args, 0.1) is None
    assert "scale" in dispatch.gdn_fwd_cuda_refusal(*args, float("nan"))
    assert "scale" in dispatch.gdn_fwd_cuda_refusal(*args, -0.1)
    assert "bf16" in dispatch.gdn_fwd_cuda_refusal(*[a.half() if a.dtype == torch.bfloat16 else a for a in args], 0.1)
    small = make_gdn_inputs([5, 64, 30], 1, 2, 64, 64, seed=3)
    assert "head dims" in dispatch.gdn_fwd_cuda_refusal(*(small[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")), 0.1)
    assert dispatch.gdn_bwd_cuda_refusal(do, dht, *args, 0.1) is None
    assert dispatch.gdn_bwd_cuda_refusal(do, None, *args, 0.1) is None
    assert "gradient of o" in dispatch.gdn_bwd_cuda_refusal(do.float(), dht, *args, 0.1)
    assert "final state" in dispatch.gdn_bwd_cuda_refusal(do, dht.double(), *args, 0.1)
    assert dispatch.short_conv_fwd_cuda_refusal(i["q"]) is None
    assert dispatch.gdn_state_chain_cuda_refusal(dht) is None
    assert "K = V = 128" in dispatch.gdn_state_chain_cuda_refusal(dht[..., :64])


def test_pytorch_implementation_refuses_every_cuda_rule(monkeypatch):
    """pytorch_implementation() turns every rule to a refusal, the kernels taken as
    available (the chains' too: they once bypassed the rules)."""
    from cake_ops import build, dispatch

    monkeypatch.setattr(build, "available", lambda: True)
    i = make_gdn_inputs([5, 64, 30], 1, 2, 128, 128, seed=3)
    args = [i[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")]
    do = torch.randn_like(i["v"].float()).bfloat16()
    state = torch.zeros(3, 2, 128, 128)
    rules = {
        "gdn_fwd": lambda: dispatch.gdn_fwd_cuda_refusal(*args, 0.1),
        "gdn_bwd": lambda: dispatch.gdn_bwd_cuda_refusal(do, None, *args, 0.1),
        "gdn_state_chain": lambda: dispatch.gdn_state_chain_cuda_refusal(state),
        "short_conv_fwd": lambda: dispatch.short_conv_fwd_cuda_refusal(i["q"]),
        "short_conv_bwd": lambda: dispatch.short_conv_bwd_cuda_refusal(i["q"], i["q"]),
    }
    assert {name: rule() for name, rule in rules.items()} == dict.fromkeys(rules)
    with dispatch.pytorch_implementation():
        for name, rule in rules.items():
            assert "pytorch_implementation" in (rule() or ""), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", params(CASES))
def test_gdn_bwd_initial_state_is_gdn_bwds_dh0(case, device):
    """cake::gdn_bwd_initial_state is bitwise the dh0 of cake::gdn_bwd (with and without
    dht; its outputs NaN-poisoned), which does not depend on v or the initial state, and
    within the contract of the FP64 reference's initial-state gradient."""
    inp = case.inputs(device)
    args = [inp[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")]
    N, T = inp["cu_seqlens"].shape[0] - 1, inp["q"].shape[0]
    gen = torch.Generator().manual_seed(case.seed + 2)
    do = torch.randn(T, case.HV, case.V, generator=gen).to(device, inp["v"].dtype)
    dht = torch.randn(N, case.HV, case.K, case.V, generator=gen).to(device)
    h0 = torch.randn(N, case.HV, case.K, case.V, generator=gen).to(device)
    scale, l2 = case.K**-0.5, case.l2norm
    q, k, v, g, beta, cu = args
    for d in (None, dht):  # the last, with dht, is checked against the reference below
        with poisoned_allocations():
            got = torch.ops.cake.gdn_bwd_initial_state(do, d, q, k, g, beta, cu, scale, l2, True)
            want = torch.ops.cake.gdn_bwd(do, d, q, k, v, g, beta, cu, h0, scale, l2, True)[5]
        assert got.dtype == torch.float32 and got.shape == (N, case.HV, case.K, case.V)
        assert torch.equal(got, want), (case.id, device, d is None)
    ref = {n: inp[n].detach().double() for n in ("q", "k", "v", "g", "beta")}
    h0_ref = h0.double().requires_grad_()
    ro, rht = gdn_reference(*ref.values(), cu, initial_state=h0_ref, use_qk_l2norm=l2)
    torch.autograd.backward([ro, rht], [do.double(), dht.double()])
    acc = accuracy(got, h0_ref.grad)
    record_accuracy("gdn_bwd_initial_state dh0", acc)
    assert acc.ok, (case.id, device, acc)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", params(CASES))
def test_gdn_fwd_final_state_is_gdn_fwds(case, device):
    """cake::gdn_fwd_final_state is bitwise the final state of cake::gdn_fwd (its output
    NaN-poisoned), and its gradient (through gdn_bwd with o's gradient zero) is gdn_fwd's
    with o unused."""
    inp = case.inputs(device)
    args = [inp[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state")]
    scale, l2 = case.K**-0.5, case.l2norm
    with poisoned_allocations():
        got = torch.ops.cake.gdn_fwd_final_state(*args, scale, l2, True)
        want = torch.ops.cake.gdn_fwd(*args, scale, l2, True)[1]
    assert got.dtype == torch.float32 and torch.equal(got, want), (case.id, device)
    for n in (0, 1, 2, 3, 4, 6):
        if args[n] is not None:
            args[n] = args[n].detach().requires_grad_()
    leaves = [a for a in args[:5] + args[6:] if a is not None]
    dht = torch.randn_like(got)
    grads = torch.autograd.grad(torch.ops.cake.gdn_fwd_final_state(*args, scale, l2, True), leaves, dht,
                                allow_unused=True)
    wants = torch.autograd.grad(torch.ops.cake.gdn_fwd(*args, scale, l2, True)[1], leaves, dht, allow_unused=True)
    for a, b in zip(grads, wants):
        assert (a is None and b is None) or torch.equal(a, b), case.id


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", params(CASES))
def test_gdn_segment_summaries_are_the_two_calls_they_stand_for(case, device):
    """cake::gdn_segment_summaries' (E, M) and cake::gdn_segment_grad_summaries' (F, B),
    their outputs NaN-poisoned, every document taken as a piece inside a longer one
    (doc_flags 3; each at most one segment of the deterministic grid here): the values of
    the two gdn_fwd_final_state calls (from zero; from the identity with v = 0) and of the
    two gdn_bwd_initial_state calls (do without dht; dht = I with do = 0) they replace, and
    within the contract of the FP64 reference's final states and initial-state gradients."""
    inp = case.inputs(device)
    q, k, v, g, beta, cu = (inp[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens"))
    N, T, K, HV = cu.shape[0] - 1, q.shape[0], case.K, case.HV
    gen = torch.Generator().manual_seed(case.seed + 3)
    do = torch.randn(T, HV, case.V, generator=gen).to(device, v.dtype)
    scale, l2 = K**-0.5, case.l2norm
    flags = torch.full((N,), 3, dtype=torch.uint8, device=device)
    eye = torch.eye(K, device=device).expand(N, HV, K, K).contiguous()
    zeros_v = v.new_zeros(T, HV, K)
    with poisoned_allocations():
        E, M = torch.ops.cake.gdn_segment_summaries(q, k, v, g, beta, cu, scale, l2, True, doc_flags=flags)
        F, B = torch.ops.cake.gdn_segment_grad_summaries(do, q, k, g, beta, cu, scale, l2, True, doc_flags=flags)
        wants = (
            torch.ops.cake.gdn_fwd_final_state(q, k, v, g, beta, cu, None, scale, l2, True, doc_flags=flags),
            torch.ops.cake.gdn_fwd_final_state(q, k, zeros_v, g, beta, cu, eye, scale, l2, True, doc_flags=flags),
            torch.ops.cake.gdn_bwd_initial_state(do, None, q, k, g, beta, cu, scale, l2, True, doc_flags=flags),
            torch.ops.cake.gdn_bwd_initial_state(zeros_v, eye, q, k, g, beta, cu, scale, l2, True, doc_flags=flags),
        )
    for name, got, want in zip("EMFB", (E, M, F, B), wants):
        assert got.dtype == torch.float32 and got.shape == want.shape, (case.id, name)
        assert torch.equal(got, want), (case.id, device, name)

    ref = {n: inp[n].detach().double() for n in ("q", "k", "g", "beta")}
    v64, zeros64 = v.double(), zeros_v.double()

    def reference(v_, h0, do_, dht):
        h0 = h0.double().requires_grad_()
        o, ht = gdn_reference(ref["q"], ref["k"], v_, ref["g"], ref["beta"], cu, initial_state=h0, use_qk_l2norm=l2)
        (dh0,) = torch.autograd.grad([o, ht], [h0], [do_.double(), dht.double()])
        return ht.detach(), dh0

    E_ref, F_ref = reference(v64, v64.new_zeros(N, HV, K, case.V), do, v64.new_zeros(N, HV, K, case.V))
    M_ref, B_ref = reference(zeros64, eye, zeros_v, eye)
    for name, got, want in (("E", E, E_ref), ("M", M, M_ref), ("F", F, F_ref), ("B", B, B_ref)):
        acc = accuracy(got, want)
        record_accuracy(f"gdn_segment_summaries {name}", acc)
        assert acc.ok, (case.id, device, name, acc)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_gdn_segment_summaries(device):
    i = _gdn_args(device)
    T, N = i["q"].shape[0], i["cu_seqlens"].shape[0] - 1
    do = torch.randn(T, 4, 16, device=device).bfloat16()
    flags = torch.full((N,), 3, dtype=torch.uint8, device=device)
    xs = [i["q"], i["k"], i["v"], i["g"], i["beta"], i["cu_seqlens"], 0.25, True, True]
    torch.library.opcheck(torch.ops.cake.gdn_segment_summaries.default, xs, {"doc_flags": flags})
    torch.library.opcheck(torch.ops.cake.gdn_segment_grad_summaries.default,
                          [do, i["q"], i["k"], i["g"], i["beta"], i["cu_seqlens"], 0.25, True, True],
                          {"doc_flags": flags})


def test_gdn_segment_summaries_need_doc_flags():
    i = _gdn_args("cpu")
    with pytest.raises(ValueError, match="doc_flags must be given"):
        torch.ops.cake.gdn_segment_summaries(i["q"], i["k"], i["v"], i["g"], i["beta"], i["cu_seqlens"], 0.25, True,
                                             True)
    do = torch.zeros_like(i["v"])
    with pytest.raises(ValueError, match="doc_flags must be given"):
        torch.ops.cake.gdn_segment_grad_summaries(do, i["q"], i["k"], i["g"], i["beta"], i["cu_seqlens"], 0.25, True,
                                                  True)


def test_gdn_bwd_initial_state_names_a_bad_do():
    i = _gdn_args("cpu")
    with pytest.raises(ValueError, match="do must be"):
        torch.ops.cake.gdn_bwd_initial_state(torch.zeros(2, 4, 16, dtype=torch.bfloat16), None, i["q"], i["k"],
                                             i["g"], i["beta"], i["cu_seqlens"], 0.25, False, True)


def _chain_operands(device, seed=3):
    """Per-segment summaries of three documents of 2, 0 and 3 segments (HV = 2, K = V =
    128); the second segment of the last document a truncated cut's (its transfer zero)."""
    gen = torch.Generator().manual_seed(seed)
    seg_cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    R, N, HV, D = 5, 3, 2, 128
    values = torch.randn(R, HV, D, D, generator=gen)
    transfers = torch.randn(R, HV, D, D, generator=gen) / D**0.5
    transfers[3] = 0
    state = torch.randn(N, HV, D, D, generator=gen)
    return [x.to(device) for x in (values, transfers, state, seg_cu)]


def _dense_chain(values, transfers, state, seg_cu, reverse):
    """The chains in float64, one document and segment at a time."""
    cu, out = seg_cu.tolist(), []
    for n in range(len(cu) - 1):
        rows, s = range(cu[n], cu[n + 1]), state[n].double()
        for j in (reversed(rows) if reverse else rows):
            s = transfers[j].double() @ s + values[j].double()
        out.append(s)
    return torch.stack(out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, reverse", [("gdn_state_chain", False), ("gdn_state_grad_chain", True)])
def test_state_chains_are_the_dense_chain(device, op, reverse):
    """cake::gdn_state_chain (per document, S <- M_s S + E_s over its segments in order)
    and cake::gdn_state_grad_chain (dS <- B_s dS + F_s from its last segment): against
    float64 chains, a document without segments passing its state through and a zero
    transfer (a truncated cut) giving the values alone; outputs NaN-poisoned; their
    autograd against float64 autograd of the dense chain; opcheck."""
    values, transfers, state, seg_cu = _chain_operands(device)
    fn = getattr(torch.ops.cake, op)
    with poisoned_allocations():
        got = fn(values, transfers, state, seg_cu)
    want = _dense_chain(values, transfers, state, seg_cu, reverse)
    assert got.dtype == torch.float32 and got.shape == state.shape
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4), (got.double() - want).abs().max()
    assert torch.equal(got[1], state[1])
    leaves = [x.detach().requires_grad_() for x in (values, transfers, state)]
    seed = torch.randn_like(got)
    grads = torch.autograd.grad(fn(*leaves, seg_cu), leaves, seed)
    dense = [x.detach().double().requires_grad_() for x in (values, transfers, state)]
    wants = torch.autograd.grad(_dense_chain(*dense, seg_cu, reverse), dense, seed.double())
    for name, a, b in zip(("values", "transfers", "state"), grads, wants):
        assert torch.allclose(a.double(), b, rtol=1e-4, atol=1e-3), (name, (a.double() - b).abs().max())
    torch.library.opcheck(fn.default, (values, transfers, state, seg_cu))


def test_state_chain_errors_name_the_argument():
    values, transfers, state, seg_cu = _chain_operands("cpu")
    with pytest.raises(ValueError, match="transfers must have shape"):
        torch.ops.cake.gdn_state_chain(values, transfers[:, :, :64], state, seg_cu)
    with pytest.raises(ValueError, match="seg_cu must have shape"):
        torch.ops.cake.gdn_state_grad_chain(values, transfers, state, seg_cu[:3])
    with pytest.raises(TypeError, match="seg_cu must have dtype"):
        torch.ops.cake.gdn_state_chain(values, transfers, state, seg_cu.long())

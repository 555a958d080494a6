"""The op surface: opcheck, torch.compile, checkpointing, determinism, the FLA shim,
input validation."""

import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import importlib

import cake_ops
from cake_ops.testing import make_gdn_inputs

from conftest import DEVICES

gdn_module = importlib.import_module("cake_ops.gdn")  # the module; cake_ops.gdn is the function


def _gdn_args(device, seed=0, initial_state=True, beta_dtype=torch.float32):
    inp = make_gdn_inputs([5, 64, 30], 2, 4, 16, 16, initial_state=initial_state, beta_dtype=beta_dtype,
                          device=device, seed=seed)
    return inp


# ---------------------------------------------------------------- opcheck


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("initial_state", [True, False])
def test_opcheck_gdn_fwd(device, initial_state):
    i = _gdn_args(device, initial_state=initial_state)
    args = [i["q"], i["k"], i["v"], i["g"], i["beta"], i["cu_seqlens"], i["initial_state"], 0.25, True, True]
    for n in (0, 1, 2, 3, 4, 6):
        if args[n] is not None:
            args[n] = args[n].requires_grad_()
    torch.library.opcheck(torch.ops.cake.gdn_fwd.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_gdn_bwd(device):
    i = _gdn_args(device)
    T = i["q"].shape[0]
    do = torch.randn(T, 4, 16, device=device).bfloat16()
    dht = torch.randn(3, 4, 16, 16, device=device)
    for d in (dht, None):
        args = [do, d, i["q"], i["k"], i["v"], i["g"], i["beta"], i["cu_seqlens"], i["initial_state"], 0.25, False, True]
        torch.library.opcheck(torch.ops.cake.gdn_bwd.default, args)


def _conv_args(device, bias=True, state=True):
    x = torch.randn(50, 12, device=device)
    w = torch.randn(12, 4, device=device)
    b = torch.randn(12, device=device) if bias else None
    cu = torch.tensor([0, 3, 3, 50], device=device)
    s = torch.randn(3, 12, 3, device=device) if state else None
    return x, w, b, cu, s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias,state", [(True, True), (False, False)])
def test_opcheck_short_conv(device, bias, state):
    x, w, b, cu, s = _conv_args(device, bias, state)
    fwd = [x.requires_grad_(), w.requires_grad_(), b.requires_grad_() if b is not None else None, cu,
           s.requires_grad_() if s is not None else None, True]
    torch.library.opcheck(torch.ops.cake.short_conv_fwd.default, fwd)
    dy = torch.randn_like(x)
    bwd = [dy] + [t.detach() if t is not None else None for t in (x, w, b)] + [cu, s.detach() if s is not None else None, True]
    torch.library.opcheck(torch.ops.cake.short_conv_bwd.default, bwd)


# ---------------------------------------------------------------- compile, checkpoint, determinism


def _layer_and_batch(device, seed=0):
    torch.manual_seed(seed)
    layer = cake_ops.GatedDeltaNet(hidden_size=64, num_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16).to(device)
    x = torch.randn(1, 150, 64, device=device)
    cu = torch.tensor([0, 17, 17, 100, 150], dtype=torch.int32, device=device)
    return layer, x, cu


def _grads(layer, x, cu, fn):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = fn(x, cu)
    y.backward(torch.ones_like(y) * 0.01 + y.detach() * 0.1)
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def _assert_all_close(a, b, exact=False):
    for u, w in zip(a, b):
        if exact:
            assert torch.equal(u, w)
        else:
            torch.testing.assert_close(u, w, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_layer_equals_eager(backend):
    torch._dynamo.reset()
    layer, x, cu = _layer_and_batch("cpu")
    eager = _grads(layer, x, cu, layer)
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    _assert_all_close(_grads(layer, x, cu, compiled), eager)


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
    _assert_all_close([t.grad for t in leaves2], eager, exact=True)


def test_checkpoint_non_reentrant_equals_plain():
    layer, x, cu = _layer_and_batch("cpu", seed=1)
    plain = _grads(layer, x, cu, layer)
    ckpt = _grads(layer, x, cu, lambda x, cu: checkpoint(layer, x, cu, use_reentrant=False))
    _assert_all_close(ckpt, plain, exact=True)


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_repeats_bitwise(device):
    layer, x, cu = _layer_and_batch(device, seed=2)
    first = _grads(layer, x, cu, layer)
    for _ in range(2):
        _assert_all_close(_grads(layer, x, cu, layer), first, exact=True)


def test_use_deterministic_algorithms_overrides_and_warns_once(monkeypatch):
    monkeypatch.setattr(gdn_module, "_warned_nondeterministic", False)
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
    assert gdn_module.effective_deterministic(False) is False  # the flag is off again


# ---------------------------------------------------------------- FLA shim


def test_fla_shim_equals_gdn():
    i = _gdn_args("cpu")
    o, ht = cake_ops.gdn(i["q"], i["k"], i["v"], i["g"], i["beta"], i["cu_seqlens"], scale=0.3,
                         initial_state=i["initial_state"], output_final_state=True, use_qk_l2norm=True)
    o2, ht2 = cake_ops.chunk_gated_delta_rule(
        i["q"][None], i["k"][None], i["v"][None], i["g"][None], i["beta"][None], scale=0.3,
        initial_state=i["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=i["cu_seqlens"],
    )
    assert o2.shape == (1,) + o.shape
    assert torch.equal(o2[0], o) and torch.equal(ht2, ht)
    _, none = cake_ops.chunk_gated_delta_rule(i["q"][None], i["k"][None], i["v"][None], i["g"][None],
                                              i["beta"][None], cu_seqlens=i["cu_seqlens"])
    assert none is None


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


@pytest.mark.parametrize("what,exc,match,override", list(_bad_gdn_calls()), ids=[c[0] for c in _bad_gdn_calls()])
def test_gdn_bad_input(what, exc, match, override):
    i = _gdn_args("cpu")
    args = dict(q=i["q"], k=i["k"], v=i["v"], g=i["g"], beta=i["beta"], cu_seqlens=i["cu_seqlens"],
                initial_state=i["initial_state"])
    args.update(override)
    with pytest.raises(exc, match=match):
        cake_ops.gdn(**args)


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


@pytest.mark.parametrize(
    "override,exc,match",
    [
        (dict(weight_w=5), ValueError, "width W"),
        (dict(x_rank=3), ValueError, "x must be \\[T, D\\]"),
        (dict(bias_len=3), ValueError, "bias must have shape"),
        (dict(state_w=4), ValueError, "initial_state must have shape"),
        (dict(cu=[0, 30, 20, 50]), ValueError, "non-decreasing"),
        (dict(x_dtype=torch.int32), TypeError, "x must have dtype"),
    ],
)
def test_short_conv_bad_input(override, exc, match):
    x, w, b, cu, s = _conv_args("cpu")
    if "weight_w" in override:
        w = torch.randn(12, override["weight_w"])
    if "x_rank" in override:
        x = x[None, None]
    if "bias_len" in override:
        b = b[:3]
    if "state_w" in override:
        s = torch.randn(3, 12, override["state_w"])
    if "cu" in override:
        cu = torch.tensor(override["cu"])
    if "x_dtype" in override:
        x = x.to(override["x_dtype"])
    with pytest.raises(exc, match=match):
        torch.ops.cake.short_conv_fwd(x, w, b, cu, s, True)


def test_short_conv_bad_activation():
    x, w, b, cu, s = _conv_args("cpu")
    with pytest.raises(ValueError, match="activation"):
        cake_ops.short_conv(x, w, b, cu, activation="relu")

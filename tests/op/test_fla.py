"""cake_ops.chunk_gated_delta_rule, the FLA drop-in: FLA 0.6.0's arguments on top of
cake_ops.gdn, each of its input and state options against the FP64 reference of what FLA
computes, and its refusals."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import cake_ops
from cake_ops.reference import gdn_reference
from cake_ops.testing import make_gdn_inputs

from conftest import DEVICES, assert_within_contract


def _inputs(device, H=2, G=2, D=128, lengths=(70, 1, 130), seed=0):
    i = make_gdn_inputs(list(lengths), H, H * G, D, D, initial_state=True, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    T, HV = i["g"].shape
    # FLA's raw forms: gate input, decay and bias parameters per value head, beta logits
    i["g_raw"] = torch.randn(T, HV, generator=gen).to(device)
    i["A_log"] = (torch.randn(HV, generator=gen) * 0.5).to(device)
    i["dt_bias"] = torch.randn(HV, generator=gen).to(device)
    i["beta_raw"] = (torch.randn(T, HV, generator=gen) * 3).to(device)
    return i


def _batched(*xs):
    return [x[None] for x in xs]


def test_fla_shim_equals_gdn():
    i = _inputs("cpu", D=16)
    o, ht = cake_ops.gdn(i["q"], i["k"], i["v"], i["g"], i["beta"], i["cu_seqlens"], scale=0.3,
                         initial_state=i["initial_state"], output_final_state=True, use_qk_l2norm=True)
    o2, ht2 = cake_ops.chunk_gated_delta_rule(
        *_batched(i["q"], i["k"], i["v"], i["g"], i["beta"]), scale=0.3,
        initial_state=i["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=i["cu_seqlens"],
    )
    assert o2.shape == (1,) + o.shape
    assert torch.equal(o2[0], o) and torch.equal(ht2, ht)
    _, none = cake_ops.chunk_gated_delta_rule(*_batched(i["q"], i["k"], i["v"], i["g"], i["beta"]),
                                              cu_seqlens=i["cu_seqlens"])
    assert none is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["gate_in_kernel", "beta_sigmoid", "neg_eigval"])
def test_fla_input_options_against_the_reference(form, device):
    """The raw gate (-exp(A_log) softplus(g + dt_bias)) or the beta logits (sigmoid, twice it
    with allow_neg_eigval) through the shim: o, the final state and every gradient, A_log's
    and dt_bias's included, within the contract of FP64 autograd through the same formula."""
    i = _inputs(device)
    gate = form == "gate_in_kernel"
    names = ["q", "k", "v", "g_raw" if gate else "g", "beta" if gate else "beta_raw", "initial_state"]
    names += ["A_log", "dt_bias"] if gate else []
    leaves = {n: i[n].clone().requires_grad_() for n in names}
    options = dict(use_gate_in_kernel=True, A_log=leaves["A_log"], dt_bias=leaves["dt_bias"]) if gate else dict(
        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=form == "neg_eigval")
    o, ht = cake_ops.chunk_gated_delta_rule(
        *_batched(*(leaves[n] for n in names[:5])), initial_state=leaves["initial_state"], output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=i["cu_seqlens"], **options)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(o.shape, generator=gen).to(device, o.dtype)
    dht = torch.randn(ht.shape, generator=gen).to(device)
    torch.autograd.backward([o, ht], [do, dht])

    ref = {n: i[n].detach().double().requires_grad_() for n in names}
    if gate:
        g = -ref["A_log"].exp() * F.softplus(ref["g_raw"] + ref["dt_bias"])
        beta = ref["beta"]
    else:
        g = ref["g"]
        beta = torch.sigmoid(ref["beta_raw"]) * (2.0 if form == "neg_eigval" else 1.0)
    ro, rht = gdn_reference(ref["q"], ref["k"], ref["v"], g, beta, i["cu_seqlens"],
                            initial_state=ref["initial_state"], use_qk_l2norm=True)
    torch.autograd.backward([ro, rht], [do[0].double(), dht.double()])
    pairs = {"o": (o[0], ro), "final_state": (ht, rht)}
    pairs.update({"d" + n: (leaves[n].grad, ref[n].grad) for n in names})
    assert_within_contract("fla shim", pairs, f"{form} on {device}")


def test_state_v_first_takes_and_gives_the_transposed_states():
    """state_v_first (and FLA's deprecated transpose_state_layout): the initial state read
    and the final state and the initial state's gradient given as [N, HV, V, K], bitwise the
    transposes of the default layout's."""
    i = _inputs("cpu", D=16)
    h0 = i["initial_state"]
    weights = torch.linspace(-1, 1, h0.numel()).view(h0.shape)  # per (k, v): the layout matters

    def run(h0, v_first, **options):
        h0 = h0.clone().requires_grad_()
        o, ht = cake_ops.chunk_gated_delta_rule(*_batched(i["q"], i["k"], i["v"], i["g"], i["beta"]),
                                                initial_state=h0, output_final_state=True,
                                                cu_seqlens=i["cu_seqlens"], **options)
        (o.square().sum() + (weights * (ht.transpose(-1, -2) if v_first else ht)).sum()).backward()
        return o, ht, h0.grad

    o, ht, dh0 = run(h0, False)
    o2, ht2, dh02 = run(h0.transpose(-1, -2), True, state_v_first=True)
    assert torch.equal(o2, o)
    assert ht2.is_contiguous() and torch.equal(ht2, ht.transpose(-1, -2))
    assert torch.equal(dh02, dh0.transpose(-1, -2))
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o3, ht3, dh03 = run(h0.transpose(-1, -2), True, transpose_state_layout=True)
    assert torch.equal(o3, o) and torch.equal(ht3, ht2) and torch.equal(dh03, dh02)
    with pytest.raises(ValueError, match="not both"):
        run(h0, True, state_v_first=True, transpose_state_layout=True)


def test_g_in_bf16_taken_as_fp32():
    i = _inputs("cpu", D=16)
    g16 = i["g"].bfloat16().requires_grad_()
    o, _ = cake_ops.chunk_gated_delta_rule(*_batched(i["q"], i["k"], i["v"], g16, i["beta"]),
                                           cu_seqlens=i["cu_seqlens"])
    o32, _ = cake_ops.gdn(i["q"], i["k"], i["v"], g16.detach().float(), i["beta"], i["cu_seqlens"])
    assert torch.equal(o[0], o32)
    o.float().square().sum().backward()
    assert g16.grad is not None and g16.grad.dtype == torch.bfloat16


def test_chunk_size_accepted_and_without_effect():
    i = _inputs("cpu", D=16)
    args = _batched(i["q"], i["k"], i["v"], i["g"], i["beta"])
    outs = [cake_ops.chunk_gated_delta_rule(*args, cu_seqlens=i["cu_seqlens"], chunk_size=c)[0] for c in (16, 32, 64)]
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])


def test_compiled_with_the_input_options_is_one_graph():
    """The gate and beta forms trace with the op into one graph, bitwise the eager step."""
    i = _inputs("cpu", D=16)

    def step(g_raw, A_log, dt_bias, beta_raw):
        o, _ = cake_ops.chunk_gated_delta_rule(
            *_batched(i["q"], i["k"], i["v"], g_raw, beta_raw), cu_seqlens=i["cu_seqlens"], use_gate_in_kernel=True,
            A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
        return o

    def grads(f):
        leaves = [i[n].clone().requires_grad_() for n in ("g_raw", "A_log", "dt_bias", "beta_raw")]
        o = f(*leaves)
        o.float().square().sum().backward()
        return [o] + [x.grad for x in leaves]

    eager = grads(step)
    torch._dynamo.reset()
    compiled = grads(torch.compile(step, fullgraph=True, backend="aot_eager"))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def _bad_calls():
    i = _inputs("cpu", D=16)
    yield "cp_context", ValueError, "cp_context", dict(cp_context=object())
    yield "unknown keyword", TypeError, "unexpected keyword argument 'use_gates'", dict(use_gates=True)
    yield "chunk_size", ValueError, "chunk_size must be 16, 32 or 64", dict(chunk_size=128)
    yield "head_first", ValueError, "head_first=True is not supported", dict(head_first=True)
    yield "g shape with the gate", ValueError, "g must be \\[B, T, HV\\]", dict(
        use_gate_in_kernel=True, A_log=i["A_log"], g=i["g"][:, :1][None])
    yield "A_log missing", ValueError, "A_log must be given", dict(use_gate_in_kernel=True)
    yield "A_log shape", ValueError, "A_log must have HV = 4", dict(use_gate_in_kernel=True, A_log=i["A_log"][:3])
    yield "dt_bias shape", ValueError, "dt_bias must have HV = 4", dict(
        use_gate_in_kernel=True, A_log=i["A_log"], dt_bias=i["dt_bias"][:1])
    yield "A_log without the gate", ValueError, "only with use_gate_in_kernel", dict(A_log=i["A_log"])
    yield "neg eigval without sigmoid", ValueError, "needs use_beta_sigmoid_in_kernel", dict(allow_neg_eigval=True)


@pytest.mark.parametrize("label, error, match, options", list(_bad_calls()), ids=[c[0] for c in _bad_calls()])
def test_refused_before_any_compute(label, error, match, options):
    i = _inputs("cpu", D=16)
    options = dict(options)
    g = options.pop("g", i["g"][None])  # a case's own g, else the inputs'
    with pytest.raises(error, match=match):
        cake_ops.chunk_gated_delta_rule(*_batched(i["q"], i["k"], i["v"]), g, i["beta"][None],
                                        cu_seqlens=i["cu_seqlens"], **options)


def test_positional_are_the_nine_fla_and_flashqla_share():
    """FLA 0.6.0 and FlashQLA 0.1.3 agree on their first nine parameters and differ after
    (FLA's tenth is use_beta_sigmoid_in_kernel, FlashQLA's cu_seqlens): those nine are
    positional, a tenth positional argument is a TypeError, and FlashQLA's own keywords
    (its intra-card CP knobs) are accepted."""
    import inspect

    params = inspect.signature(cake_ops.chunk_gated_delta_rule).parameters
    positional = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                          "use_qk_l2norm_in_kernel"]
    i = _inputs("cpu", D=16)
    args = _batched(i["q"], i["k"], i["v"], i["g"], i["beta"])
    with pytest.raises(TypeError, match="positional"):
        cake_ops.chunk_gated_delta_rule(*args, None, None, False, False, i["cu_seqlens"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, _ = cake_ops.chunk_gated_delta_rule(*args, None, None, False, False, cu_seqlens=i["cu_seqlens"],
                                               auto_cp=False, enable_fwd_cp_cache=False, force_intra_cp=True)
    assert torch.equal(o, cake_ops.chunk_gated_delta_rule(*args, cu_seqlens=i["cu_seqlens"])[0])

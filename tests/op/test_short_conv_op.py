"""The cake::short_conv_fwd / cake::short_conv_bwd ops through their public entries on
every device: accuracy against the FP64 reference, opcheck, input validation."""

import pytest
import torch

import cake_ops
from cake_ops.reference import short_conv_reference
from cake_ops.testing import poisoned_allocations

from cases import ShortConvCase, params
from conftest import DEVICES, assert_within_contract

CASES = [
    ShortConvCase("w4_silu_state_bf16", (1, 2, 3, 64, 65, 0, 7), 96, 4, bias=True, initial_state=True,
                  activation="silu", dtype=torch.bfloat16),
    ShortConvCase("w4_plain_fp32", (100, 1, 27), 40, 4, bias=False, initial_state=False, activation=None,
                  dtype=torch.float32),
    ShortConvCase("w3_silu_bf16", (5, 0, 33), 24, 3, bias=True, initial_state=False, activation="silu",
                  dtype=torch.bfloat16),
    ShortConvCase("w2_state_fp32", (1, 1, 1, 9), 16, 2, bias=False, initial_state=True, activation=None,
                  dtype=torch.float32),
    ShortConvCase("w1_bias_state_silu", (12, 4), 8, 1, bias=True, initial_state=True, activation="silu",
                  dtype=torch.float32),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", params(CASES))
def test_short_conv_accuracy(case, device):
    name, lengths, D, W = case.id, list(case.lengths), case.D, case.W
    has_bias, has_state, act, dtype = case.bias, case.initial_state, case.activation, case.dtype
    gen = torch.Generator().manual_seed(sum(lengths) * 31 + D)
    T, N = sum(lengths), len(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64, device=device)
    inputs = {
        "x": torch.randn(T, D, generator=gen).to(device, dtype),
        "weight": (torch.randn(D, W, generator=gen) / W**0.5).to(device, dtype),
        "bias": torch.randn(D, generator=gen).to(device, dtype) if has_bias else None,
        "initial_state": torch.randn(N, D, W - 1, generator=gen).to(device, dtype) if has_state else None,
    }
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items() if t is not None}
    with poisoned_allocations():
        y = cake_ops.short_conv(leaves["x"], leaves["weight"], leaves.get("bias"), cu,
                                initial_state=leaves.get("initial_state"), activation=act)
        dy = torch.randn(y.shape, generator=gen).to(device, dtype)
        y.backward(dy)
    ref = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    ry = short_conv_reference(ref["x"], ref["weight"], ref.get("bias"), cu, ref.get("initial_state"), act)
    ry.backward(dy.double())
    assert y.dtype == dtype and y.shape == (T, D)
    assert_within_contract("short_conv", {"y": (y, ry), **{"d" + n: (leaves[n].grad, ref[n].grad) for n in leaves}},
                           name)


def test_short_conv_documents_are_isolated():
    """Changing one document's tokens changes no other document's outputs."""
    cu = torch.tensor([0, 10, 25, 40])
    x = torch.randn(40, 8)
    w = torch.randn(8, 4)
    y = cake_ops.short_conv(x, w, None, cu, activation="silu")
    x2 = x.clone()
    x2[10:25] = torch.randn(15, 8)
    y2 = cake_ops.short_conv(x2, w, None, cu, activation="silu")
    assert torch.equal(y[:10], y2[:10]) and torch.equal(y[25:], y2[25:])
    assert not torch.equal(y[10:25], y2[10:25])


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

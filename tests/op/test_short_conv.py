"""Accuracy of cake::short_conv_fwd / cake::short_conv_bwd against the FP64 reference."""

import pytest
import torch

import cake_ops
from cake_ops.reference import short_conv_reference
from cake_ops.testing import accuracy, poisoned_allocations

from conftest import DEVICES, record_accuracy

# (id, lengths, D, W, bias, initial state, activation, dtype)
CASES = [
    ("w4_silu_state_bf16", [1, 2, 3, 64, 65, 0, 7], 96, 4, True, True, "silu", torch.bfloat16),
    ("w4_plain_fp32", [100, 1, 27], 40, 4, False, False, None, torch.float32),
    ("w3_silu_bf16", [5, 0, 33], 24, 3, True, False, "silu", torch.bfloat16),
    ("w2_state_fp32", [1, 1, 1, 9], 16, 2, False, True, None, torch.float32),
    ("w1_bias", [12, 4], 8, 1, True, True, "silu", torch.float32),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_short_conv_accuracy(case, device):
    name, lengths, D, W, has_bias, has_state, act, dtype = case
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
    failures = []
    for tname, (x, r) in {"y": (y, ry), **{"d" + n: (leaves[n].grad, ref[n].grad) for n in leaves}}.items():
        acc = accuracy(x, r)
        record_accuracy(f"short_conv {tname}", acc)
        if not acc.ok:
            failures.append(f"{tname}: {acc}")
    assert not failures, f"{name}: " + "; ".join(failures)


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

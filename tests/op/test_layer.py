"""cake_ops.GatedDeltaNet (the example layer: short conv + GDN) under torch.compile,
non-reentrant checkpointing and repeats."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import cake_ops

from conftest import DEVICES


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

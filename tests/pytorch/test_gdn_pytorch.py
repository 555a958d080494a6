"""The PyTorch implementation of the GDN ops (cake_ops.pytorch.gdn), forced on every
device with cake_ops.pytorch_implementation(): inputs at the edge of the math against
the FP64 reference."""

import pytest
import torch

import cake_ops
from cake_ops.pytorch import gdn as pytorch_gdn
from cake_ops.reference import gdn_reference
from cake_ops.testing import accuracy, poisoned_allocations

from cases import GdnCase
from conftest import DEVICES, record_accuracy

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def with_resets(inp, tokens):
    """g = -inf (a full reset, e^g = 0) at the given token positions, every value head."""
    g = inp["g"].clone()
    g[list(tokens)] = float("-inf")
    return {**inp, "g": g}


def forward_backward(inp, l2, device):
    leaves = {n: inp[n].clone().requires_grad_() for n in NAMES if inp[n] is not None}
    gen = torch.Generator().manual_seed(5)
    with poisoned_allocations():
        o, ht = cake_ops.gdn(*(leaves[n] for n in NAMES[:5]), inp["cu_seqlens"],
                             initial_state=leaves.get("initial_state"), output_final_state=True, use_qk_l2norm=l2)
        do = torch.randn(o.shape, generator=gen).to(device, o.dtype)
        dht = torch.randn(ht.shape, generator=gen).to(device)
        torch.autograd.backward([o, ht], [do, dht])
    ref = {n: t.detach().cpu().double().requires_grad_() for n, t in leaves.items()}
    ro, rht = gdn_reference(*(ref[n] for n in NAMES[:5]), inp["cu_seqlens"].cpu(),
                            initial_state=ref.get("initial_state"), use_qk_l2norm=l2)
    torch.autograd.backward([ro, rht], [do.cpu().double(), dht.cpu().double()])
    pairs = {"o": (o, ro), "final_state": (ht, rht)}
    pairs.update({"d" + ("h0" if n == "initial_state" else n): (leaves[n].grad, ref[n].grad) for n in leaves})
    return pairs


RESET = GdnCase("resets", (70, 150, 5), H=2, G=2, K=32, V=32, l2norm=True, initial_state=True)
# First token of a document, inside a chunk, a chunk's last and first tokens, two in a row.
RESET_TOKENS = (0, 30, 70 + 63, 70 + 64, 70 + 100, 70 + 101, 220)


@pytest.mark.parametrize("device", DEVICES)
def test_full_reset_gate_matches_the_recurrence(device):
    """g = -inf resets the state (e^g = 0): o, the final state and every gradient are the
    FP64 recurrence's, where the chunk cumsum alone would give NaN (-inf - -inf)."""
    inp = with_resets(RESET.inputs(device), RESET_TOKENS)
    with cake_ops.pytorch_implementation():
        pairs = forward_backward(inp, RESET.l2norm, device)
    for name, (x, ref) in pairs.items():
        acc = accuracy(x, ref)
        record_accuracy(f"pytorch gdn {name} (g = -inf)", acc)
        assert acc.ok, f"{name}: {acc}"
    assert torch.equal(pairs["dg"][0][list(RESET_TOKENS)], torch.zeros_like(pairs["dg"][0][list(RESET_TOKENS)]))


def test_reset_forgets_everything_before_it():
    """After a reset token the outputs do not depend on the tokens before it."""
    inp = with_resets(RESET.inputs(), (40,))
    o, _ = cake_ops.gdn(*(inp[n] for n in NAMES[:5]), inp["cu_seqlens"], use_qk_l2norm=True)
    changed = dict(inp, v=inp["v"].clone())
    changed["v"][:40] = torch.randn_like(changed["v"][:40])
    o2, _ = cake_ops.gdn(*(changed[n] for n in NAMES[:5]), inp["cu_seqlens"], use_qk_l2norm=True)
    assert torch.equal(o[40:70], o2[40:70]) and not torch.equal(o[:40], o2[:40])


def test_nan_gate_stays_nan():
    """The gate floor does not hide a NaN g: its document's outputs are NaN, others not."""
    inp = RESET.inputs()
    g = inp["g"].clone()
    g[80] = float("nan")
    o, _ = cake_ops.gdn(inp["q"], inp["k"], inp["v"], g, inp["beta"], inp["cu_seqlens"], use_qk_l2norm=True)
    assert torch.isnan(o[80:220].float()).any()
    assert torch.isfinite(o[:70].float()).all() and torch.isfinite(o[220:].float()).all()


def test_prepare_clamps_the_gate_to_the_floor():
    inp = with_resets(RESET.inputs(), (3,))
    prep, _ = pytorch_gdn.prepare(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"], True)
    assert torch.isfinite(prep.gcum).all() and torch.isfinite(prep.A).all()
    assert prep.gcum.min() >= pytorch_gdn.GATE_FLOOR * pytorch_gdn.CHUNK

"""``recompute_output`` under torch's checkpoint (cake_ops.checkpointing): the recompute
of a non-reentrant checkpoint launches no GDN forward where the GDN call's saves are the
region's last, and launches it in every other case, with the gradients bitwise the same
and the reason in ``gdn_diagnostics()``. Counts the forwards that really run (the
PyTorch path's function, or the CUDA extension's op), on both devices."""

import contextlib

import pytest
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import cake_ops
from cake_ops import build, checkpointing
from cake_ops.pytorch import gdn as pytorch_gdn
from cake_ops.testing import make_gdn_inputs

from conftest import DEVICES


def _inputs(device, initial_state):
    # The CUDA kernels take K = V = 128 and bf16 (the CPU runs the PyTorch path at any size).
    K = 128 if device == "cuda" else 32
    inp = make_gdn_inputs([100, 1, 37], 2, 4, K, K, initial_state=initial_state, device=device, seed=3)
    names = ("q", "k", "v", "g", "beta") + (("initial_state",) if initial_state else ())
    leaves = [inp[n].detach().requires_grad_(True) for n in names]
    return leaves, inp["cu_seqlens"]


@contextlib.contextmanager
def counting_forwards(monkeypatch):
    """Yields a list whose length is the number of GDN forwards computed so far."""
    calls = []
    real_pytorch = pytorch_gdn.gdn_fwd

    def pytorch_fwd(*a, **kw):
        calls.append("pytorch")
        return real_pytorch(*a, **kw)

    monkeypatch.setattr(pytorch_gdn, "gdn_fwd", pytorch_fwd)
    if build.available():
        real_load = build.load

        class Counted:
            def __init__(self, ops):
                self._ops = ops

            def __getattr__(self, name):
                fn = getattr(self._ops, name)
                if name not in ("gdn_fwd", "gdn_fwd_full"):
                    return fn

                def counted(*a, **kw):
                    calls.append("cuda")
                    return fn(*a, **kw)

                return counted

        monkeypatch.setattr(build, "load", lambda: Counted(real_load()))
    yield calls


def _region(cu, initial_state, later_saver=None, **options):
    def f(q, k, v, g, beta, *h0):
        o, ht = cake_ops.gdn(q, k, v, g, beta, cu, initial_state=h0[0] if h0 else None, use_qk_l2norm=True,
                             output_final_state=True, **options)
        o = o * 2.0  # saves nothing
        return (later_saver(o) if later_saver else o), ht

    return f


def _grads(fn, leaves, seed=0):
    # .backward(), not autograd.grad: the reentrant checkpoint takes only the former.
    for x in leaves:
        x.grad = None
    out, ht = fn(*leaves)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    do = torch.randn(out.shape, generator=gen).to(out)
    dht = torch.randn(ht.shape, generator=gen).to(ht)
    torch.autograd.backward((out, ht), (do, dht))
    return [x.grad for x in leaves]


def _bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("initial_state", [False, True])
def test_recompute_skipped_where_gdn_closes_the_region(device, initial_state, monkeypatch):
    leaves, cu = _inputs(device, initial_state)
    plain = _grads(_region(cu, initial_state), leaves)
    with counting_forwards(monkeypatch) as calls:
        always = _grads(lambda *x: checkpoint(_region(cu, initial_state, recompute_output="always"), *x,
                                              use_reentrant=False), leaves)
        assert len(calls) == 2 and cake_ops.gdn_diagnostics()["recompute_output"] == "launched"
        calls.clear()
        auto = _grads(lambda *x: checkpoint(_region(cu, initial_state), *x, use_reentrant=False), leaves)
        assert len(calls) == 1, calls  # the first forward only
        assert cake_ops.gdn_diagnostics() == {"recompute_output": "skipped", "why": ""}
    _bitwise(auto, always)
    _bitwise(auto, plain)


def _launched(fn, leaves, monkeypatch, reason):
    with counting_forwards(monkeypatch) as calls:
        grads = _grads(fn, leaves)
    diag = cake_ops.gdn_diagnostics()
    assert len(calls) == 2 and diag["recompute_output"] == "launched", (calls, diag)
    assert reason in diag["why"], diag
    return grads


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_launched_where_a_later_op_saves(device, monkeypatch):
    leaves, cu = _inputs(device, False)
    w = torch.randn(leaves[2].shape[-1], device=device, dtype=leaves[2].dtype)
    f = _region(cu, False, later_saver=lambda o: o * w.requires_grad_(True))  # saves o and w
    got = _launched(lambda *x: checkpoint(f, *x, use_reentrant=False), leaves, monkeypatch, "a later op")
    _bitwise(got, _grads(f, leaves))


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_launched_in_the_other_cases(device, monkeypatch):
    leaves, cu = _inputs(device, False)
    f = _region(cu, False)
    plain = _grads(f, leaves)
    with set_checkpoint_early_stop(False):
        got = _launched(lambda *x: checkpoint(f, *x, use_reentrant=False), leaves, monkeypatch, "early stop")
    _bitwise(got, plain)
    got = _launched(lambda *x: checkpoint(f, *x, use_reentrant=True), leaves, monkeypatch,
                    "not inside a non-reentrant checkpoint recompute")
    _bitwise(got, plain)
    monkeypatch.setattr(checkpointing, "VERIFIED_TORCH", ("0.1",))
    got = _launched(lambda *x: checkpoint(f, *x, use_reentrant=False), leaves, monkeypatch, "not a release")
    _bitwise(got, plain)
    monkeypatch.undo()
    got = _launched(lambda *x: checkpoint(_region(cu, False, save_mode="full"), *x, use_reentrant=False), leaves,
                    monkeypatch, "save_mode='full'")
    _bitwise(got, plain)


def test_this_torch_is_a_verified_release():
    """CI's torch (and the GPU machine's, in the GPU run) must be one whose frame the
    proof reads; a new torch needs its checkpoint.py read and added to VERIFIED_TORCH."""
    assert checkpointing.torch_release() in checkpointing.VERIFIED_TORCH


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_output_diagnostics_outside_a_recompute(device):
    leaves, cu = _inputs(device, False)
    cake_ops.gdn(*leaves, cu)
    assert "not inside a non-reentrant checkpoint recompute" in cake_ops.gdn_diagnostics()["why"]
    checkpoint(_region(cu, False), *leaves, use_reentrant=False)
    assert "first forward" in cake_ops.gdn_diagnostics()["why"]
    with torch.no_grad():
        cake_ops.gdn(*leaves, cu)
    assert "saves no tensors" in cake_ops.gdn_diagnostics()["why"]


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_output_refused_before_any_compute(device, monkeypatch):
    leaves, cu = _inputs(device, False)
    with counting_forwards(monkeypatch) as calls:
        with pytest.raises(ValueError, match="recompute_output"):
            cake_ops.gdn(*leaves, cu, recompute_output="never")
        with pytest.raises(ValueError, match="recompute_output"):
            cake_ops.chunk_gated_delta_rule(*(x[None] for x in leaves), cu_seqlens=cu, recompute_output=True)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="recompute_output must be one of"):  # Dynamo may wrap the ValueError
            torch.compile(lambda *x: cake_ops.gdn(*x, cu, recompute_output="sometimes")[0], fullgraph=True,
                          backend="aot_eager")(*leaves)
    assert calls == []


def test_compiled_checkpointed_step_launches_and_matches_eager(monkeypatch):
    """Traced by torch.compile the proof is never read (the frame is the compiler's):
    a compiled, checkpointed step gives the eager gradients."""
    leaves, cu = _inputs("cpu", False)
    f = _region(cu, False)
    eager = _grads(lambda *x: checkpoint(f, *x, use_reentrant=False), leaves)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *x: checkpoint(f, *x, use_reentrant=False), fullgraph=True, backend="aot_eager")
    got = _grads(compiled, leaves)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_graph_option_checked_and_recompute_launches_under_replay(device):
    """graph="replay" is validated up front like every option; under a checkpoint it
    launches the recompute (the issue's rule), with the gradients unchanged. On the CPU
    the PyTorch path ignores it."""
    leaves, cu = _inputs(device, False)
    with pytest.raises(ValueError, match="graph must be one of"):
        cake_ops.gdn(*leaves, cu, graph="always")
    f = _region(cu, False, graph="replay")
    got = _grads(lambda *x: checkpoint(f, *x, use_reentrant=False), leaves)
    assert cake_ops.gdn_diagnostics() == {"recompute_output": "launched", "why": "graph='replay'"}
    _bitwise(got, _grads(_region(cu, False), leaves))

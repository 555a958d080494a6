"""``recompute_output`` under torch's checkpoint (cake_ops.checkpointing): the recompute
of a non-reentrant checkpoint launches no GDN forward where the GDN call's saves are the
region's last, and launches it in every other case, with the gradients bitwise the same
and the reason in ``gdn_diagnostics()``. Counts the forwards that really run (the
PyTorch path's function, or the CUDA extension's op), on both devices."""

import contextlib
import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import cake_ops
from cake_ops import build, checkpointing
from cake_ops.ops import gdn as gdn_ops
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
    """Yields a list whose length is the number of GDN forwards computed so far: "pytorch",
    or the CUDA extension's op ("gdn_fwd", "gdn_fwd_full"); and on the CUDA extension, per
    backward, "bwd kept" or "bwd recomputed" (whether it was given tapes)."""
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
                if name == "gdn_bwd":
                    def counted_bwd(*a):
                        # a[15]: the tapes (csrc/gdn/binding.cpp's gdn_bwd schema)
                        calls.append("bwd " + ("recomputed" if a[15] is None else "kept"))
                        return fn(*a)

                    return counted_bwd
                if name not in ("gdn_fwd", "gdn_fwd_full"):
                    return fn

                def counted(*a, **kw):
                    calls.append(name)
                    return fn(*a, **kw)

                return counted

        monkeypatch.setattr(build, "load", lambda: Counted(real_load()))
    yield calls


def forwards(calls):
    return [c for c in calls if not c.startswith("bwd")]


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
        assert len(forwards(calls)) == 2 and cake_ops.gdn_diagnostics()["recompute_output"] == "launched"
        calls.clear()
        auto = _grads(lambda *x: checkpoint(_region(cu, initial_state), *x, use_reentrant=False), leaves)
        assert len(forwards(calls)) == 1, calls  # the first forward only
        assert cake_ops.gdn_diagnostics() == {"recompute_output": "skipped", "why": "", "tapes": "recomputed",
                                              "tapes_why": "the recompute launches nothing"}
    _bitwise(auto, always)
    _bitwise(auto, plain)


def _launched(fn, leaves, monkeypatch, reason):
    with counting_forwards(monkeypatch) as calls:
        grads = _grads(fn, leaves)
    diag = cake_ops.gdn_diagnostics()
    assert len(forwards(calls)) == 2 and diag["recompute_output"] == "launched", (calls, diag)
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
                    "not inside a non-reentrant checkpoint")
    _bitwise(got, plain)
    monkeypatch.setattr(checkpointing, "VERIFIED_TORCH", ("0.1",))
    got = _launched(lambda *x: checkpoint(f, *x, use_reentrant=False), leaves, monkeypatch, "not a release")
    _bitwise(got, plain)
    monkeypatch.undo()


def test_this_torch_is_a_verified_release():
    """CI's torch (and the GPU machine's, in the GPU run) must be one whose frame the
    proof reads; a new torch needs its checkpoint.py read and added to VERIFIED_TORCH."""
    assert checkpointing.torch_release() in checkpointing.VERIFIED_TORCH


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_output_diagnostics_outside_a_recompute(device):
    leaves, cu = _inputs(device, False)
    cake_ops.gdn(*leaves, cu)
    assert "not inside a non-reentrant checkpoint" in cake_ops.gdn_diagnostics()["why"]
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


def threading_run(fn):
    """fn() in a new thread (whose thread-local state no earlier test has set); its result,
    or its exception raised here."""
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_compiled_checkpointed_step_matches_eager():
    """Traced by torch.compile the proof is never read (the frame is the compiler's, and
    its partitioner decides what the backward recomputes: with torch 2.13's aot_eager the
    GDN forward runs once): a compiled, checkpointed step gives the eager gradients.
    Compiled first, in a thread whose per-call flags no eager call has set yet (as the
    example's first step): a write to them inside the checkpoint region was a side effect
    Dynamo refused (fullgraph)."""
    leaves, cu = _inputs("cpu", False)
    f = _region(cu, False)
    torch._dynamo.reset()
    got = threading_run(lambda: _grads(torch.compile(lambda *x: checkpoint(f, *x, use_reentrant=False),
                                                     fullgraph=True, backend="aot_eager"), leaves))
    eager = _grads(lambda *x: checkpoint(f, *x, use_reentrant=False), leaves)
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
    assert cake_ops.gdn_diagnostics() == {"recompute_output": "launched", "why": "graph='replay'",
                                          "tapes": "recomputed", "tapes_why": "reuse_recompute_tapes=False"}
    _bitwise(got, _grads(_region(cu, False), leaves))


# reuse_recompute_tapes: the recompute writes the tapes for the backward (CUDA kernels only:
# the PyTorch implementation keeps none, and says so).

def _later_saver(device, dtype):
    w = torch.randn(128 if device == "cuda" else 32, device=device, dtype=dtype).requires_grad_(True)
    return lambda o: o * w  # saves o and w


def _checkpointed(f):
    return lambda *x: checkpoint(f, *x, use_reentrant=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("later", [False, True])
@pytest.mark.parametrize("reuse", ["auto", True, False])
def test_recompute_tapes_kept_or_recomputed(device, later, reuse, monkeypatch):
    """Where the recompute launches (recompute_output="always", or a later saver), True
    keeps its tapes for the backward; "auto" keeps them only where the call closes the
    region and keeping peaks no higher (the rule of _kept_tapes_peak); False never.
    Gradients bitwise the plain call's in every case."""
    leaves, cu = _inputs(device, True)
    saver = _later_saver(device, leaves[2].dtype) if later else None
    plain = _grads(_region(cu, True, later_saver=saver), leaves)
    f = _region(cu, True, later_saver=saver, recompute_output="always", reuse_recompute_tapes=reuse)
    with counting_forwards(monkeypatch) as calls:
        got = _grads(_checkpointed(f), leaves)
    diag = cake_ops.gdn_diagnostics()
    _bitwise(got, plain)
    if device == "cpu":
        assert calls == ["pytorch", "pytorch"] and diag["tapes"] == "recomputed", (calls, diag)
        assert diag["tapes_why"] == ("reuse_recompute_tapes=False" if reuse is False else
                                     "the PyTorch implementation keeps no tapes")
        return
    if reuse == "auto" and not later:
        kept_bytes, recomputed_bytes = gdn_ops._kept_tapes_peak(leaves[0], leaves[2], cu, True, True)
        keep = kept_bytes <= recomputed_bytes
    else:
        keep = reuse is True
    assert calls == (["gdn_fwd", "gdn_fwd_full", "bwd kept"] if keep else ["gdn_fwd", "gdn_fwd", "bwd recomputed"]), \
        (calls, diag)
    assert diag["tapes"] == ("kept" if keep else "recomputed"), diag
    if later and reuse == "auto":
        assert "kept tapes would live through its backward" in diag["tapes_why"], diag


@pytest.mark.parametrize("device", DEVICES)
def test_one_kept_tapes_set_per_region(device, monkeypatch):
    """With True and two GDN calls in one region, the later call frees the earlier one's
    kept tapes: its backward (first) reads its own, the earlier one recomputes."""
    leaves, cu = _inputs(device, False)

    def two(recompute_output="auto", reuse=None):
        def f(q, k, v, g, beta):
            o1, _ = cake_ops.gdn(q, k, v, g, beta, cu, use_qk_l2norm=True, recompute_output=recompute_output,
                                 reuse_recompute_tapes=reuse)
            o2, _ = cake_ops.gdn(q, k, o1, g, beta, cu, use_qk_l2norm=True, recompute_output=recompute_output,
                                 reuse_recompute_tapes=reuse)
            return o2, o1.sum(dim=(0, 1)).float()

        return f

    plain = _grads(two(), leaves)
    with counting_forwards(monkeypatch) as calls:
        got = _grads(_checkpointed(two("always", True)), leaves)
    _bitwise(got, plain)
    if device == "cuda":
        assert calls == ["gdn_fwd", "gdn_fwd", "gdn_fwd_full", "gdn_fwd_full", "bwd kept", "bwd recomputed"], calls


@pytest.mark.parametrize("device", DEVICES)
def test_full_save_mode_under_a_checkpoint(device, monkeypatch):
    """save_mode="full" in a checkpoint: the first run keeps nothing (torch drops its
    saves: it runs the light forward), a closing recompute launches nothing
    (recompute_output="auto"), a launching one keeps its tapes."""
    leaves, cu = _inputs(device, False)
    plain = _grads(_region(cu, False), leaves)
    cuda = device == "cuda"
    saver = _later_saver(device, leaves[2].dtype)
    plain_later = _grads(_region(cu, False, later_saver=saver), leaves)
    with counting_forwards(monkeypatch) as calls:
        got = _grads(_checkpointed(_region(cu, False, save_mode="full")), leaves)
        _bitwise(got, plain)
        assert calls == (["gdn_fwd", "bwd recomputed"] if cuda else ["pytorch"]), calls
        assert cake_ops.gdn_diagnostics()["recompute_output"] == "skipped"
        calls.clear()
        got = _grads(_checkpointed(_region(cu, False, later_saver=saver, save_mode="full")), leaves)
        _bitwise(got, plain_later)
        assert calls == (["gdn_fwd", "gdn_fwd_full", "bwd kept"] if cuda else ["pytorch", "pytorch"]), calls


@pytest.mark.parametrize("device", DEVICES)
def test_reuse_recompute_tapes_refused_before_any_compute(device, monkeypatch):
    leaves, cu = _inputs(device, False)
    cases = [(dict(reuse_recompute_tapes="yes"), "reuse_recompute_tapes must be one of"),
             (dict(reuse_recompute_tapes=1), "reuse_recompute_tapes must be one of"),
             (dict(reuse_recompute_tapes=True, graph="replay"), "cannot be used with graph='replay'"),
             (dict(reuse_recompute_tapes="auto", graph="replay"), "cannot be used with graph='replay'"),
             (dict(reuse_recompute_tapes=False, save_mode="full"), "contradicts save_mode='full'")]
    with counting_forwards(monkeypatch) as calls:
        for options, message in cases:
            with pytest.raises(ValueError, match=message):
                cake_ops.gdn(*leaves, cu, **options)
        with pytest.raises(ValueError, match="reuse_recompute_tapes"):
            cake_ops.chunk_gated_delta_rule(*(x[None] for x in leaves), cu_seqlens=cu, reuse_recompute_tapes=2)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="cannot be used with graph='replay'"):  # Dynamo may wrap it
            torch.compile(lambda *x: cake_ops.gdn(*x, cu, graph="replay", reuse_recompute_tapes=True)[0],
                          fullgraph=True, backend="aot_eager")(*leaves)
    assert calls == []


@pytest.mark.gpu
def test_kept_tapes_peak_no_higher_where_gdn_closes_the_region():
    """The issue's rule for "auto": with the GDN call closing the region, the backward's
    allocator peak with "auto" is no higher than with False (recompute_output="always",
    so the recompute launches), at a shape whose light backward runs in one head slice
    and one where it runs in two. The peak of requested bytes (as the byte queries'
    tests): the allocated bytes also count what the cache state rounds up (a cached block
    is handed out unsplit when less than 1 MiB of it is left), which earlier tests in the
    same process move by up to a block either way."""
    for lengths, H in (([3000, 1000, 96], 4), ([40000], 16)):
        inp = make_gdn_inputs(lengths, H, 3 * H, 128, 128, device="cuda", seed=5)
        leaves = [inp[n].detach().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
        cu = inp["cu_seqlens"]
        peaks, grads = {}, {}
        for reuse in ("auto", False):
            f = _region(cu, False, recompute_output="always", reuse_recompute_tapes=reuse)
            out, ht = _checkpointed(f)(*leaves)
            gen = torch.Generator(device="cuda").manual_seed(1)
            do = torch.randn(out.shape, device="cuda", generator=gen).to(out)
            dht = torch.randn(ht.shape, device="cuda", generator=gen)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_stats()["requested_bytes.all.current"]
            grads[reuse] = torch.autograd.grad((out, ht), leaves, (do, dht))
            torch.cuda.synchronize()
            peaks[reuse] = torch.cuda.memory_stats()["requested_bytes.all.peak"] - base
            del out, ht
        assert peaks["auto"] <= peaks[False], (lengths, H, peaks)
        _bitwise(grads["auto"], grads[False])


@pytest.mark.parametrize("device", DEVICES)
def test_tapes_stand_in_allocates_nothing(device):
    """The stand-in a run saves in the tapes' slot where it keeps none has the tapes'
    metadata ([n] uint8 on the call's device) and views the first byte of q, even a strided
    q: a byte of its own would hold an allocator block through the backward (the kept-tapes
    peak rule above). The backward reads it as no tapes."""
    q = torch.randn(40, 4, 16, device=device).to(torch.bfloat16)[5:, ::2]
    s = gdn_ops.stand_in_over(q, 123456)
    assert s.shape == (123456,) and s.dtype == torch.uint8 and s.device == q.device and s.stride() == (0,)
    assert s.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
    assert s.data_ptr() == q.data_ptr() and not checkpointing.kept(s)
    assert gdn_ops.stand_in_over(q[:0], 7).shape == (7,) and gdn_ops.stand_in_over(q, 0).numel() == 0

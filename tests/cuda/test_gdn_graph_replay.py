"""``graph="replay"`` (cake_ops.graphs): a GDN forward+backward replayed from the CUDA
graphs of its own launches gives the eager call's bits, on fresh inputs of the same
shapes (other values, other cu_seqlens values), in both save modes; keys are evicted
least recently used; inside the caller's own capture the op launches into it."""

import pytest
import torch

import cake_ops
from cake_ops import graphs
from cake_ops.testing import make_gdn_inputs

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _step(inp, do, dht, **options):
    leaves = [inp[n].detach().clone().requires_grad_(True) for n in NAMES]
    o, ht = cake_ops.gdn(*leaves[:5], inp["cu_seqlens"], initial_state=leaves[5], use_qk_l2norm=True,
                         output_final_state=True, **options)
    grads = torch.autograd.grad((o, ht), leaves, (do, dht))
    return [o, ht, *grads]


def _inputs(lengths, seed):
    inp = make_gdn_inputs(lengths, 2, 6, 128, 128, initial_state=True, device="cuda", seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    do = torch.randn(inp["v"].shape, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(inp["initial_state"].shape, device="cuda", generator=gen)
    return inp, do, dht


@pytest.mark.gpu
@pytest.mark.parametrize("save_mode", ["light", "full"])
def test_replay_gives_the_eager_bits(save_mode):
    graphs.clear()
    # The same shapes (T = 4330, N = 3) with other document lengths, so other cu_seqlens values.
    for seed, lengths in enumerate(([4096, 200, 34], [100, 4000, 230], [4096, 200, 34], [1, 1, 4328])):
        inp, do, dht = _inputs(lengths, seed)
        eager = _step(inp, do, dht, save_mode=save_mode)
        replayed = _step(inp, do, dht, save_mode=save_mode, graph="replay")
        for a, b in zip(eager, replayed):
            assert torch.equal(a, b), (seed, lengths)
    assert graphs.keys() == 2  # one forward and one backward key


@pytest.mark.gpu
def test_replay_evicts_the_least_recent_key(monkeypatch):
    graphs.clear()
    monkeypatch.setattr(graphs, "MAX_KEYS", 1)
    for seed, lengths in enumerate(([300, 64], [1000, 5, 70], [300, 64])):
        inp, do, dht = _inputs(lengths, seed)
        eager = _step(inp, do, dht)
        for a, b in zip(eager, _step(inp, do, dht, graph="replay")):
            assert torch.equal(a, b)
        assert graphs.keys() == 1
    graphs.clear()


@pytest.mark.gpu
def test_replay_inside_a_capture_launches_into_it():
    graphs.clear()
    inp, do, dht = _inputs([500, 70], 3)
    leaves = [inp[n].detach() for n in NAMES[:5]]
    eager = cake_ops.gdn(*leaves, inp["cu_seqlens"], use_qk_l2norm=True)[0]
    cake_ops.gdn(*leaves, inp["cu_seqlens"], use_qk_l2norm=True, graph="replay")  # warm: the key exists
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cake_ops.gdn(*leaves, inp["cu_seqlens"], use_qk_l2norm=True, graph="replay")[0]
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    graphs.clear()

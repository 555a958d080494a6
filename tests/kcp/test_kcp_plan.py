"""The KCP plan without communication: every layout's fragments tile the global tokens
exactly once, each inside one document, in token order per rank; option errors name
the argument (a one-rank gloo group in this process)."""

import random

import pytest
import torch
import torch.distributed as dist

from cake_ops.kcp import LAYOUTS, build_context_kcp, gdn_kcp, short_conv_kcp
from cake_ops.kcp.context import _fragments, _held_ranges


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_fragments_tile_the_tokens(layout, world):
    rng = random.Random(world)
    for _ in range(20):
        lengths = [rng.choice([0, 1, 2, 5, 63, 64, 65, 300]) for _ in range(rng.randint(1, 6))]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        seen = []
        for r, held in enumerate(_held_ranges(cu, world, layout)):
            frags = _fragments(cu, held)
            assert [f.start for f in frags] == sorted(f.start for f in frags)
            for f in frags:
                if f.doc < 0:
                    assert f.tokens == 0 and len(frags) == 1
                    continue
                assert cu[f.doc] <= f.start < f.end <= cu[f.doc + 1], (layout, cu, f)
                seen += range(f.start, f.end)
        assert sorted(seen) == list(range(cu[-1])), (layout, world, cu)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_aligned_cuts_sit_on_the_grid(layout, world):
    """With align, every fragment edge inside a document is a multiple of align tokens
    from the document's start; the fragments still tile the tokens; align=1 is the
    layout's exact cuts."""
    rng = random.Random(10 + world)
    for _ in range(20):
        lengths = [rng.choice([0, 1, 300, 4096, 5000, 13000, 40000]) for _ in range(rng.randint(1, 5))]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        assert _held_ranges(cu, world, layout, 1) == _held_ranges(cu, world, layout)
        seen = []
        for held in _held_ranges(cu, world, layout, 4096):
            for f in _fragments(cu, held):
                if f.doc < 0:
                    continue
                for edge in (f.start, f.end):
                    assert edge in (cu[f.doc], cu[f.doc + 1]) or (edge - cu[f.doc]) % 4096 == 0, (layout, cu, f)
                seen += range(f.start, f.end)
        assert sorted(seen) == list(range(cu[-1])), (layout, world, cu)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_kcp_errors_name_the_argument(one_rank_group):
    with pytest.raises(ValueError, match="layout must be one of"):
        build_context_kcp([0, 10], layout="X")
    with pytest.raises(ValueError, match="conv_width"):
        build_context_kcp([0, 10], conv_width=5)
    with pytest.raises(ValueError, match="cu_seqlens_global"):
        build_context_kcp([0, 10, 5])
    with pytest.raises(ValueError, match="graph_replay=True needs an NCCL group.*'gloo'"):
        build_context_kcp([0, 10], graph_replay=True)
    with pytest.raises(ValueError, match="graph_replay must be True or False"):
        build_context_kcp([0, 10], graph_replay="yes")
    with pytest.raises(ValueError, match="align must be an int >= 1"):
        build_context_kcp([0, 10], align=0)
    ctx = build_context_kcp([0, 6, 10], conv_width=3, align=1)
    q = torch.randn(10, 1, 8)
    v, g, b = torch.randn(10, 1, 8), -torch.rand(10, 1), torch.rand(10, 1)
    with pytest.raises(ValueError, match="q must hold this rank's 10 tokens"):
        gdn_kcp(q[:9], q[:9], v[:9], g[:9], b[:9], ctx)
    with pytest.raises(TypeError, match="ctx must be a KcpContext"):
        gdn_kcp(q, q, v, g, b, None)
    with pytest.raises(ValueError, match="initial_state must have the context's 2 documents"):
        gdn_kcp(q, q, v, g, b, ctx, initial_state=torch.zeros(3, 1, 8, 8))
    with pytest.raises(ValueError, match="save_mode"):
        gdn_kcp(q, q, v, g, b, ctx, save_mode="some")
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="segments must be None .* or an int >= 1"):
            gdn_kcp(q, q, v, g, b, ctx, segments=bad)
    # The PyTorch path walks uncut whatever the grid: segments changes nothing there.
    assert torch.equal(gdn_kcp(q, q, v, g, b, ctx, segments=2)[0], gdn_kcp(q, q, v, g, b, ctx)[0])
    with pytest.raises(ValueError, match="exchange must be one of"):
        gdn_kcp(q, q, v, g, b, ctx, exchange="tree")
    with pytest.raises(ValueError, match="exchange='ring' requires save_transfer=False"):
        gdn_kcp(q, q, v, g, b, ctx, exchange="ring")
    with pytest.raises(ValueError, match="save_transfer must be True or False"):
        gdn_kcp(q, q, v, g, b, ctx, save_transfer="yes")
    with pytest.raises(ValueError, match="conv_width W = 3"):
        short_conv_kcp(torch.randn(10, 4), torch.randn(4, 4), None, ctx)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        short_conv_kcp(torch.randn(10, 4), torch.randn(4, 3), None, ctx, initial_state=torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match="x must have this rank's 10 local rows"):
        ctx.gather(torch.randn(9, 4))


@pytest.mark.parametrize("HV, want", [(2, [8, 4, 4, 8, 4]), (6, [8, 4, 8, 8, 4]), (42, [8, 8, 8, 8, 4]),
                                     (43, [8, 8, 8, 8, 8])])
def test_grid_flags_give_each_fragment_its_documents_class(one_rank_group, HV, want):
    """``SubBatch.grid_flags``: the deterministic CUDA plan halves the grid of a document
    of 129 .. long_max chunks, long_max = 64 (ceil(128 / HV) - 1) (4032 at HV = 2, 1344 at
    HV = 6, none from HV = 43); here 300, 20480, 89600, 8192 and 8193 tokens (5, 320, 1400,
    128 and 129 chunks), whole documents on one rank, so no edge bits."""
    ctx = build_context_kcp([0, 300, 20780, 110380, 118572, 126765], one_rank_group)
    flags = ctx.chain_tables(torch.device("cpu")).rest.grid_flags(HV)
    assert flags.dtype == torch.uint8 and flags.tolist() == want

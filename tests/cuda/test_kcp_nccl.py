"""KCP over NCCL with one process a GPU (issue 21): the checks that tests/cuda/test_kcp_cuda.py
runs on rank threads of one GPU, here on `world` GPUs (2, 4 and 8, as many as the machine
has; each case is skipped where it has fewer): every rank's outputs and gradients against
the single-GPU op of the global batch within the contract and bitwise across the forms
(save modes, exchanges, save_transfer), in layouts C, Z and D; deterministic KCP bitwise
the single-GPU deterministic op; a whole KCP training step bitwise the same eager, traced
by torch.compile(fullgraph=True) and replayed from a CUDA graph. Each rank computes the
single-GPU results itself, on its own GPU (the same bits on each). NVLink multicast stays
off (cake_ops.testing.NO_NVLINK_MULTICAST)."""

import pytest
import torch
import torch.distributed as dist

from cake_ops.kcp import GRID_ALIGN, build_context_kcp, gdn_kcp
from cake_ops.testing import make_gdn_inputs, poisoned_allocations

from cases import replay_and_eager
from distributed import run_nccl_ranks
from test_kcp_cuda import NAMES, _bitwise_case, _case, _single_gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [pytest.param(w, marks=pytest.mark.skipif(GPUS < w, reason=f"needs {w} GPUs, the machine has {GPUS}"))
          for w in (2, 4, 8)]


def _against_the_single_gpu_op(rank, world, check, layout, lengths, H, HV, seed):
    """test_kcp_cuda's ``_case`` (check "contract") or ``_bitwise_case`` ("bits") on this
    rank, after the single-GPU op of the global batch on this rank's GPU."""
    single = _single_gpu(lengths, H, HV, seed, fp64=check == "contract")
    with poisoned_allocations():
        {"contract": _case, "bits": _bitwise_case}[check](rank, world, layout, lengths, H, HV, seed, single)


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", ["C", "Z", "D"])
def test_kcp_over_nccl_matches_the_single_gpu_op(world, layout):
    # Documents crossing every rank boundary at CP 8 too (T = 40,000: 5,000 tokens a rank).
    run_nccl_ranks(_against_the_single_gpu_op, world, "contract", layout, [12000, 65, 1, 9000, 300, 18634], 2, 6,
                   100 + world)


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", ["C", "Z", "D"])
def test_deterministic_kcp_over_nccl_is_the_single_gpu_bits(world, layout):
    """On a grid-aligned context (align=GRID_ALIGN): documents of two ranks or more (relays
    at the higher degrees), the half grid's class (20,480 tokens at HV = 6) among them."""
    run_nccl_ranks(_against_the_single_gpu_op, world, "bits", layout, [20480, 300, 24576, 65, 1, 16384, 4096], 2, 6,
                   200 + world)


def _step_case(rank, world, layout):
    lengths, H, HV = [9000, 65, 1, 12000, 300, 7000], 2, 6
    ctx = build_context_kcp(make_gdn_inputs(lengths, H, HV, 128, 128)["cu_seqlens"], layout=layout, device="cuda",
                            align=GRID_ALIGN)

    def batch(seed):
        inp = make_gdn_inputs(lengths, H, HV, 128, 128, initial_state=True, device="cuda", seed=seed)
        gen = torch.Generator(device="cuda").manual_seed(seed + 1)
        local = {n: ctx.shard(inp[n]).contiguous() for n in NAMES[:5]}
        local["initial_state"] = inp["initial_state"]
        local["do"] = torch.randn(local["v"].shape, device="cuda", generator=gen).bfloat16()
        local["dht"] = torch.randn(inp["initial_state"].shape, device="cuda", generator=gen) * (rank == 0)
        return local

    def layer(q, k, v, g, beta, h0):
        return gdn_kcp(q, k, v, g, beta, ctx, initial_state=h0, output_final_state=True, use_qk_l2norm=True)

    def step(fn):
        def run(x):
            leaves = [x[n].detach().requires_grad_(True) for n in NAMES]
            o, ht = fn(*leaves)
            return [o, ht, *torch.autograd.grad((o, ht), leaves, (x["do"], x["dht"]))]
        return run

    static, fresh = batch(300), batch(301)
    eager = step(layer)(fresh)
    torch._dynamo.reset()
    # aot_eager: the traced graph as one, each op eager, so the bits can be compared.
    compiled = step(torch.compile(layer, fullgraph=True, backend="aot_eager"))(fresh)
    replayed, again = replay_and_eager(step(layer), static, fresh)
    for name, got in (("compiled", compiled), ("replayed", replayed), ("eager again", again)):
        for i, (a, b) in enumerate(zip(got, eager)):
            assert torch.equal(a, b), f"{name} output {i} differs from eager (rank {rank}/{world})"
    dist.barrier()


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", ["Z", "C"])  # C: rank 0 holds no sink (collectives' ``after``)
def test_kcp_training_step_over_nccl_compiles_and_replays_bitwise(world, layout):
    run_nccl_ranks(_step_case, world, layout)

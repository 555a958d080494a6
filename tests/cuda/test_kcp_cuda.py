"""KCP on the CUDA kernels: several ranks as threads of one process on one GPU (torch's
threaded process group), bf16 with K = V = 128, GVA, documents crossing rank boundaries,
layouts C, Z and D: each rank's outputs and gradients against the single-GPU
``cake_ops.gdn`` of the global batch (within the accuracy contract: the chain's fp32
states replace the single-GPU cut grid's), the final states against the FP64
reference, bitwise the same on a repeat and in the full save mode, with NaN-poisoned
allocations."""

import pytest
import torch
import torch.distributed as dist

import cake_ops
from cake_ops.kcp import build_context_kcp, gdn_kcp
from cake_ops.reference import gdn_reference
from cake_ops.testing import accuracy, make_gdn_inputs, poisoned_allocations

from conftest import record_accuracy
from cake_ops.testing import run_rank_threads

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _case(rank, world, layout, lengths, H, HV, seed, single):
    inp = make_gdn_inputs(lengths, H, HV, 128, 128, initial_state=True, device="cuda", seed=seed)
    ctx = build_context_kcp(inp["cu_seqlens"].cpu(), layout=layout, device="cuda")
    do, dht, refs, ht64 = single

    def run(save_mode="light"):
        local = [ctx.shard(inp[n]).clone().requires_grad_(True) for n in NAMES[:5]]
        h0 = inp["initial_state"].clone().requires_grad_(True)
        o, ht = gdn_kcp(*local, ctx, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                        save_mode=save_mode)
        grads = torch.autograd.grad((o, ht), local + [h0], (ctx.shard(do), dht if rank == 0 else torch.zeros_like(dht)))
        return [o, ht, *grads]

    got = run()
    where = f"layout {layout}, lengths {lengths}, rank {rank}/{world}"
    names = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta")
    for name, g_, r_ in zip(names, got, refs):
        acc = accuracy(g_, r_ if name == "final_state" else ctx.shard(r_))
        record_accuracy(f"kcp {name} vs single GPU", acc)
        assert acc.ok, (name, where, acc)
    dh0 = got[7].clone()
    dist.all_reduce(dh0)
    acc = accuracy(dh0, refs[7])
    record_accuracy("kcp dh0 vs single GPU", acc)
    assert acc.ok, ("dh0", where, acc)
    assert accuracy(got[1], ht64).ok, where
    for a, b in zip(got, run()):
        assert torch.equal(a, b), f"not bitwise on a repeat ({where})"
    for a, b in zip(got, run("full")):
        assert torch.equal(a, b), f"the full save mode differs from the light one ({where})"


def _single_gpu(lengths, H, HV, seed):
    inp = make_gdn_inputs(lengths, H, HV, 128, 128, initial_state=True, device="cuda", seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    do = torch.randn(inp["v"].shape, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(inp["initial_state"].shape, device="cuda", generator=gen)
    leaves = [inp[n].clone().requires_grad_(True) for n in NAMES]
    o, ht = cake_ops.gdn(*leaves[:5], inp["cu_seqlens"], initial_state=leaves[5], output_final_state=True,
                         use_qk_l2norm=True)
    refs = [o, ht, *torch.autograd.grad((o, ht), leaves, (do, dht))]
    _, ht64 = gdn_reference(*(inp[n].double() for n in NAMES[:5]), inp["cu_seqlens"],
                            initial_state=inp["initial_state"].double(), use_qk_l2norm=True)
    return do, dht, [r.detach() for r in refs], ht64


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", ["C", "Z", "D"])
def test_kcp_cuda_on_rank_threads(world, layout):
    lengths, H, HV = [3000, 65, 1, 2100], 2, 6
    single = _single_gpu(lengths, H, HV, seed=world)
    with poisoned_allocations():  # process-wide: set once around all the rank threads
        run_rank_threads(_case, world, layout, lengths, H, HV, world, single, timeout=300)

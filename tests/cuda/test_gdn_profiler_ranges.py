"""The CUDA GDN ops launch each stage's kernels under a profiler range named after the op
and the stage (csrc/gdn/binding.cpp ``launch_stage``), so a torch.profiler trace of a
training step shows every cake kernel under its stage (README, "Profiling")."""

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import cake_ops
from cake_ops.testing import make_gdn_inputs

FWD_STAGES = ("plan", "prep", "summaries", "chain", "walk")
BWD_STAGES = {"light": ("tapes_prep", "reverse_walk", "tapes_walk", "local"), "full": ("plan", "reverse_walk", "local")}


@pytest.mark.gpu
@pytest.mark.parametrize("save_mode", ["light", "full"])
def test_every_kernel_runs_under_its_stage_range(save_mode):
    # One long document (cut by the grid: summaries and chain run) beside short ones.
    inp = make_gdn_inputs([9000, 300, 70], 2, 4, 128, 128, device="cuda", seed=0)
    leaves = [inp[n].detach().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
    do = torch.randn_like(inp["v"])

    def step():
        o, _ = cake_ops.gdn(*leaves, inp["cu_seqlens"], use_qk_l2norm=True, save_mode=save_mode)
        return torch.autograd.grad(o, leaves, do)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.events()
    fwd = "cake::gdn_fwd" if save_mode == "light" else "cake::gdn_fwd_full"
    expected = [f"{fwd}/{s}" for s in FWD_STAGES] + [f"cake::gdn_bwd/{s}" for s in BWD_STAGES[save_mode]]
    ranges = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.name in expected:
            ranges.setdefault(e.name, []).extend(k.name for k in e.kernels)
    assert sorted(ranges) == sorted(expected)
    for name in (f"{fwd}/plan", f"{fwd}/prep", f"{fwd}/walk", "cake::gdn_bwd/reverse_walk", "cake::gdn_bwd/local"):
        assert ranges[name], f"no kernel under {name}"
    cake_kernels = sorted(e.name for e in events if e.device_type == DeviceType.CUDA and "cake::" in e.name)
    in_ranges = sorted(k for ks in ranges.values() for k in ks)
    assert cake_kernels and in_ranges == cake_kernels, (cake_kernels, ranges)

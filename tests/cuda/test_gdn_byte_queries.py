"""``cake_ops.gdn_workspace_bytes`` against the allocator: a CUDA-kernel forward's or
backward's peak of requested bytes above what was requested before it (the allocator's
``requested_bytes``, which its block rounding does not blur) is the workspace plus the
outputs, for light and full save modes, with and without the L2 norm, deterministic and
not, one head slice and two, the plan's cut grid and a forced one."""

import pytest
import torch

import cake_ops
from cake_ops.testing import make_gdn_inputs


def _peak_above(fn):
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["requested_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["requested_bytes.all.peak"] - before, out


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths, H, G", [([4096, 300, 1, 64], 2, 3), ([11000, 12000, 9768], 16, 3)],
                         ids=["small", "s32k_h16"])
@pytest.mark.parametrize("save_mode", ["light", "full"])
@pytest.mark.parametrize("use_qk_l2norm, deterministic", [(True, True), (False, False)])
@pytest.mark.parametrize("segment_chunks", [-1, 16])
def test_workspace_bytes_are_the_allocator_peak(lengths, H, G, save_mode, use_qk_l2norm, deterministic,
                                                segment_chunks):
    from cake_ops import build

    ops = build.load()
    T, N, HV = sum(lengths), len(lengths), G * H
    inp = make_gdn_inputs(lengths, H, HV, 128, 128, device="cuda", seed=1)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"], None, 128**-0.5, use_qk_l2norm,
            deterministic)
    fwd = ops.gdn_fwd_full if save_mode == "full" else ops.gdn_fwd
    peak, out = _peak_above(lambda: fwd(*args, segment_chunks))
    ws = cake_ops.gdn_workspace_bytes(T, N, H, HV, use_qk_l2norm=use_qk_l2norm, deterministic=deterministic,
                                      save_mode=save_mode, segment_chunks=segment_chunks)
    assert peak == ws + _bytes(out), (peak, ws, [t.shape for t in out])
    tapes = out[2] if save_mode == "full" else None
    do = torch.randn_like(inp["v"])
    peak, grads = _peak_above(lambda: ops.gdn_bwd(do, None, *args, segment_chunks, -1, -1, tapes))
    ws = cake_ops.gdn_workspace_bytes(T, N, H, HV, use_qk_l2norm=use_qk_l2norm, deterministic=deterministic,
                                      save_mode=save_mode, direction="backward", segment_chunks=segment_chunks)
    assert peak == ws + _bytes(grads), (peak, ws, [t.shape for t in grads])


@pytest.mark.gpu
@pytest.mark.parametrize("lengths, H, G", [([4096, 300, 1, 64], 2, 3), ([11000, 12000, 9768], 16, 3)],
                         ids=["small", "s32k_h16"])
@pytest.mark.parametrize("use_qk_l2norm, deterministic", [(True, True), (False, False)])
def test_initial_state_workspace_bytes_are_the_allocator_peak(lengths, H, G, use_qk_l2norm, deterministic):
    """gdn_workspace_bytes(direction="initial_state") is a cake::gdn_bwd_initial_state
    call's peak of requested bytes less its output."""
    from cake_ops import build

    ops = build.load()
    T, N, HV = sum(lengths), len(lengths), G * H
    inp = make_gdn_inputs(lengths, H, HV, 128, 128, device="cuda", seed=2)
    do = torch.randn_like(inp["v"])
    peak, dh0 = _peak_above(lambda: ops.gdn_bwd_initial_state(do, None, inp["q"], inp["k"], inp["g"], inp["beta"],
                                                               inp["cu_seqlens"], 128**-0.5, use_qk_l2norm,
                                                               deterministic))
    ws = cake_ops.gdn_workspace_bytes(T, N, H, HV, use_qk_l2norm=use_qk_l2norm, deterministic=deterministic,
                                      direction="initial_state")
    assert peak == ws + _bytes([dh0]), (peak, ws)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths, H, G", [([4096, 300, 1, 64], 2, 3), ([11000, 12000, 9768], 16, 3)],
                         ids=["small", "s32k_h16"])
@pytest.mark.parametrize("use_qk_l2norm, deterministic", [(True, True), (False, False)])
def test_final_state_workspace_bytes_are_the_allocator_peak(lengths, H, G, use_qk_l2norm, deterministic):
    """gdn_workspace_bytes(direction="final_state") is a cake::gdn_fwd_final_state call's
    peak of requested bytes less its output."""
    from cake_ops import build

    ops = build.load()
    T, N, HV = sum(lengths), len(lengths), G * H
    inp = make_gdn_inputs(lengths, H, HV, 128, 128, device="cuda", seed=3)
    peak, final = _peak_above(lambda: ops.gdn_fwd_final_state(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                                               inp["cu_seqlens"], None, 128**-0.5, use_qk_l2norm,
                                                               deterministic))
    ws = cake_ops.gdn_workspace_bytes(T, N, H, HV, use_qk_l2norm=use_qk_l2norm, deterministic=deterministic,
                                      direction="final_state")
    assert peak == ws + _bytes([final]), (peak, ws)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths, H, G", [([4096, 300, 1, 64, 0], 2, 3), ([4096] * 8, 16, 3)],
                         ids=["small", "s32k_h16"])
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_segment_summaries_workspace_bytes_are_the_allocator_peak(lengths, H, G, use_qk_l2norm):
    """gdn_workspace_bytes(direction="segment_summaries" / "segment_grad_summaries") is a
    cake::gdn_segment_summaries / gdn_segment_grad_summaries call's peak of requested
    bytes less its two outputs (the pieces flagged to open and close inside; at
    s32k_h16's heads the backward runs in two head slices)."""
    from cake_ops import build

    ops = build.load()
    T, N, HV = sum(lengths), len(lengths), G * H
    inp = make_gdn_inputs(lengths, H, HV, 128, 128, device="cuda", seed=4)
    flags = torch.full((N,), 3, dtype=torch.uint8, device="cuda")
    do = torch.randn_like(inp["v"])
    xs = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"])
    for direction, call in (
        ("segment_summaries", lambda: ops.gdn_segment_summaries(*xs, 128**-0.5, use_qk_l2norm, True, -1, -1, flags)),
        ("segment_grad_summaries", lambda: ops.gdn_segment_grad_summaries(do, *xs[:2], *xs[3:], 128**-0.5,
                                                                          use_qk_l2norm, True, -1, -1, flags)),
    ):
        peak, out = _peak_above(call)
        ws = cake_ops.gdn_workspace_bytes(T, N, H, HV, use_qk_l2norm=use_qk_l2norm, deterministic=True,
                                          direction=direction)
        assert peak == ws + _bytes(out), (direction, peak, ws)

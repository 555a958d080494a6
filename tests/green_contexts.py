"""Running GPU work on a CUDA green context of a few SMs, for tests that the
deterministic kernels' bits do not depend on the SM count."""

import contextlib

import pytest
import torch


def on_green_context(num_sms, fn, repeats):
    """fn() run `repeats` times on a CUDA green context of num_sms SMs (kernels launched
    on its stream run on those SMs only): the last result and the best time in ms. Skips
    where this torch or driver has no green contexts. torch 2.12+ hands out the context's
    stream; 2.10-2.11 make it current with set_context."""
    green = getattr(torch.cuda, "green_contexts", None)
    if green is None or not getattr(green, "SUPPORTED", False):
        pytest.skip("this torch has no CUDA green contexts")
    try:
        ctx = green.GreenContext.create(num_sms=num_sms, device_id=torch.cuda.current_device())
    except RuntimeError as e:
        pytest.skip(f"no green context of {num_sms} SMs here: {e}")
    torch.cuda.synchronize()
    stream = ctx.Stream() if hasattr(ctx, "Stream") else None
    if stream is None:
        ctx.set_context()
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            result, best = timed(fn, repeats)
    finally:
        torch.cuda.synchronize()
        if stream is None:
            ctx.pop_context()
    return result, best


def timed(fn, repeats):
    """fn() run `repeats` times on the current stream: the last result and the best time in ms."""
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return result, best


def slowdown_on(num_sms):
    """How many times longer a 4096^3 bf16 matmul (work that fills every SM it gets) takes
    on a green context of num_sms SMs than on the whole GPU: about 132 / num_sms where the
    context holds its kernels to its SMs."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    probe = lambda: a @ a  # noqa: E731
    timed(probe, 2)
    _, full = timed(probe, 3)
    _, held = on_green_context(num_sms, probe, 3)
    return held / full

"""What a call learns from torch's non-reentrant checkpoint: whether the forward it is
about to run is a checkpoint recompute whose output torch throws away.

Under ``torch.utils.checkpoint(use_reentrant=False)`` torch runs the region's forward a
second time inside ``.backward()`` only to re-save the tensors that the first run's
autograd nodes saved, and with early stop (its default) it ends that run with an
exception raised from the pack hook of the last saved tensor. When the GDN op's own
saves are the last ones of the region, its output is never seen: nothing after it runs.
``recompute_output_proof`` says so, or why not, from the recompute's frame, which is
torch's private state (``torch.utils.checkpoint._recomputation_hook``'s pack hook and
the ``_CheckpointFrame`` it holds): so the proof is only trusted on the torch releases
in ``VERIFIED_TORCH``, whose frames were read and tested (tests/op/test_checkpointing.py
on CI's torch, tests/cuda on the GPU machine's). Any other case is "launch".
"""

from __future__ import annotations

import inspect

import torch

# Releases (major.minor) whose checkpoint frame was read and whose proof is tested.
VERIFIED_TORCH = ("2.11", "2.13")

# The recompute's pack hook: a closure over (gid, target_frame_ref).
_RECOMPUTE_HOOK = "_recomputation_hook.__init__.<locals>.pack_hook"
_FORWARD_HOOK = "_checkpoint_hook.__init__.<locals>.pack_hook"


def torch_release() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def recompute_output_proof(saves: int) -> str | None:
    """None when this forward is a non-reentrant checkpoint recompute in which the
    ``saves`` tensors the op's autograd node is about to save are the last ones torch
    waits for (early stop on), so the op's output is discarded; else why not (a
    sentence). ``saves`` is 0 when the call records no autograd node."""
    if saves == 0:
        return "the call saves no tensors for backward (no input requires grad, or grad mode is off)"
    if torch.compiler.is_compiling():
        return "the call is being traced by torch.compile"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "the current CUDA stream is capturing a graph"
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return "not inside a non-reentrant checkpoint recompute (no saved-tensor hooks)"
    pack = hooks[0]
    name = getattr(pack, "__qualname__", "")
    if name == _FORWARD_HOOK:
        return "the first forward of a checkpointed region (its output is used)"
    if name != _RECOMPUTE_HOOK:
        return f"the saved-tensor hooks are not a checkpoint recompute's ({name or type(pack).__name__})"
    release = torch_release()
    if release not in VERIFIED_TORCH:
        return f"torch {release} is not a release whose checkpoint frame was verified ({', '.join(VERIFIED_TORCH)})"
    pack = inspect.unwrap(pack)  # torch._dynamo.disable wraps it, functools.wraps-style
    code, closure = getattr(pack, "__code__", None), getattr(pack, "__closure__", None)
    if code is None or closure is None or set(code.co_freevars) != {"gid", "target_frame_ref"}:
        return "the recompute's pack hook does not hold the frame as the verified releases do"
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure)))
    frame = cells["target_frame_ref"]()
    if frame is None:
        return "the checkpoint frame is gone"
    if not frame.early_stop:
        return "checkpoint early stop is off: the recompute runs the whole region"
    left = len(frame.weak_holders) - frame.recomp_counter[cells["gid"]]
    if left != saves:
        return f"a later op of the checkpointed region saves tensors ({left} left to re-save, this call saves {saves})"
    return None

"""What a GDN call learns from torch's non-reentrant checkpoint: whether it runs in a
region's first forward or in its recompute, and, in the recompute, whether its saves are
the region's last (so torch discards its output).

Under ``torch.utils.checkpoint(use_reentrant=False)`` torch runs the region's forward a
second time inside ``.backward()`` only to re-save the tensors that the first run's
autograd nodes saved (the first run's saves are dropped at once; the recompute's go,
in order, to the same slots, checked for the same shapes and dtypes), and with early
stop (its default) it ends that run with an exception raised from the pack hook of the
last saved tensor. ``checkpoint_pass`` reads which run a call is in from the saved-tensor
hooks and the recompute's frame, which are torch's private state
(``torch.utils.checkpoint._checkpoint_hook`` and ``_recomputation_hook``'s pack hooks,
the ``_CheckpointFrame`` the latter holds): so they are only trusted on the torch
releases in ``VERIFIED_TORCH``, whose frames were read and tested
(tests/op/test_checkpointing.py on CI's torch, tests/cuda on the GPU machine's).
``closing_proof`` says whether a recompute's call closes the region;
``release_kept_tapes`` and ``record_kept_tapes`` hold the one tapes block a recompute
keeps for its backward (``gdn(reuse_recompute_tapes=...)``).
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref

import torch

# Releases (major.minor) whose checkpoint frame was read and whose proof is tested.
VERIFIED_TORCH = ("2.11", "2.13")

# The first run's pack hook, and the recompute's: a closure over (gid, target_frame_ref).
_FORWARD_HOOK = "_checkpoint_hook.__init__.<locals>.pack_hook"
_RECOMPUTE_HOOK = "_recomputation_hook.__init__.<locals>.pack_hook"


def torch_release() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


@dataclasses.dataclass(frozen=True)
class Pass:
    """Which run of a non-reentrant checkpoint a call is in: ``kind`` "first", "recompute"
    or "" (neither, or not one this module can read; ``why`` says which)."""

    kind: str
    why: str
    frame: object = None  # the recompute's _CheckpointFrame
    gid: int = 0  # the recompute's graph task


def checkpoint_pass() -> Pass:
    """The run of a non-reentrant checkpoint the current forward is in (``Pass``). It
    depends only on the saved-tensor hooks and the release, so the first run and the
    recompute of one region read the same kind of answer."""
    if torch.compiler.is_compiling():
        return Pass("", "the call is being traced by torch.compile")
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return Pass("", "not inside a non-reentrant checkpoint (no saved-tensor hooks)")
    name = getattr(hooks[0], "__qualname__", "")
    if name not in (_FORWARD_HOOK, _RECOMPUTE_HOOK):
        return Pass("", f"the saved-tensor hooks are not a checkpoint's ({name or type(hooks[0]).__name__})")
    release = torch_release()
    if release not in VERIFIED_TORCH:
        return Pass("", f"torch {release} is not a release whose checkpoint frame was verified "
                        f"({', '.join(VERIFIED_TORCH)})")
    if name == _FORWARD_HOOK:
        return Pass("first", "the first forward of a checkpointed region (its output is used)")
    pack = inspect.unwrap(hooks[0])  # torch._dynamo.disable wraps it, functools.wraps-style
    code, closure = getattr(pack, "__code__", None), getattr(pack, "__closure__", None)
    if code is None or closure is None or set(code.co_freevars) != {"gid", "target_frame_ref"}:
        return Pass("", "the recompute's pack hook does not hold the frame as the verified releases do")
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure)))
    frame = cells["target_frame_ref"]()
    if frame is None:
        return Pass("", "the checkpoint frame is gone")
    return Pass("recompute", "", frame, cells["gid"])


def closing_proof(p: Pass, saves: int) -> str | None:
    """None when ``p`` is a recompute in which the ``saves`` tensors the call's autograd
    node is about to save are the last ones torch waits for (early stop on): nothing
    after the call runs and its output is discarded. Else why not (a sentence)."""
    if p.kind != "recompute":
        return p.why or "not inside a non-reentrant checkpoint recompute"
    if not p.frame.early_stop:
        return "checkpoint early stop is off: the recompute runs the whole region"
    left = len(p.frame.weak_holders) - p.frame.recomp_counter[p.gid]
    if left != saves:
        return f"a later op of the checkpointed region saves tensors ({left} left to re-save, this call saves {saves})"
    return None


# Per recompute frame, the tapes block its last keeping call holds: (gid, weakref).
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def release_kept_tapes(p: Pass) -> None:
    """Frees the tapes block an earlier call of the recompute ``p`` kept (its storage, to
    size 0, which that call's backward reads as "recompute the tapes"), before a later
    call keeps its own: one kept set is live per region, the last GDN call's, whose
    backward runs first. Called before that call's op, since a call that closes the
    region ends the recompute from inside it (torch's early stop)."""
    prev = _kept.pop(p.frame, None)
    if prev is not None and prev[0] == p.gid and (earlier := prev[1]()) is not None:
        earlier.untyped_storage().resize_(0)


def record_kept_tapes(p: Pass, tapes: torch.Tensor) -> None:
    """Records ``tapes`` as the block the recompute ``p`` keeps (``release_kept_tapes``)."""
    _kept[p.frame] = (p.gid, weakref.ref(tapes))


def kept(tapes: torch.Tensor | None) -> bool:
    """Whether a saved tapes tensor holds tapes: not None, not the PyTorch path's empty
    block, not the stride-0 stand-in a call saves where it keeps none, not released."""
    return (tapes is not None and tapes.numel() > 0 and tapes.stride(0) == 1
            and tapes.untyped_storage().nbytes() >= tapes.numel())

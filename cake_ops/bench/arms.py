"""The benchmark's arms and ops: how each arm is imported (or skipped) and called.

- Arms: ``cake`` (deterministic), ``cake-nd`` (``deterministic=False``), ``cake-full``
  (deterministic, ``save_mode="full"``: the forward keeps its tapes for the backward),
  ``cake-always`` (``recompute_output="always"``, ``reuse_recompute_tapes=False``: under
  ``ckpt`` the recompute launches the forward that ``cake``'s default skips, and the
  backward recomputes the tapes; the same as ``cake`` in the other ops), ``cake-keep``
  (``"always"`` and ``True``: the recompute launches the forward and keeps its tapes for
  the backward),
  ``cake-replay`` (``graph="replay"``: each op's launches replayed from a CUDA graph), ``fla``
  (fla-core, Triton path: ``FLA_FLASH_QLA=0``), ``flashqla`` (flash-qla, K = V = 128),
  ``torch`` (this project's PyTorch chunked path, the whole call under
  ``cake_ops.pytorch_implementation()``) and ``cake-aa`` (a second copy of ``cake``:
  the A/A noise floor). An arm whose package is missing is skipped with a message.
- Ops: ``fwd`` (grad-enabled forward), ``fwdbwd`` (forward, then backward with a
  random output gradient made once outside timing), ``ckpt`` (non-reentrant
  ``torch.utils.checkpoint`` around the forward, then backward: forward, recompute,
  backward). The cake arms call ``cake_ops.gdn``, so the backward is the op's autograd.

Every arm gets the inputs in its own layout (cake: packed ``[T, ...]``; FLA and
FlashQLA: ``[1, T, ...]`` views of the same storage), made before timing, and its
output is never indexed or copied inside a timed region (docs/benchmark.md, Traps). By default
the same ``cu_seqlens`` tensor (int32) is passed on every call, so the peers' host-side
caches keyed on it hit, as they do in every layer of a training step but the first;
``--cu-seqlens fresh`` cycles through distinct copies (made before timing, more than
the peers' caches hold), so every call is a step's first layer: the peers read
``cu_seqlens`` on the host, a sync, and rebuild what they cache.

The peers come as wheels: ``pip install --no-index --no-deps --target /tmp/peers``
and ``PYTHONPATH=/tmp/peers`` (docs/benchmark.md, Peers on the GPU machine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from .shapes import Inputs, Shape

OPS = ("fwd", "fwdbwd", "ckpt")
ARMS = ("cake", "cake-nd", "cake-full", "cake-always", "cake-keep", "cake-replay", "fla", "flashqla", "torch", "cake-aa")  # the canonical (palindrome) order
FRESH_CU_SEQLENS = 8  # copies cycled with --cu-seqlens fresh: FLA's and FlashQLA's tensor caches hold 4
SLOW_ARM_CALLS = 2  # calls per appearance for arms marked slow (the torch arm)

ArmFn = Callable[..., torch.Tensor]  # (q, k, v, g, beta, cu_seqlens) -> o in the arm's layout
ContextFactory = Callable[[], contextlib.AbstractContextManager]


def error_text(e: BaseException) -> str:
    """An exception as one short line, for the report."""
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


@dataclasses.dataclass
class Arm:
    name: str
    batched: bool  # takes and returns [1, T, ...] (FLA layout) instead of packed [T, ...]
    slow: bool = False
    fn: ArmFn | None = None
    skip: str | None = None  # why the arm cannot run at all
    # Entered around each whole call (forward, recompute and backward), e.g. the
    # torch arm's cake_ops.pytorch_implementation.
    context: ContextFactory | None = None

    def supports(self, shape: Shape) -> str | None:
        if self.name == "flashqla" and (shape.K, shape.V) != (128, 128):
            return "FlashQLA supports K = V = 128 only"
        return None


# A loader imports an arm's package and returns (fn, context or None).
Loaded = tuple[ArmFn, ContextFactory | None]


def _load_cake(deterministic: bool, save_mode: str = "light", recompute_output: str = "auto",
               reuse_recompute_tapes=None, graph: str = "off") -> Loaded:
    import cake_ops

    gdn = cake_ops.gdn

    def fn(q, k, v, g, beta, cu):
        o, _ = gdn(q, k, v, g, beta, cu, use_qk_l2norm=True, deterministic=deterministic, save_mode=save_mode,
                   recompute_output=recompute_output, reuse_recompute_tapes=reuse_recompute_tapes, graph=graph)
        return o

    return fn, None


def _load_torch() -> Loaded:
    import cake_ops

    def fn(q, k, v, g, beta, cu):
        o, _ = cake_ops.gdn(q, k, v, g, beta, cu, use_qk_l2norm=True)
        return o

    # The context covers the whole call, backward included: a backward that runs
    # outside it would run on whatever implementation the op picks then.
    return fn, cake_ops.pytorch_implementation


def _load_fla() -> Loaded:
    os.environ["FLA_FLASH_QLA"] = "0"  # FLA's own Triton path, not its FlashQLA backend
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def fn(q, k, v, g, beta, cu):
        o, _ = chunk_gated_delta_rule(
            q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
        )
        return o

    return fn, None


def _load_flashqla() -> Loaded:
    from flash_qla import chunk_gated_delta_rule

    def fn(q, k, v, g, beta, cu):
        o, _ = chunk_gated_delta_rule(
            q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
        )
        return o

    return fn, None


def load_arms(names: Sequence[str], device: torch.device) -> list[Arm]:
    """Import every requested arm; a missing package gives a skip reason, never an error."""
    specs = {
        "cake": (False, False, lambda: _load_cake(True)),
        "cake-nd": (False, False, lambda: _load_cake(False)),
        "cake-full": (False, False, lambda: _load_cake(True, "full")),
        "cake-always": (False, False, lambda: _load_cake(True, recompute_output="always", reuse_recompute_tapes=False)),
        "cake-keep": (False, False, lambda: _load_cake(True, recompute_output="always", reuse_recompute_tapes=True)),
        "cake-replay": (False, False, lambda: _load_cake(True, graph="replay")),
        "cake-aa": (False, False, lambda: _load_cake(True)),
        "torch": (False, True, _load_torch),
        "fla": (True, False, _load_fla),
        "flashqla": (True, False, _load_flashqla),
    }
    arms = []
    for name in names:
        batched, slow, loader = specs[name]
        arm = Arm(name, batched=batched, slow=slow)
        if batched and device.type != "cuda":
            arm.skip = f"needs a CUDA device (running on {device.type})"
        else:
            try:
                arm.fn, arm.context = loader()
            except Exception as e:  # ImportError, or a peer refusing this GPU at import
                arm.skip = f"not available: {error_text(e)}"
        arms.append(arm)
    return arms


def arm_args(arm: Arm, inp: Inputs) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Leaves (q, k, v, g, beta) requiring grad, cu_seqlens and do, in the arm's layout.

    Views of the shared inputs (no copies), made once, outside every timed region.
    """
    views = [inp.q, inp.k, inp.v, inp.g, inp.beta]
    do = inp.do
    if arm.batched:
        views = [t.unsqueeze(0) for t in views]
        do = do.unsqueeze(0)
    leaves = [t.detach().requires_grad_(True) for t in views]
    return leaves, inp.cu_seqlens, do


def make_step(
    arm: Arm, op: str, leaves: list[torch.Tensor], cu: torch.Tensor, do: torch.Tensor, fresh_cu: bool = False
):
    """One call of ``op``; returns (o, grads-or-None). Nothing but the op runs inside.

    Gradients come from ``torch.autograd.grad``, so no ``.grad`` accumulation kernels.
    fresh_cu: each call takes the next of FRESH_CU_SEQLENS copies of ``cu`` in turn.
    """
    fn = arm.fn
    context = arm.context or contextlib.nullcontext
    cus = [cu.clone() for _ in range(FRESH_CU_SEQLENS)] if fresh_cu else [cu]
    turn = itertools.count()

    def step():
        cu_call = cus[next(turn) % len(cus)]
        with context(), torch.enable_grad():
            if op == "ckpt":
                o = checkpoint(fn, *leaves, cu_call, use_reentrant=False)
            else:
                o = fn(*leaves, cu_call)
            grads = torch.autograd.grad(o, leaves, do) if op != "fwd" else None
        return o, grads

    return step

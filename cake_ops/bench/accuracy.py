"""The benchmark's accuracy check: every arm and op against the FP64 reference, before timing.

Every arm, for every requested op, against the FP64 token-by-token reference on a small
packed shape (``ACCURACY_SHAPE``: documents of 100 + 64 + 37 tokens, (H, HV) = (2, 6),
K = V = 128) with the benchmark's own input distribution: o and, with a backward,
dq/dk/dv/dg/dbeta must be finite with rel-RMS <= 1e-2. A failing (arm, op) is
reported and not timed (docs/benchmark.md, Protocol).
"""

from __future__ import annotations

import math
import traceback
from typing import Any

import torch

from .arms import Arm, arm_args, error_text, make_step
from .shapes import Inputs

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")


def reference_outputs(inp: Inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """FP64 reference o and (dq, dk, dv, dg, dbeta) for do, on the inputs' device, returned on the CPU."""
    from cake_ops.reference import gdn_reference

    leaves = [t.detach().double().requires_grad_(True) for t in (inp.q, inp.k, inp.v, inp.g, inp.beta)]
    with torch.enable_grad():
        o, _ = gdn_reference(*leaves, inp.cu_seqlens, use_qk_l2norm=True)
        grads = torch.autograd.grad(o, leaves, inp.do.double())
    return o.detach().cpu(), [x.detach().cpu() for x in grads]


def check_accuracy(arm: Arm, op: str, inp: Inputs, ref_o: torch.Tensor, ref_grads: list[torch.Tensor]) -> dict:
    """One arm and op on the accuracy shape: finite and rel-RMS <= 1e-2 on every tensor.

    The contract's second measure (max|x - ref| <= 2e-2 max|ref|, docs/contract.md,
    Accuracy) is reported as ``contract_ok`` but does not keep an arm from being timed.
    """
    from cake_ops.testing import REL_RMS_TOL, accuracy

    entry: dict[str, Any] = {
        "arm": arm.name, "op": op, "ok": False, "contract_ok": False, "error": None,
        "rel_rms": {}, "max_abs_ratio": {},
    }
    try:
        leaves, cu, do = arm_args(arm, inp)
        o, grads = make_step(arm, op, leaves, cu, do)()
        pairs = [("o", o, ref_o)]
        if grads is not None:
            pairs += list(zip(GRAD_NAMES, grads, ref_grads))
        accs = {}
        for name, x, ref in pairs:
            accs[name] = acc = accuracy(x.detach().reshape(ref.shape), ref)
            entry["rel_rms"][name] = acc.rel_rms if acc.finite else math.inf
            entry["max_abs_ratio"][name] = acc.max_abs_ratio if acc.finite else math.inf
        entry["ok"] = all(a.finite and a.rel_rms <= REL_RMS_TOL for a in accs.values())
        entry["contract_ok"] = all(a.ok for a in accs.values())
        if not entry["ok"]:
            worst = max(entry["rel_rms"], key=lambda n: entry["rel_rms"][n])
            entry["error"] = f"rel-RMS of {worst} = {entry['rel_rms'][worst]:.3g} > {REL_RMS_TOL:g}"
    except Exception as e:
        entry["error"] = error_text(e)
        entry["traceback"] = traceback.format_exc(limit=6)
    return entry

#!/usr/bin/env python
"""Error of the backward's gradients by the precision of its tapes, emulated on the CPU.

    python tools/gdn_bwd_tape_precision.py [--cases edges,slow] [--seeds 0,2]   # CPU, seconds a case

The chunked backward has four tapes per chunk and value head: h (the state at the chunk's
start), v_new, dS (the state gradient at the chunk's end) and dv_new; the CUDA backward
(docs/kernels.md, "Backward") keeps h, dS and dv_new in bf16 and forms v_new again from
the bf16 h (since 1c7596e; the v_new variants below). This takes the PyTorch path's fp32 tapes (cake_ops.pytorch.gdn
walk_tapes), rounds some or all of them to bf16, forms the chunk-local gradients in fp32
(local_gradients) and prints each gradient's rel-RMS against FP64 autograd of the
token-by-token reference: what the tapes' rounding alone costs, tape by tape, apart from
the kernels' other bf16 operands; the kernel's own form (bf16 tapes, fp32 first state
and last state gradient in dg's term e^gl <dS_end, h>) with a bf16 v_new tape, as the kernels
were until 1c7596e; and that form with v_new not kept but formed again by the chunk-local
kernel from the bf16 h tape, as today's kernel and FlashQLA's backward do (16 KB a chunk
and value head less memory and traffic): v_new = A diag(beta) (v - diag(e^gcum) k S) with
S, k, v, A and the product's operand in bf16 as the kernel's tiles hold them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cake_ops.pytorch import gdn as pytorch_gdn  # noqa: E402
from cake_ops.reference import gdn_reference  # noqa: E402
from cake_ops.testing import accuracy, make_gdn_inputs  # noqa: E402
from cake_ops.varlen import from_chunks  # noqa: E402

# name -> (lengths, H, G, gate, beta, use_qk_l2norm): small versions of the GPU test cases.
CASES = {
    "edges": ((1, 63, 64, 65, 130), 2, 1, "normal", "uniform", True),
    "gva3_strong": ((65, 1, 300), 1, 3, "strong", "extreme", True),
    "slow": ((64, 130, 7), 2, 3, "slow", "extreme", False),
    "slow_long": ((64 * 70 + 5,), 1, 2, "slow", "uniform", True),
}
TAPES = ("h", "v_new", "dS_end", "dv_new")
VARIANTS = {"fp32": (), "bf16 all": TAPES, "bf16 h": ("h",), "bf16 dS": ("dS_end",),
            "bf16 v_new, dv_new": ("v_new", "dv_new")}
# The kernel's form: every tape bf16, but dg's term e^gl <dS_end, h> reads a document's
# first state (the initial state) and last state gradient (dht) in fp32.
KERNEL = "bf16, exact first S / last dS"
RECOMPUTED = "the same, v_new from the bf16 h"
NAMES = ("dq", "dk", "dv", "dg", "dbeta")


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def v_new_from_h(prep, h: torch.Tensor) -> torch.Tensor:
    """v_new formed again from the (bf16) state tape h, with bf16 operands: k S in fp32,
    beta (v - e^gcum k S) rounded to bf16 as the operand of the product with A (bf16), the
    result rounded as a tile."""
    ks = _bf16(prep.k) @ h  # [NC, HV, C, V]
    e = _bf16(prep.beta[..., None] * (_bf16(prep.v) - prep.gcum.exp()[..., None] * ks))
    return _bf16(_bf16(prep.A) @ e)


def kernel_form(prep, rstd, tapes, t, do, scale, G) -> list[torch.Tensor]:
    """The gradients from the rounded tapes t, with dg's term e^gl <dS_end, h> reading a
    document's first state and last state gradient in fp32 (from the fp32 tapes): the term
    enters d gcum at a chunk's last token, so the reverse cumsum adds its change to every
    token of the chunk."""
    grads = list(pytorch_gdn.local_gradients(prep, rstd, t, do, scale, G))
    lay = prep.layout
    h = torch.where(lay.first[:, None, None, None], tapes.h, t.h)
    dS = torch.where(lay.last[:, None, None, None], tapes.dS_end, t.dS_end)
    change = ((dS * h).sum((-1, -2)) - (t.dS_end * t.h).sum((-1, -2))) * prep.gcum[..., -1].exp()
    grads[3] = grads[3] + from_chunks(change[..., None, None].expand(-1, -1, prep.gcum.shape[-1], 1), lay)[..., 0]
    return grads


def case_setup(case: str, seed: int = 0) -> SimpleNamespace:
    """One case's inputs, the PyTorch path's fp32 prep and tapes, and FP64 autograd of the
    token-by-token reference: refs, the gradients of (q, k, v, g, beta, initial_state)."""
    lengths, H, G, gate, beta, l2 = CASES[case]
    inp = make_gdn_inputs(list(lengths), H, H * G, 128, 128, gate=gate, beta=beta, normalized_qk=not l2,
                          initial_state=True, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    T, HV, V = inp["v"].shape
    N = len(lengths)
    do = torch.randn(T, HV, V, generator=gen).bfloat16()
    dht = torch.randn(N, HV, V, V, generator=gen)
    scale = 128**-0.5
    args = [inp[n] for n in ("q", "k", "v", "g", "beta")]
    prep, rstd = pytorch_gdn.prepare(*args, inp["cu_seqlens"], l2)
    tapes = pytorch_gdn.walk_tapes(prep, do, dht, inp["initial_state"], scale)
    ref = [a.double().requires_grad_() for a in args]
    h0 = inp["initial_state"].double().requires_grad_()
    o, ht = gdn_reference(*ref, inp["cu_seqlens"], initial_state=h0, use_qk_l2norm=l2)
    torch.autograd.backward([o, ht], [do.double(), dht.double()])
    return SimpleNamespace(inp=inp, G=G, do=do, dht=dht, scale=scale, prep=prep, rstd=rstd, tapes=tapes,
                           refs=[r.grad for r in ref] + [h0.grad])


def errors(case: str, seed: int = 0) -> dict[str, dict[str, float]]:
    """{variant: {gradient: rel-RMS against FP64}} for one case."""
    c = case_setup(case, seed)
    prep, rstd, tapes, do, scale, G = c.prep, c.rstd, c.tapes, c.do, c.scale, c.G
    refs = c.refs
    out = {}
    for variant, rounded in VARIANTS.items():
        t = tapes._replace(**{n: getattr(tapes, n).bfloat16().float() for n in rounded})
        grads = pytorch_gdn.local_gradients(prep, rstd, t, do, scale, G)
        out[variant] = {n: accuracy(x, r).rel_rms for n, x, r in zip(NAMES, grads, refs)}
    t = tapes._replace(**{n: _bf16(getattr(tapes, n)) for n in TAPES})
    grads = kernel_form(prep, rstd, tapes, t, do, scale, G)
    out[KERNEL] = {n: accuracy(x, r).rel_rms for n, x, r in zip(NAMES, grads, refs)}
    grads = kernel_form(prep, rstd, tapes, t._replace(v_new=v_new_from_h(prep, t.h)), do, scale, G)
    out[RECOMPUTED] = {n: accuracy(x, r).rel_rms for n, x, r in zip(NAMES, grads, refs)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--seeds", default="0", help="comma list of input seeds")
    args = parser.parse_args()
    for case in args.cases.split(","):
        for seed in map(int, args.seeds.split(",")):
            for variant, errs in errors(case, seed).items():
                print(f"{case:12s} seed {seed} {variant:30s} " + "  ".join(f"{n} {e:.2e}" for n, e in errs.items()),
                      flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The fused backward's per-chunk schedule, emulated on the CPU: its algebra and its roundings.

    python tools/gdn_bwd_fused_emulation.py [--cases edges,gva3_strong] [--seeds 0,2] [--vsplit 1,2]

A fused CUDA backward (docs/fused_backward.md, "The plan") walks dS back
over one (segment, value head) and forms every chunk-local gradient in the same step, from
tiles handed between warpgroups in shared memory, never through a dS or dv_new tape. Its
schedule reorganises the algebra of today's two kernels (cake_ops/pytorch/gdn.py
local_gradients), and with ``vsplit = 2`` each CTA of a pair holds only half of the value
columns (its half of dS, do, v, h), so every gradient that contracts over V is a partial
sum, added over the two halves in a fixed order:

- the chain (one warpgroup, dS^T of its value rows in fp32 registers, every product
  register-sourced): ``dv_new = dte (K dS) + P~^T do`` (dS rounded to bf16 as the
  operand, published as the DS tile), then ``dXu = A^T dv_new`` (the chain's X before beta),
  so ``dv = beta dXu`` is stored from its fragments and the local ``A^T dv_new`` product goes;
  the update ``dS <- e^gl dS + K^T bf16(-beta e^gcum dXu) + Q^T bf16(scale e^gcum do)``;
- dbeta's ``e^gcum (dXw . k) + (dXu . v)`` and dg's ``beta e^gcum (dXw . k)`` as column sums
  of ``A o dA1`` and ``A o (dA1 diag(e^gcum) + dA2)`` (``dA1 = dw k^T``, ``dA2 = dv_new v^T``,
  the two products of dA on one accumulator), so no warpgroup holds dXw or dXu;
- ``dk += diag(beta e^gcum) A^T dw`` as a product whose left operand (A^T's fragments) is
  scaled by row: dk's accumulator takes it directly;
- ``v_new = A bf16(beta (v - e^gcum K S))`` from the bf16 h tape, as the chunk-local kernel
  forms it today; ``P~ = scale (Q K^T o D)`` in bf16 for the chain, fp32 for ``dP o P``.

Every hand-over tile (DS, dv_new, the update's operands, E, v_new, dw, dPs, dkk, P~) is
rounded to bf16 where the kernel's is; dA is TF32 in dL's two products; h is the bf16 tape,
with dg's term ``e^gl <dS_end, h>`` in fp32 at a document's first state and last state
gradient, as today. ``--exact`` keeps everything fp32: then the schedule must give the
chunked algorithm's gradients to fp32 rounding (its algebra is the same math).
It prints rel-RMS and max-abs ratio per gradient against FP64 autograd of the token-by-token
reference, for the schedule at each vsplit and, for scale, the bf16 tapes alone on the
same inputs (tools/gdn_bwd_tape_precision.py's kernel form: its operands are fp32, so it
is not today's kernels' error, which the GPU suite measures).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cake_ops.pytorch import gdn as pytorch_gdn  # noqa: E402
from cake_ops.testing import accuracy  # noqa: E402
from cake_ops.varlen import from_chunks, to_chunks  # noqa: E402


def _sibling(name: str):
    """A tool of this folder, loaded as a module."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tape_precision = _sibling("gdn_bwd_tape_precision")
# TF32 rounding to nearest, ties away: cvt.rna.tf32, as the chunk-local kernel stores dA and A^T dA.
round_tf32 = _sibling("prep_merge_precision").round_tf32

CASES = tape_precision.CASES
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def fused_backward(prep, rstd, h, do, dht, scale, G, vsplit, exact=False):
    """(dq, dk, dv, dg, dbeta, dh0) by the fused schedule; dg's zero below the gate floor is
    the caller's. h: the fp32 state tape [NC, HV, K, V] (the kernel reads it in bf16). The
    value columns in `vsplit` equal parts, each one CTA of the pair; their partials are
    added in that order."""
    rnd = (lambda x: x) if exact else _bf16
    tf32 = (lambda x: x) if exact else round_tf32
    lay = prep.layout
    NC, HV, C = prep.gcum.shape
    N = lay.doc_first_slot.shape[0]
    K, V = prep.k.shape[-1], prep.v.shape[-1]
    Vh = V // vsplit
    gcum, D = prep.gcum, prep.decay
    eg, beta = gcum.exp(), prep.beta
    gamma = gcum[..., -1].exp()
    dte = (gcum[..., -1:] - gcum).exp()
    Q, Kb, A, Vb = rnd(prep.q), rnd(prep.k), rnd(prep.A), rnd(prep.v)
    doc_ = to_chunks(do.float(), lay)  # bf16 values already
    ht = rnd(h)  # the h tape
    h_dot = torch.where(lay.first[:, None, None, None], h, ht)  # dg's term: a document's first state in fp32
    dht = dht.float() if dht is not None else prep.k.new_zeros(N, HV, K, V)
    dht_slot = dht[lay.doc]
    # Chunk-local, state-independent: P (fp32 for dP o P, bf16 P~ for the chain), K K^T.
    P = scale * (Q @ Kb.transpose(-1, -2)) * D
    kk = Kb @ Kb.transpose(-1, -2)
    Pt = rnd(P)

    dq = prep.k.new_zeros(NC, HV, C, K)
    dk = torch.zeros_like(dq)
    dv = prep.k.new_zeros(NC, HV, C, V)
    dgcum = prep.k.new_zeros(NC, HV, C)
    dgl = prep.k.new_zeros(NC, HV)
    dbeta = torch.zeros_like(dgcum)
    dh0 = dht.clone()  # an empty document's: dht
    for half in range(vsplit):
        vs = slice(half * Vh, (half + 1) * Vh)
        do_h, v_h, h_h = doc_[..., vs], Vb[..., vs], ht[..., vs]
        # The chain: dS^T of this half's value rows in registers, chunk slots from the last.
        DS = prep.k.new_empty(NC, HV, K, Vh)  # the bf16 tile the local warpgroups read
        dS_dot = torch.empty_like(DS)  # dg's term: a document's last dS in fp32
        DVN = prep.k.new_empty(NC, HV, C, Vh)
        dS = prep.k.new_zeros(HV, K, Vh)
        for c in range(NC - 1, -1, -1):
            dS = torch.where(lay.last[c], dht_slot[c][..., vs], dS)
            DS[c] = rnd(dS)
            dS_dot[c] = torch.where(lay.last[c], dS, DS[c])
            dvn = dte[c][..., None] * (Kb[c] @ DS[c]) + Pt[c].transpose(-1, -2) @ do_h[c]
            DVN[c] = rnd(dvn)
            dXu = A[c].transpose(-1, -2) @ DVN[c]  # X^T, before beta
            dv[c][..., vs] = beta[c][..., None] * dXu
            xk = rnd(-(beta[c] * eg[c])[..., None] * dXu)
            doq = rnd(scale * eg[c][..., None] * do_h[c])
            dS = gamma[c][:, None, None] * dS + Kb[c].transpose(-1, -2) @ xk + Q[c].transpose(-1, -2) @ doq
            if lay.first[c]:
                dh0[int(lay.doc[c])][..., vs] = dS
        # The local warpgroups, per chunk (vectorised here over slots).
        ks = Kb @ h_h  # K S: [C, Vh]
        E = rnd(beta[..., None] * (v_h - eg[..., None] * ks))
        VN = rnd(A @ E)
        dP = do_h @ VN.transpose(-1, -2)
        dPP = dP * P
        dgcum += dPP.sum(-1) - dPP.sum(-2)
        dPs = rnd(scale * dP * D)
        dqg = do_h @ h_h.transpose(-1, -2)  # do S^T: [C, K]
        dgcum += scale * eg * (dqg * Q).sum(-1)
        dq += scale * eg[..., None] * dqg + dPs @ Kb
        dk_dec = VN @ DS.transpose(-1, -2)
        t = dte * (dk_dec * Kb).sum(-1)
        dgcum -= t
        dgl += t.sum(-1) + gamma * (dS_dot * h_dot[..., vs]).sum((-1, -2))
        dk += dte[..., None] * dk_dec + dPs.transpose(-1, -2) @ Q
        dw = rnd(-DVN @ h_h.transpose(-1, -2))
        dA1 = dw @ Kb.transpose(-1, -2)  # [j, i]
        dgcum += beta * eg * (A * dA1).sum(-2)
        acc = dA1 * eg[..., None, :] + DVN @ v_h.transpose(-1, -2)
        dbeta += (A * acc).sum(-2)
        dA = tf32(acc * beta[..., None, :])
        dk += rnd((beta * eg)[..., :, None] * A.transpose(-1, -2)) @ dw
        At = A.transpose(-1, -2)
        dL = -(tf32(At @ dA) @ At).tril(-1)
        dLD = dL * D
        dLDkk = dLD * kk
        dbeta += dLDkk.sum(-1)
        dLL = dLDkk * beta[..., None]
        dgcum += dLL.sum(-1) - dLL.sum(-2)
        dkk = rnd(dLD * beta[..., None])
        dk += (dkk + dkk.transpose(-1, -2)) @ Kb
    dgcum = torch.cat([dgcum[..., :-1], dgcum[..., -1:] + dgl[..., None]], -1)
    dg = dgcum.flip(-1).cumsum(-1).flip(-1)
    dh0 = torch.where(lay.doc_nonempty[:, None, None, None], dh0, dht)
    dq = from_chunks(pytorch_gdn._per_qk_head(dq, G), lay)
    dk = from_chunks(pytorch_gdn._per_qk_head(dk, G), lay)
    if rstd is not None:
        qn, rq, kn, rk = rstd
        dq, dk = pytorch_gdn._l2norm_bwd(dq, qn, rq), pytorch_gdn._l2norm_bwd(dk, kn, rk)
    return (dq, dk, from_chunks(dv, lay), from_chunks(dg[..., None], lay)[..., 0],
            from_chunks(dbeta[..., None], lay)[..., 0], dh0)


def errors(case: str, seed: int = 0, vsplits=(1, 2), exact: bool = False) -> dict[str, dict[str, tuple[float, float]]]:
    """{form: {gradient: (rel-RMS, max-abs ratio) against FP64}} for one case: the fused
    schedule at each vsplit and today's kernels' form."""
    c = tape_precision.case_setup(case, seed)
    prep, rstd, tapes, do, dht, scale, G, inp, refs = c.prep, c.rstd, c.tapes, c.do, c.dht, c.scale, c.G, c.inp, c.refs
    below = inp["g"] < pytorch_gdn.GATE_FLOOR

    def score(grads):
        grads = list(grads)
        grads[3] = torch.where(below, 0.0, grads[3])
        return {n: (a.rel_rms, a.max_abs_ratio) for n, x, r in zip(NAMES, grads, refs) for a in [accuracy(x, r)]}

    out = {}
    for vs in vsplits:
        out[f"fused, vsplit {vs}" + (" (fp32)" if exact else "")] = score(
            fused_backward(prep, rstd, tapes.h, do, dht, scale, G, vs, exact))
    if not exact:
        t = tapes._replace(**{n: _bf16(getattr(tapes, n)) for n in tape_precision.TAPES})
        t = t._replace(v_new=tape_precision.v_new_from_h(prep, t.h))
        out["tapes alone"] = score(tape_precision.kernel_form(prep, rstd, tapes, t, do, scale, G) + [tapes.dh0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--seeds", default="0", help="comma list of input seeds")
    parser.add_argument("--vsplit", default="1,2", help="comma list of value splits (1: one CTA a value head)")
    parser.add_argument("--exact", action="store_true", help="every tile fp32: the schedule's algebra alone")
    args = parser.parse_args()
    vsplits = tuple(map(int, args.vsplit.split(",")))
    for case in args.cases.split(","):
        for seed in map(int, args.seeds.split(",")):
            for form, errs in errors(case, seed, vsplits, args.exact).items():
                print(f"{case:12s} seed {seed} {form:22s} " +
                      "  ".join(f"{n} {r:.2e}/{m:.2e}" for n, (r, m) in errs.items()), flush=True)
    print("(rel-RMS / max-abs ratio against FP64; the contract: 1e-2 / 2e-2)")


if __name__ == "__main__":
    main()

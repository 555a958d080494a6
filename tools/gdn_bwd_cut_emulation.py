#!/usr/bin/env python
"""The backward's reverse walk cut at a grid, emulated on the CPU against the uncut walk.

    python tools/gdn_bwd_cut_emulation.py [--tokens 4096] [--seg 16] [--gate mamba] [--heads 2]   # CPU, a minute

The CUDA reverse walk (csrc/gdn/bwd_walk.h; docs/kernels.md, "The cut reverse walk") is
cut at the forward's grid. Each segment's walk needs the state gradient at its end, which
is dS_start of the next segment:
  exact:     dS_start(s) = M_s^T dS_end(s) + F_s, with F_s segment s walked back from zero
             and the chain run from the document's last segment down;
  truncated: segment s's first chunks alone, walked back from zero over the shortest
             window whose log decays sum to <= -20 (every token a contraction,
             0 <= beta |k|^2 <= 2); where no window qualifies, the cut is exact.
This forms both for one document from the PyTorch path's chunked tensors (fp32,
cake_ops.pytorch.gdn prepare), walks every segment from its end gradient, and prints per
form the largest difference of the dS tape from the uncut walk's (relative to its
largest entry), the cuts that truncated, and every gradient's rel-RMS against FP64
autograd of the token-by-token reference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cake_ops.bench.shapes import make_gate  # noqa: E402
from cake_ops.pytorch import gdn as pytorch_gdn  # noqa: E402
from cake_ops.reference import gdn_reference  # noqa: E402
from cake_ops.testing import accuracy, make_gdn_inputs  # noqa: E402

TRUNCATE_AT = -20.0  # the forward's threshold (docs/kernels.md, "Truncated cuts")
NAMES = ("dq", "dk", "dv", "dg", "dbeta")


class ReverseSteps:
    """The reverse step (cake_ops.pytorch.gdn reverse_step_terms) over a range of one
    document's chunks 0 .. nc - 1 (its slots), from a given end gradient."""

    def __init__(self, prep, do, scale):
        self.prep = prep
        self.dv_new_local, self.dS_from_o, self.gamma = pytorch_gdn.reverse_step_terms(prep, do, scale)

    def walk(self, c_end, c_begin, dS, dS_tape=None, dv_tape=None, homogeneous=False):
        """Walks chunks c_end - 1 down to c_begin from dS (the gradient at chunk c_end - 1's
        end); writes the tapes when given; returns dS at chunk c_begin's start.
        homogeneous: without the output terms (the transfer M^T applied to dS)."""
        p = self.prep
        for c in range(c_end - 1, c_begin - 1, -1):
            dv_new = p.k_decayed[c] @ dS + (0 if homogeneous else self.dv_new_local[c])
            if dS_tape is not None:
                dS_tape[c], dv_tape[c] = dS, dv_new
            dS = self.gamma[c][:, None, None] * dS - p.w[c].transpose(-1, -2) @ dv_new + (
                0 if homogeneous else self.dS_from_o[c])
        return dS


def truncation_window(prep, c0, c1) -> int | None:
    """The shortest count of chunks from c0 (< c1 - c0) whose log decays sum to <= -20 for
    every value head, every token a contraction; None if there is none."""
    beta_kk = prep.beta * (prep.k * prep.k).sum(-1)
    contraction = ((beta_kk >= 0) & (beta_kk <= 2)).all(-1)  # [NC, HV]
    total = torch.zeros_like(prep.gcum[0, :, 0])
    for n, c in enumerate(range(c0, c1)):
        if not bool(contraction[c].all()):
            return None
        total = total + prep.gcum[c, :, -1]
        if bool((total <= TRUNCATE_AT).all()):
            return n + 1
    return None


def cut_tapes(steps: ReverseSteps, nc: int, seg: int, dht, truncate: bool):
    """The dS and dv_new tapes of the segments' walks, each from its end gradient."""
    p = steps.prep
    bounds = list(range(0, nc, seg)) + [nc]
    segments = list(zip(bounds[:-1], bounds[1:]))
    dS_end = [None] * len(segments)
    dS_end[-1] = dht
    truncated = 0
    # End gradients, independent where truncated, else chained from the last segment down.
    for s in range(len(segments) - 1, 0, -1):
        c0, c1 = segments[s]
        window = truncation_window(p, c0, c1) if truncate else None
        zero = torch.zeros_like(dht)
        if window is not None:
            dS_end[s - 1] = steps.walk(c0 + window, c0, zero)
            truncated += 1
        else:
            F = steps.walk(c1, c0, zero)
            dS_end[s - 1] = steps.walk(c1, c0, dS_end[s], homogeneous=True) + F
    dS_tape = torch.empty(p.gcum.shape[0], *dht.shape)
    dv_tape = torch.empty(p.u.shape)
    for s, (c0, c1) in enumerate(segments):
        steps.walk(c1, c0, dS_end[s], dS_tape, dv_tape)
    return dS_tape, dv_tape, truncated, len(segments) - 1


def compare(tokens: int, seg: int, gate: str, heads: int, seed: int = 0) -> dict:
    """{form: (max tape difference, truncated cuts / cuts, {gradient: rel-RMS})}."""
    testing_gate = gate in ("normal", "strong", "slow")
    inp = make_gdn_inputs([tokens], 1, heads, 128, 128, gate=gate if testing_gate else "normal", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if gate in ("mamba", "logsigmoid"):
        inp["g"] = make_gate(tokens, heads, gate, gen, torch.device("cpu"))
    elif not testing_gate:  # a constant log decay per token
        inp["g"] = torch.full((tokens, heads), float(gate))
    do = torch.randn(tokens, heads, 128, generator=gen).bfloat16()
    dht = torch.randn(1, heads, 128, 128, generator=gen)
    scale = 128**-0.5
    args = [inp[n] for n in ("q", "k", "v", "g", "beta")]
    prep, rstd = pytorch_gdn.prepare(*args, inp["cu_seqlens"], True)
    tapes = pytorch_gdn.walk_tapes(prep, do, dht, None, scale)
    ref = [a.double().requires_grad_() for a in args]
    o, ht = gdn_reference(*ref, inp["cu_seqlens"], use_qk_l2norm=True)
    torch.autograd.backward([o, ht], [do.double(), dht.double()])
    steps = ReverseSteps(prep, do, scale)
    nc = (tokens + pytorch_gdn.CHUNK - 1) // pytorch_gdn.CHUNK
    out = {}
    for form, truncate in (("uncut", None), ("exact", False), ("truncated", True)):
        if truncate is None:
            t, counts = tapes, (0, 0)
        else:
            dS, dv, n_trunc, n_cuts = cut_tapes(steps, nc, seg, dht[0], truncate)
            dS[nc:], dv[nc:] = tapes.dS_end[nc:], tapes.dv_new[nc:]
            t, counts = tapes._replace(dS_end=dS, dv_new=dv), (n_trunc, n_cuts)
        diff = float((t.dS_end[:nc] - tapes.dS_end[:nc]).abs().max() / tapes.dS_end[:nc].abs().max())
        grads = pytorch_gdn.local_gradients(prep, rstd, t, do, scale, heads)
        out[form] = (diff, counts, {n: accuracy(x, r.grad).rel_rms for n, x, r in zip(NAMES, grads, ref)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096,
                        help="one document (the FP64 reference keeps every state: 16384 needs > 24 GB)")
    parser.add_argument("--seg", type=int, default=16, help="chunks a segment")
    parser.add_argument("--gate", default="mamba",
                        help="mamba, logsigmoid (cake_ops.bench), normal, strong, slow (cake_ops.testing) or a "
                        "constant log decay per token, e.g. -0.08 (a window of 4 chunks)")
    parser.add_argument("--heads", type=int, default=2, help="value heads (one q/k head)")
    args = parser.parse_args()
    for form, (diff, (n_trunc, n_cuts), errs) in compare(args.tokens, args.seg, args.gate, args.heads).items():
        print(f"{form:10s} dS tape max diff {diff:.2e}  truncated {n_trunc}/{n_cuts}  "
              + "  ".join(f"{n} {e:.2e}" for n, e in errs.items()), flush=True)


if __name__ == "__main__":
    main()

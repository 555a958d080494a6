#!/usr/bin/env python
"""The bits of one forward+backward of ``cake_ops.gdn`` per benchmark shape: saved by a
tree, compared across trees.

    python tools/gdn_bits.py save OUT.pt [--shapes s16k_h8,s32k_h16] [--device cuda] [--seed 0]
    python tools/gdn_bits.py compare A.pt B.pt [C.pt ...]

``save`` runs, per shape, the benchmark's inputs (``cake_ops.bench.shapes.make_inputs``,
the mamba gate) with an initial state and a final-state gradient, so that every output
and gradient is formed, through ``cake_ops.gdn`` with its defaults (deterministic, light
save mode) and the benchmark's in-op L2 norm, in whatever tree imports as ``cake_ops``;
it saves o, the final state and the gradient of every input. ``compare`` says, per shape,
whether each later file's tensors are bitwise the first's, and where not, how many
elements of which tensor differ and by how much at most.

``tools/ab_csrc.py run --bits`` does both across its trees: a change meant to keep the
arithmetic (a new load path, a refactor) shows bitwise equal in the same call, one that
changes it shows where.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cake_ops  # noqa: E402  (the tree's, after the path above)
from cake_ops.bench.shapes import SHAPES, Shape, make_inputs, shape_names  # noqa: E402


def run_shape(shape: Shape, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """o, the final state and every input's gradient of one forward+backward (copied to the CPU)."""
    inp = make_inputs(shape, device, "mamba", seed)
    N = len(shape.docs)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    h0 = torch.randn(N, shape.HV, shape.K, shape.V, generator=gen, device=device) * 0.1
    dht = torch.randn(N, shape.HV, shape.K, shape.V, generator=gen, device=device) * 0.1
    leaves = {"q": inp.q, "k": inp.k, "v": inp.v, "g": inp.g, "beta": inp.beta, "initial_state": h0}
    leaves = {n: x.detach().clone().requires_grad_() for n, x in leaves.items()}
    o, ht = cake_ops.gdn(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], inp.cu_seqlens,
        initial_state=leaves["initial_state"], output_final_state=True, use_qk_l2norm=True,
    )
    torch.autograd.backward([o, ht], [inp.do, dht])
    out = {"o": o, "final_state": ht}
    out.update({"d" + n: x.grad for n, x in leaves.items()})
    return {n: x.detach().cpu() for n, x in out.items()}


def save(path: str, shapes: list[Shape], device: torch.device, seed: int) -> None:
    torch.save({s.name: run_shape(s, device, seed) for s in shapes}, path)


def compare(paths: list[str]) -> tuple[list[str], bool]:
    """Lines of the report, and whether every file is bitwise the first."""
    files = [torch.load(p) for p in paths]
    names = [Path(p).stem for p in paths]
    lines, equal = [], True
    for shape in files[0]:
        for name, other in zip(names[1:], files[1:]):
            if shape not in other:
                lines.append(f"{shape}: {name} has no result")
                equal = False
                continue
            diffs = []
            for t, x in files[0][shape].items():
                y = other[shape].get(t)
                if y is None or y.shape != x.shape or y.dtype != x.dtype:
                    diffs.append(f"{t} missing or of another shape or dtype")
                elif not torch.equal(x, y):
                    d = (x.double() - y.double()).abs()
                    n = int((x != y).sum())
                    diffs.append(f"{t} {n} of {x.numel()} elements (max |diff| {float(d.max()):.3e})")
            equal = equal and not diffs
            lines.append(f"{shape}: {name} " + ("bitwise equal to " + names[0] if not diffs
                                                else f"differs from {names[0]}: " + "; ".join(diffs)))
    return lines, equal


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sv = sub.add_parser("save")
    sv.add_argument("out")
    sv.add_argument("--shapes", default="s16k_h8")
    sv.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    sv.add_argument("--seed", type=int, default=0)
    cp = sub.add_parser("compare")
    cp.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.cmd == "save":
        try:
            names = shape_names(args.shapes)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        save(args.out, [SHAPES[s] for s in names], torch.device(args.device), args.seed)
        print(f"saved {args.out}")
        return 0
    lines, equal = compare(args.files)
    print("\n".join(lines))
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())

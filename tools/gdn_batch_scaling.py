#!/usr/bin/env python
"""The single-device GDN forward+backward's kernel time as the batch shrinks: what KCP's
per-rank ratio comes down to where no document crosses a rank boundary (docs/kcp.md,
"Measured").

    python tools/gdn_batch_scaling.py [--device cuda] [--calls 3]

Packs of 64, 32 and 16 documents of 4096 tokens at (H, HV) = (2, 6), and 2 x 131072,
2 x 65536, 1 x 65536 tokens at (16, 48): per pack the median ``kernel_ms`` of the
benchmark's single-device step (``cake_ops.gdn`` with the in-op L2 norm, then
``torch.autograd.grad``) and the time per 1000 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cake_ops.bench.kcp import _single_step  # noqa: E402
from cake_ops.bench.shapes import Shape, make_inputs  # noqa: E402
from cake_ops.bench.timing import Timer  # noqa: E402

PACKS = (("64x4096 h2", (4096,) * 64, 2, 6), ("32x4096 h2", (4096,) * 32, 2, 6), ("16x4096 h2", (4096,) * 16, 2, 6),
         ("2x131072 h16", (131072,) * 2, 16, 48), ("2x65536 h16", (65536,) * 2, 16, 48),
         ("1x65536 h16", (65536,), 16, 48))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    timer = Timer(device)
    for name, docs, H, HV in PACKS:
        inp = make_inputs(Shape(name, docs, H, HV), device, "mamba", 0)
        step = _single_step(inp)
        for _ in range(2):
            step()
        timer.sync()
        ms = statistics.median(timer.kernel_ms(step, 1)[0] for _ in range(args.calls))
        print(f"{name:14s} tokens {sum(docs):7d}  fwdbwd kernel_ms {ms:8.3f}  per 1k tokens {1000 * ms / sum(docs):.4f}",
              flush=True)
        del inp, step


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Kernel time of a KCP forward+backward (``gdn_kcp``) with W ranks as threads on one
GPU, against the single-GPU ``cake_ops.gdn`` forward+backward of the same global batch.

    python tools/kcp_rank_threads_time.py --shape s256k_h2 --world 2 --layout C [--calls 3]
    python tools/kcp_rank_threads_time.py --docs 131072,131072 --heads 16,48 --world 2

The ranks share the GPU and its default stream, so the device time of a KCP step is the
sum of the ranks' work; over W it is a rank's mean compute, which issue 20's target
bounds by 1.15 x (single-GPU time) / W. Prints both, their ratio, and the bytes each rank
sends per step (the summaries' all-gather). Kernel time from the profiler, as the
benchmark's ``kernel_ms`` (cake_ops.bench.timing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import cake_ops  # noqa: E402
from cake_ops.bench.shapes import SHAPES, Shape  # noqa: E402
from cake_ops.bench.timing import Timer  # noqa: E402
from cake_ops.kcp import build_context_kcp, gdn_kcp  # noqa: E402
from cake_ops.testing import make_gdn_inputs, run_rank_threads  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="s256k_h2")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layout", default="C")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--docs", default=None, help="document lengths, comma list (instead of --shape)")
    ap.add_argument("--heads", default="16,48", help="H,HV with --docs")
    args = ap.parse_args()
    if args.docs:
        H, HV = (int(x) for x in args.heads.split(","))
        s = Shape("custom", tuple(int(x) for x in args.docs.split(",")), H, HV)
        args.shape = f"docs {args.docs} (H, HV) = ({H}, {HV})"
    else:
        s = SHAPES[args.shape]
    inp = make_gdn_inputs(list(s.docs), s.H, s.HV, 128, 128, device="cuda", seed=0)
    do = torch.randn_like(inp["v"])
    leaves = [inp[n].detach().requires_grad_(True) for n in NAMES]

    def single():
        o, _ = cake_ops.gdn(*leaves, inp["cu_seqlens"], use_qk_l2norm=True)
        torch.autograd.grad(o, leaves, do)

    sent = {}

    def rank_step(rank, world):
        ctx = build_context_kcp(inp["cu_seqlens"].cpu(), layout=args.layout, device="cuda")
        local = [ctx.shard(inp[n]).detach().requires_grad_(True) for n in NAMES]
        o, _ = gdn_kcp(*local, ctx, use_qk_l2norm=True)
        torch.autograd.grad(o, local, ctx.shard(do))
        sent[rank] = ctx.source_slots * s.HV * 128 * 256 * 4  # [E | M] fp32 per source slot

    def kcp():
        run_rank_threads(rank_step, args.world, timeout=600)

    timer = Timer(torch.device("cuda"))
    for fn in (single, kcp):
        fn()
        timer.sync()
    t_single = statistics.median(timer.kernel_ms(single, 1)[0] for _ in range(args.calls))
    t_kcp = statistics.median(timer.kernel_ms(kcp, 1)[0] for _ in range(args.calls))
    per_rank = t_kcp / args.world
    print(f"{args.shape} CP{args.world} layout {args.layout}: single-GPU fwdbwd {t_single:.3f} ms; KCP all ranks "
          f"{t_kcp:.3f} ms, per rank {per_rank:.3f} ms = {per_rank / (t_single / args.world):.2f} x single / W; "
          f"all-gather sends {max(sent.values()) / 2**20:.2f} MiB per rank")


if __name__ == "__main__":
    main()

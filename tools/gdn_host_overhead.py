#!/usr/bin/env python
"""Host time per call of the CUDA GDN forward, layer by layer: what bounds stream_ms
when the kernels are short.

    python tools/gdn_host_overhead.py [--calls 300] [--profile]   # repo root, Hopper GPU

Times calls issued back to back with no sync (host time) and with the final sync (wall),
few enough (--calls 100, 5 launches each) that the launch queue never fills and blocks
the host on the GPU, for: cake_ops.gdn with grad-requiring inputs (what a training step and the benchmark's
fwd op run), torch.ops.cake.gdn_fwd under no_grad (the custom op without autograd), and
the raw extension op torch.ops.cake_cuda.gdn_fwd. Shape: s16k_h8 (4 x 4096 tokens,
(H, HV) = (8, 16)), deterministic, in-op L2 norm. --profile adds a cProfile of the first.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import cake_ops  # noqa: E402
from cake_ops import build  # noqa: E402
from cake_ops.testing import make_gdn_inputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    ops = build.load()
    inp = make_gdn_inputs([4096] * 4, 8, 16, 128, 128, device="cuda", seed=0)
    q, k, v, g, beta = (inp[n].detach().requires_grad_(True) for n in ("q", "k", "v", "g", "beta"))
    cu, scale = inp["cu_seqlens"], 128**-0.5

    def gdn_with_grad():
        with torch.enable_grad():
            return cake_ops.gdn(q, k, v, g, beta, cu, use_qk_l2norm=True)[0]

    def custom_op_no_grad():
        with torch.no_grad():
            return torch.ops.cake.gdn_fwd(q, k, v, g, beta, cu, None, scale, True, True)[0]

    def extension_op():
        return ops.gdn_fwd(q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(), cu, None, scale, True,
                           True, -1)[0]

    for name, fn in (("cake_ops.gdn, grad", gdn_with_grad), ("cake::gdn_fwd, no_grad", custom_op_no_grad),
                     ("cake_cuda.gdn_fwd", extension_op)):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"{name:24s} host {1e6 * (t1 - t0) / args.calls:7.1f} us/call   wall {1e6 * (t2 - t0) / args.calls:7.1f} us/call")

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            gdn_with_grad()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        print(out.getvalue())


if __name__ == "__main__":
    main()

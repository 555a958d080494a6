#!/usr/bin/env python
"""Host time per call of the CUDA GDN forward or forward+backward, layer by layer: what
bounds stream_ms when the kernels are short.

    python tools/gdn_host_overhead.py [--op fwd|fwdbwd] [--calls 100] [--profile] [--ops-table]
                                      [--stub-kernels]

Times calls issued back to back with no sync (host time) and with the final sync (wall),
few enough (--calls 100) that the launch queue never fills and blocks the host on the
GPU. Layers, --op fwd: cake_ops.gdn with grad-requiring inputs (what a training step and
the benchmark's fwd op run), torch.ops.cake.gdn_fwd under no_grad (the custom op without
autograd), the raw extension op torch.ops.cake_cuda.gdn_fwd. --op fwdbwd: the
benchmark's fwdbwd step (cake_ops.gdn, then torch.autograd.grad of o with do), the same
step with graph="replay" (each op's launches replayed from its CUDA graph), the two
custom ops cake::gdn_fwd and cake::gdn_bwd under no_grad, and the two raw extension ops.
Shape: s16k_h8 (4 x 4096 tokens, (H, HV) = (8, 16)), deterministic, in-op L2 norm.
--profile adds a cProfile of the first layer (--layer N: the N-th); --ops-table the torch
profiler's table of its host-side ops (self CPU time), which shows what runs besides the
kernels' launches. --stub-kernels runs on the CPU, on any machine: the two ops' CPU kernels
replaced by the ops' fake kernels (meta/gdn.py: empty outputs), so the layers above the
kernels (cake_ops.gdn's Python, the custom ops' dispatch and autograd) are timed alone;
the extension-op layers are left out (docs/kernels.md, "Next", host time).
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


def stub_kernels() -> None:
    """The ops' fake kernels (meta/gdn.py: the ops' static checks, then empty outputs of
    their shapes and dtypes) as the CPU kernels of cake::gdn_fwd and cake::gdn_bwd: the
    layers above the kernels, timed without the kernels' work."""
    from cake_ops.meta import gdn as fake  # loaded by `import cake_ops`
    from cake_ops.ops import gdn as gdn_ops

    gdn_ops.gdn_fwd.register_kernel("cpu")(fake.gdn_fwd)
    gdn_ops.gdn_bwd.register_kernel("cpu")(fake.gdn_bwd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=("fwd", "fwdbwd"), default="fwd")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--shape", default="s16k_h8", help="a benchmark shape (cake_ops.bench.shapes)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ops-table", action="store_true")
    ap.add_argument("--layer", type=int, default=0, help="the layer --profile and --ops-table look at (0: the first)")
    ap.add_argument("--stub-kernels", action="store_true", help="on the CPU, the ops' kernels returning empty outputs")
    args = ap.parse_args()

    from cake_ops.bench.shapes import SHAPES

    shape = SHAPES[args.shape]
    device = "cpu" if args.stub_kernels else "cuda"
    if args.stub_kernels:
        stub_kernels()
    else:
        ops = build.load()
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    inp = make_gdn_inputs(list(shape.docs), shape.H, shape.HV, 128, 128, device=device, seed=0)
    leaves = [inp[n].detach().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
    q, k, v, g, beta = leaves
    qd, kd, vd, gd, bd = (t.detach() for t in leaves)
    cu, scale = inp["cu_seqlens"], 128**-0.5
    do = torch.randn_like(vd)

    def gdn_with_grad():
        with torch.enable_grad():
            return cake_ops.gdn(q, k, v, g, beta, cu, use_qk_l2norm=True)[0]

    def custom_op_no_grad():
        with torch.no_grad():
            return torch.ops.cake.gdn_fwd(q, k, v, g, beta, cu, None, scale, True, True)[0]

    def extension_op():
        return ops.gdn_fwd(qd, kd, vd, gd, bd, cu, None, scale, True, True, -1)[0]

    def fwdbwd_step():
        with torch.enable_grad():
            o = cake_ops.gdn(q, k, v, g, beta, cu, use_qk_l2norm=True)[0]
            return torch.autograd.grad(o, leaves, do)

    def fwdbwd_step_replay():
        with torch.enable_grad():
            o = cake_ops.gdn(q, k, v, g, beta, cu, use_qk_l2norm=True, graph="replay")[0]
            return torch.autograd.grad(o, leaves, do)

    def custom_ops_fwdbwd():
        with torch.no_grad():
            torch.ops.cake.gdn_fwd(qd, kd, vd, gd, bd, cu, None, scale, True, True)
            return torch.ops.cake.gdn_bwd(do, None, qd, kd, vd, gd, bd, cu, None, scale, True, True)

    def extension_fwdbwd():
        ops.gdn_fwd(qd, kd, vd, gd, bd, cu, None, scale, True, True, -1)
        return ops.gdn_bwd(do, None, qd, kd, vd, gd, bd, cu, None, scale, True, True, -1, -1, -1, None)

    layers = ((("cake_ops.gdn, grad", gdn_with_grad), ("cake::gdn_fwd, no_grad", custom_op_no_grad),
               ("cake_cuda.gdn_fwd", extension_op)) if args.op == "fwd" else
              (("fwdbwd step", fwdbwd_step), ("fwdbwd step, graph='replay'", fwdbwd_step_replay),
               ("cake:: fwd + bwd, no_grad", custom_ops_fwdbwd),
               ("cake_cuda fwd + bwd", extension_fwdbwd)))
    if args.stub_kernels:  # no extension ops, and graph replay is a CUDA path
        layers = tuple(l for l in layers if l[1] not in (extension_op, extension_fwdbwd, fwdbwd_step_replay))
    where = "CPU, stubbed kernels" if args.stub_kernels else torch.cuda.get_device_name()
    print(f"{args.op} at {shape.name}, {where}, torch {torch.__version__}")
    for name, fn in layers:
        for _ in range(20):
            fn()
        synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        t1 = time.perf_counter()
        synchronize()
        t2 = time.perf_counter()
        print(f"{name:28s} host {1e6 * (t1 - t0) / args.calls:7.1f} us/call   wall {1e6 * (t2 - t0) / args.calls:7.1f} us/call")

    first = layers[args.layer][1]
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            first()
        prof.disable()
        synchronize()
        for key in ("tottime", "cumtime"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(25)
            print(out.getvalue())
    if args.ops_table:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.calls):
                first()
        synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""What a CTA of the chunk-local gradient kernel costs besides its value heads: the
kernel timed at one tile count over group sizes G = HV / H, and each CTA's time fitted
as F + G h (a Hopper GPU; docs/kernels.md, Backward, "Next").

    python tools/gdn_bwd_local_group_cost.py [--hv 12] [--tokens 65536] [--groups 1,2,3,4,6,12]
                                             [--l2 both] [--calls 20]

One CTA of ``torch.ops.cake_cuda.gdn_bwd_local`` (csrc/gdn/bwd_local.cu) takes one
(chunk, q/k head) and loops over its G value heads; besides them it loads q and k, normalises
them (with the in-op L2 norm), runs the group's dPs / dkk products, the norm's backward and
stores dq, dk, and before its first head it waits for its first loads with nothing to do. The
benchmark's shapes are all GVA (G = 2 or 3) and measured about 12.5 us of an SM per
(chunk, value head) tile at G = 2 (s16k_h8) against 10.7 at G = 3 (s32k_h16), which that
split put at about 10 us a CTA besides about 7 us a head; measured here (429c6af) it is
about 5 us a CTA with the norm (3.4 without) and 9.2 us a head. This tool measures it at a fixed
tile count (HV value heads, --tokens in documents of 4096): for each G dividing HV,
H = HV / G q/k heads, so the tiles (chunks x HV) stay the same while the CTAs (chunks x H)
fall as 1 / G. Per G it prints the kernel's median ms by CUDA events, the SM time per tile
and per CTA (ms x SMs / count), and the least-squares fit of per-CTA time = F + G h with
its residuals. The tapes are random (the kernel's time does not depend on their values);
no initial state, no final-state gradient, fp32 beta. Repo root.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

C, D, DOC = 64, 128, 4096  # chunk, head dim, document length


def fit_fixed_and_per_head(groups: list[int], per_cta_us: list[float]) -> tuple[float, float, list[float]]:
    """Least squares of per-CTA time = F + G h over the groups: (F, h, residuals)."""
    n = len(groups)
    if n < 2 or len(set(groups)) < 2:
        raise ValueError("the fit needs at least two different group sizes")
    mg = sum(groups) / n
    mt = sum(per_cta_us) / n
    h = sum((g - mg) * (t - mt) for g, t in zip(groups, per_cta_us)) / sum((g - mg) ** 2 for g in groups)
    F = mt - h * mg
    return F, h, [t - (F + h * g) for g, t in zip(groups, per_cta_us)]


def group_sizes(hv: int, wanted: list[int]) -> list[int]:
    """The wanted group sizes that divide HV (so that H = HV / G q/k heads), in order."""
    return [g for g in wanted if g >= 1 and hv % g == 0]


def _inputs(T: int, H: int, HV: int, dev: torch.device, gen: torch.Generator) -> dict:
    N = T // DOC
    NC = T // C + N  # the kernel's chunk slots, ceil(T / 64) + N
    bf = torch.bfloat16

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen, device=dev) * scale).to(bf)

    g = -torch.rand(T, HV, generator=gen, device=dev) * 0.1
    # gcum of each chunk slot: a decreasing cumsum inside the chunk (unused slots too).
    gcum = torch.cumsum(-torch.rand(NC, HV, C, generator=gen, device=dev) * 0.1, -1)
    A = torch.tril(torch.randn(NC, HV, C, C, generator=gen, device=dev) * 0.05, -1) + torch.eye(C, device=dev)
    return dict(
        q=randn(T, H, D), k=randn(T, H, D), v=randn(T, HV, D), do=randn(T, HV, D), g=g,
        beta=torch.rand(T, HV, generator=gen, device=dev), gcum=gcum, A=A.to(bf),
        h=randn(NC, HV, D, D, scale=0.1), dS=randn(NC, HV, D, D, scale=0.1), dv_new=randn(T, HV, D),
        chunk_offsets=torch.arange(N + 1, device=dev, dtype=torch.int32) * (DOC // C),
        cu_seqlens=torch.arange(N + 1, device=dev, dtype=torch.int32) * DOC,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hv", type=int, default=12, help="value heads (the tile count is chunks x HV)")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens, a multiple of 4096")
    ap.add_argument("--groups", default="1,2,3,4,6,12", help="group sizes G = HV / H (those dividing HV)")
    ap.add_argument("--l2", default="both", choices=("on", "off", "both"), help="the in-op q / k L2 norm")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args(argv)
    if args.tokens % DOC or args.tokens <= 0:
        ap.error(f"--tokens must be a positive multiple of {DOC}")
    groups = group_sizes(args.hv, [int(x) for x in args.groups.split(",")])
    if len(groups) < 2:
        ap.error(f"--groups: at least two sizes must divide --hv {args.hv}")

    from cake_ops import build

    ops = build.load()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    T, chunks = args.tokens, args.tokens // C
    tiles = chunks * args.hv
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; T = {T} in documents of {DOC}, HV = {args.hv}: "
          f"{tiles} tiles (chunk, value head)")
    for l2 in {"on": [True], "off": [False], "both": [True, False]}[args.l2]:
        rows = []
        for G in groups:
            H = args.hv // G
            x = _inputs(T, H, args.hv, dev, torch.Generator(device=dev).manual_seed(G))

            def call():
                return ops.gdn_bwd_local(x["q"], x["k"], x["v"], x["do"], x["g"], x["beta"], x["gcum"], x["A"], x["h"],
                                         x["dS"], x["dv_new"], None, None, x["chunk_offsets"], x["cu_seqlens"],
                                         D**-0.5, l2)

            for _ in range(3):
                call()
            times = []
            for _ in range(args.calls):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            ms = statistics.median(times)
            ctas = chunks * H
            rows.append((G, H, ctas, ms, ms * 1e3 * sms / tiles, ms * 1e3 * sms / ctas))
            del x
        F, h, res = fit_fixed_and_per_head([r[0] for r in rows], [r[5] for r in rows])
        print(f"\nL2 norm {'on' if l2 else 'off'}")
        print(f"{'G':>3} {'H':>3} {'CTAs':>6} {'ms':>8} {'us/tile':>8} {'us/CTA':>8} {'fit res':>8}")
        for (G, H, ctas, ms, per_tile, per_cta), r in zip(rows, res):
            print(f"{G:3d} {H:3d} {ctas:6d} {ms:8.3f} {per_tile:8.2f} {per_cta:8.2f} {r:8.2f}")
        print(f"fit: per CTA = F + G h, F = {F:.2f} us (the CTA's own work and waits), h = {h:.2f} us a value head; "
              f"at G = 3, F is {100 * F / (F + 3 * h):.0f} % of a CTA")


if __name__ == "__main__":
    main()

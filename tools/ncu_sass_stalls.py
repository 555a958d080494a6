#!/usr/bin/env python
"""Where a warp-specialised kernel's warps stall, from an Nsight Compute source export.

    ncu --kernel-name regex:gdn_fwd_walk_kernel --launch-skip 1 --launch-count 1 \
        --section WarpStateStats --section SourceCounters -o walk python3 <script>
    ncu -i walk.ncu-rep --page source --csv --print-source sass > walk_sass.csv
    python tools/ncu_sass_stalls.py walk_sass.csv [--top 20]

Warps of different roles run different code, so an instruction's execution count tells
the role apart (e.g. in the GDN walk the state warps execute their loop twice as often
as the aux warps). Per execution count: instructions per warp and chunk are not known
here, so the script prints, for each count, the sampled stall reasons and the opcode
mix (executions and samples), then the most-sampled instructions with their reasons.
"""

from __future__ import annotations

import argparse
import collections
import csv


def _num(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20, help="most-sampled instructions to list")
    ap.add_argument("--min-exec", type=float, default=1000, help="ignore execution counts below this")
    args = ap.parse_args()

    rows = list(csv.reader(open(args.csv)))
    header_at = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    hdr, data = rows[header_at], rows[header_at + 1 :]
    i_src, i_smp = hdr.index("Source"), hdr.index("Warp Stall Sampling (All Samples)")
    i_exe = hdr.index("Instructions Executed")
    reasons = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]
    i_rsn = {h: hdr.index(h) for h in reasons}

    by_count: dict[float, dict] = collections.defaultdict(
        lambda: {"reasons": collections.Counter(), "ops": collections.Counter(), "op_smp": collections.Counter()}
    )
    for r in data:
        e = _num(r[i_exe])
        if e < args.min_exec:
            continue
        g = by_count[e]
        for h in reasons:
            g["reasons"][h[len("stall_"):]] += _num(r[i_rsn[h]])
        words = r[i_src].split()
        op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?"))
        g["ops"][op.split(".")[0]] += e
        g["op_smp"][op.split(".")[0]] += _num(r[i_smp])

    for e, g in sorted(by_count.items(), key=lambda kv: -sum(kv[1]["reasons"].values())):
        total = sum(g["reasons"].values())
        if total == 0:
            continue
        print(f"== instructions executed {int(e)} times: {int(total)} samples")
        print("   stalls: " + ", ".join(f"{k} {v / total:.0%}" for k, v in g["reasons"].most_common(8) if v))
        print("   opcodes (executions, samples): " + ", ".join(
            f"{k} {int(v)}/{int(g['op_smp'][k])}" for k, v in g["ops"].most_common(14)))
    print(f"== top {args.top} instructions by samples")
    for idx in sorted(range(len(data)), key=lambda i: -_num(data[i][i_smp]))[: args.top]:
        r = data[idx]
        why = sorted(((h[len("stall_"):], _num(r[i_rsn[h]])) for h in reasons), key=lambda x: -x[1])[:3]
        print(f"  #{idx:5d} exec {int(_num(r[i_exe])):7d} samples {int(_num(r[i_smp])):6d}  "
              f"{r[i_src].strip()[:60]:60s} {', '.join(f'{k} {int(v)}' for k, v in why if v)}")


if __name__ == "__main__":
    main()

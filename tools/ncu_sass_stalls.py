#!/usr/bin/env python
"""Where a warp-specialised kernel's warps stall, from an Nsight Compute source export.

    ncu --kernel-name regex:gdn_fwd_walk_kernel --launch-skip 1 --launch-count 1 \
        --section WarpStateStats --section SourceCounters -o walk python3 <script>
    ncu -i walk.ncu-rep --page source --csv --print-source sass > walk_sass.csv
    python tools/ncu_sass_stalls.py walk_sass.csv [--top 20] [--cubin walk.cubin --kernel gdn_fwd_walk]
        [--roles fwd_walk.cu:LINE=aux,fwd_walk.cu:LINE=state]

Warps of different roles run different code, so an instruction's execution count tells
the role apart (e.g. in the GDN walk the state warps execute their loop twice as often
as the aux warps). Per execution count: instructions per warp and chunk are not known
here, so the script prints, for each count, the sampled stall reasons and the opcode
mix (executions and samples), then the most-sampled instructions with their reasons.

With --cubin, also the samples per source line (file:line, the reasons, the line's
text): the export's instructions are matched by offset to the line table of the same
kernel compiled to a cubin with the build's flags, e.g.

    nvcc -cubin -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -I csrc \
        csrc/gdn/bwd_local.cu -o bwd_local.cubin

(nvdisasm --print-line-info-inline reads it; the opcodes are compared instruction by
instruction, so a cubin of other code is refused. Where the toolkit has no nvdisasm, as on the CPU
machine, PyPI's nvidia-cuda-nvdisasm wheel holds one: `pip download --no-deps
nvidia-cuda-nvdisasm`, unzip, pass nvidia/cu13/bin/nvdisasm as --nvdisasm; it also reads a
locally compiled cubin's SASS without any GPU.) The source lines are printed from the paths the
cubin names, where they exist here. The cubin's flags must be the build's, torch's defines
included (-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
-D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr):
without them the code differs and the export is refused.

With --roles (the calls that enter each role, as file name:line), also each role's share
of the samples and, within it, its sites: the role's own lines that lead to the sampled
instructions (through the inlined call chain), e.g. which of its waits. Every warp is
sampled at the same rate, so a role's sites are where its time goes.

On the H200 machine ncu reads the counters with --clock-control none (Firecracker; see
the device notes).
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import shutil
import subprocess
from pathlib import Path


def _num(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return 0.0


def _opcode(text: str) -> str:
    words = text.split()
    op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?")
    return op.split(".")[0]


def line_table(sass: str, kernel: str) -> dict[int, tuple[str, int, str, tuple]]:
    """{offset: (file, line, opcode, stack)} of the first function whose name holds `kernel`,
    from the text of nvdisasm --print-line-info-inline: stack is the inlined call chain as
    (file, line) pairs, innermost (the instruction's own line) first."""
    table: dict[int, tuple[str, int, str, tuple]] = {}
    inside, stack, in_run = False, (("?", 0),), False
    for line in sass.splitlines():
        if line.startswith(".text."):
            if inside:
                break
            inside = kernel in line
            continue
        if not inside:
            continue
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if m:  # a run of these lines is one instruction's chain, innermost first
            frame = (m.group(1), int(m.group(2)))
            stack, in_run = (stack + (frame,) if in_run else (frame,)), True
            continue
        in_run = False
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if m:
            table[int(m.group(1), 16)] = (stack[0][0], stack[0][1], _opcode(m.group(2).split(";")[0]), stack)
    if not table:
        raise SystemExit(f"no function with {kernel!r} in its name in the cubin")
    return table


def _matched_rows(hdr, data, table):
    """(the table's entry, the row) of each export row, matched by offset from the first
    row's address and by opcode: an export of other code is refused."""
    i_src = hdr.index("Source")
    base = int(data[0][0], 16)
    for r in data:
        off = int(r[0], 16) - base
        if off not in table or table[off][2] != _opcode(r[i_src]):
            raise SystemExit(f"instruction at +{off:#x} ({r[i_src].strip()}) is not the cubin's: other code?")
        yield table[off], r


def _add_samples(c: collections.Counter, hdr, r) -> None:
    """A row's samples into c: 'all' and each stall reason."""
    c["all"] += _num(r[hdr.index("Warp Stall Sampling (All Samples)")])
    for i, h in enumerate(hdr):
        if h.startswith("stall_") and "(Not Issued)" not in h:
            c[h[len("stall_"):]] += _num(r[i])


def _source_text(texts: dict[str, list[str]], f: str, ln: int, width: int) -> str:
    """Line ln of file f where it exists here (files read once into texts)."""
    if f not in texts:
        texts[f] = Path(f).read_text().splitlines() if Path(f).is_file() else []
    return texts[f][ln - 1].strip()[:width] if 0 < ln <= len(texts[f]) else ""


def samples_by_line(hdr, data, table) -> dict[tuple[str, int], collections.Counter]:
    """{(file, line): Counter of stall reasons (and 'all')} over the export's rows, whose
    first column is the instruction's address; offsets from the first row's."""
    out: dict[tuple[str, int], collections.Counter] = collections.defaultdict(collections.Counter)
    for entry, r in _matched_rows(hdr, data, table):
        _add_samples(out[entry[:2]], hdr, r)
    return out


def print_lines(by_line, top: int) -> None:
    total = sum(c["all"] for c in by_line.values()) or 1.0
    texts: dict[str, list[str]] = {}
    print(f"== top {top} source lines by samples")
    for (f, ln), c in sorted(by_line.items(), key=lambda kv: -kv[1]["all"])[:top]:
        why = ", ".join(f"{k} {v / total:.1%}" for k, v in c.most_common(4) if k != "all" and v)[:48]
        print(f"  {c['all'] / total:6.1%}  {Path(f).name}:{ln:<5d} [{why}] {_source_text(texts, f, ln, 70)}")


def samples_by_role(hdr, data, table, roles: dict[tuple[str, int], str]):
    """{role: {site: Counter of stall reasons (and 'all')}}: each instruction's samples go to
    the role whose entry call (file name, line) is in its inlined chain, and to the site, the
    role's own line that leads to it (the frame just inside the entry call: e.g. which wait
    of the role); 'other' where no role's call is in the chain."""
    out = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    for entry, r in _matched_rows(hdr, data, table):
        stack = entry[3]
        role, site = "other", stack[-1]
        for i, (f, ln) in enumerate(stack):
            if (Path(f).name, ln) in roles:
                role, site = roles[(Path(f).name, ln)], stack[max(i - 1, 0)]
                break
        _add_samples(out[role][site], hdr, r)
    return out


def print_roles(by_role, top: int) -> None:
    total = sum(c["all"] for sites in by_role.values() for c in sites.values()) or 1.0
    texts: dict[str, list[str]] = {}
    for role, sites in sorted(by_role.items(), key=lambda kv: -sum(c["all"] for c in kv[1].values())):
        n = sum(c["all"] for c in sites.values()) or 1.0
        print(f"== role {role}: {n / total:.1%} of the samples; its sites (share of the role)")
        for (f, ln), c in sorted(sites.items(), key=lambda kv: -kv[1]["all"])[:top]:
            why = ", ".join(f"{k} {v / c['all']:.0%}" for k, v in c.most_common(4) if k != "all" and v)[:40]
            print(f"  {c['all'] / n:6.1%}  {Path(f).name}:{ln:<5d} [{why}] {_source_text(texts, f, ln, 60)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20, help="most-sampled instructions to list")
    ap.add_argument("--min-exec", type=float, default=1000, help="ignore execution counts below this")
    ap.add_argument("--cubin", help="the kernel compiled with -lineinfo: samples per source line too")
    ap.add_argument("--kernel", default="", help="with --cubin: a part of the kernel's (mangled) name")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    ap.add_argument("--roles", default="", help="with --cubin: FILE:LINE=NAME,... the calls that enter "
                    "each role of a warp-specialised kernel (file name, line): samples per role and site")
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
    if args.cubin:
        sass = subprocess.run([args.nvdisasm, "--print-line-info-inline", args.cubin], capture_output=True,
                              text=True, check=True).stdout
        table = line_table(sass, args.kernel)
        print_lines(samples_by_line(hdr, data, table), args.top)
        if args.roles:
            roles = {}
            for item in args.roles.split(","):
                where, name = item.split("=")
                f, ln = where.rsplit(":", 1)
                roles[(f, int(ln))] = name
            print_roles(samples_by_role(hdr, data, table, roles), args.top)


if __name__ == "__main__":
    main()

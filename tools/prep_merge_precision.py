#!/usr/bin/env python
"""Error of the prep's A diag(beta) by the precision of its blocked inverse's merges.

    python tools/prep_merge_precision.py [--chunks 20] [--decay 0.1]   # CPU, a few seconds

The prep (csrc/gdn/fwd_prep.cu) forms A = (I + L)^-1 of a chunk blocked 16 x 16: the
diagonal blocks in fp32 FMA, then A_WJ = -A_WW sum_K L_WK A_KJ on tensor cores. This
emulates that order (diagonal blocks exact, merges with their operands as the tensor
cores take them, fp32 sums), folds in beta and rounds to bf16 as the walk reads it, and
prints the error against fp64 for unit keys (use_qk_l2norm) and raw keys (|k|^2 = 8),
with merges in fp32 (what 3xTF32 gives) and with operands rounded to TF32 (one product).
The rounding of A to bf16 sets the floor; a merge precision that stays at it costs
nothing. Random chunks: k ~ N(0, 1) rows, beta ~ U(0, 1), g = -decay |N(0, 1)|.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cake_ops.testing import accuracy  # noqa: E402

F32, F64 = torch.float32, torch.float64


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """To nearest TF32 (10 mantissa bits), ties away: the prep's round_tf32 (fp32 in, fp32 out)."""
    bits = x.to(F32).contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(F32)  # -0x2000 = 0xffffe000 as int32


def blocked_inverse(lower: torch.Tensor, operand) -> torch.Tensor:
    """(I + lower)^-1 for a strictly lower 64 x 64 fp32 matrix, in the prep's order."""
    a = torch.zeros(64, 64, dtype=F32)
    blk = [slice(16 * w, 16 * w + 16) for w in range(4)]
    eye = torch.eye(16, dtype=F64)
    for w in range(4):
        a[blk[w], blk[w]] = torch.linalg.inv(eye + lower[blk[w], blk[w]].to(F64)).to(F32)
    for w in range(1, 4):
        for j in range(w):
            t = torch.zeros(16, 16, dtype=F32)
            for k in range(j, w):
                t += operand(lower[blk[w], blk[k]]) @ operand(a[blk[k], blk[j]])
            a[blk[w], blk[j]] = -(operand(a[blk[w], blk[w]]) @ operand(t))
    return a


MERGES = {"fp32": lambda x: x, "tf32": round_tf32}


def worst_errors(keys: str, chunks: int, decay: float, seed: int = 0) -> dict[str, tuple[float, float]]:
    """Per merge precision, the worst (rel-RMS, max-abs ratio) of A diag(beta) in bf16
    over `chunks` random chunks; keys "unit" or "raw"."""
    gen = torch.Generator().manual_seed(seed)
    worst = {name: (0.0, 0.0) for name in MERGES}
    for _ in range(chunks):
        k = torch.randn(64, 128, generator=gen, dtype=F64)
        k = k / k.norm(dim=1, keepdim=True) if keys == "unit" else k * (8 / 128) ** 0.5
        beta = torch.rand(64, generator=gen, dtype=F64)
        gcum = torch.cumsum(-decay * torch.randn(64, generator=gen, dtype=F64).abs(), 0)
        gates = torch.exp(torch.clamp(gcum[:, None] - gcum[None, :], max=0))
        lower = torch.tril(beta[:, None] * gates * (k @ k.T), -1).to(F32)
        ref = torch.linalg.inv(torch.eye(64, dtype=F64) + lower.to(F64)) * beta[None, :]
        for name, operand in MERGES.items():
            a = blocked_inverse(lower, operand) * beta[None, :].to(F32)
            acc = accuracy(a.to(torch.bfloat16), ref)
            worst[name] = (max(worst[name][0], acc.rel_rms), max(worst[name][1], acc.max_abs_ratio))
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=20)
    p.add_argument("--decay", type=float, default=0.1, help="scale of -g per token (0: no decay, the hardest case)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for keys in ("unit", "raw"):
        for name, (rel, mx) in worst_errors(keys, args.chunks, args.decay, args.seed).items():
            print(f"{keys} keys, {name} merges: A diag(beta) in bf16, worst rel-RMS {rel:.2e}, max-abs ratio {mx:.2e}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The benchmark's peers (FLA and FlashQLA with what they import) as one .tar.xz that a GPU
machine without network unpacks and puts on PYTHONPATH (docs/benchmark.md, "Peers on the
GPU machine"). Made on a machine with PyPI:

    python tools/peers_archive.py .whl/peers.tar.xz     # repo root; .whl/ is git-ignored

downloads the pinned wheels (PEERS) for the GPU machine's Python 3.12 on x86_64 Linux,
installs them without dependencies into a folder ``peers/`` (pip's --target, for that
Python and platform), drops the bytecode pip compiled for this Python, and packs the folder
with xz -9: about 45 MB, under the 64 MiB that a device call carries, where the wheels
(about 81 MB) took two calls back to back on one warm machine. On the GPU machine, in the
call that times them (carrying the archive):

    tar -xJf .whl/peers.tar.xz -C /tmp && PYTHONPATH=/tmp/peers FLA_FLASH_QLA=0 python -m cake_ops.bench ...
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# The peers as measured in docs/benchmark.md and the README: fla-core (FLA's kernels),
# flash-qla and its TileLang with what TileLang imports.
PEERS = ("fla-core==0.6.0", "flash-qla==0.1.3", "tilelang==0.1.15", "apache-tvm-ffi==0.1.12",
         "torch-c-dlpack-ext==0.1.5", "z3-solver==4.15.4.0")
# The GPU machine's Python and the manylinux tags its wheels come in.
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")


def platform_args() -> list[str]:
    return [arg for p in PLATFORMS for arg in ("--platform", p)]


def one_wheel_per_project(wheels: list[str]) -> list[str]:
    """Of wheel file names, one per project: pip download fetches a project's wheel once per
    platform tag it matches, and pip install refuses two of one project. Kept: the one whose
    first platform tag comes first in PLATFORMS (the newest manylinux)."""
    def rank(name: str) -> int:
        tags = name[: -len(".whl")].split("-")[-1].split(".")
        return min((PLATFORMS.index(t) for t in tags if t in PLATFORMS), default=len(PLATFORMS))

    best: dict[str, str] = {}
    for name in sorted(wheels):
        project = name.split("-")[0].lower()
        if project not in best or rank(name) < rank(best[project]):
            best[project] = name
    return sorted(best.values())


def pip_target_args(wheel_dir: Path, target: Path) -> list[str]:
    """pip's arguments that install the downloaded wheels for the GPU machine's Python."""
    return ["install", "--quiet", "--no-deps", "--no-index", "--only-binary=:all:", "--python-version",
            PYTHON_VERSION, *platform_args(), "--target", str(target),
            *(str(wheel_dir / w) for w in one_wheel_per_project([p.name for p in wheel_dir.glob("*.whl")]))]


def pack(folder: Path, out: Path) -> None:
    """``folder`` as ``out`` (.tar.xz, xz preset 9), its top folder's name kept, no bytecode."""
    for cache in list(folder.rglob("__pycache__")):
        shutil.rmtree(cache)
    with tarfile.open(out, "w:xz", preset=9) as tar:
        tar.add(folder, arcname=folder.name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the archive to write (.tar.xz)")
    args = ap.parse_args(argv)
    if not args.out.name.endswith(".tar.xz"):
        ap.error(f"out must end in .tar.xz, got {args.out}")
    with tempfile.TemporaryDirectory() as tmp:
        wheels, target = Path(tmp) / "wheels", Path(tmp) / "peers"
        pip = [sys.executable, "-m", "pip"]
        subprocess.run([*pip, "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
                        PYTHON_VERSION, *platform_args(), "--dest", str(wheels), *PEERS], check=True)
        subprocess.run([*pip, *pip_target_args(wheels, target)], check=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        pack(target, args.out)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

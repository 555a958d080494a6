"""JIT build of the CUDA extension that provides ``torch.ops.cake_cuda``.

The sources in ``csrc/`` are compiled at first CUDA use by
``torch.utils.cpp_extension.load`` (ninja) into ``<cache>/<key>``, where the
cache is ``$CAKE_OPS_CACHE`` or ``~/.cache/cake_ops`` and the key hashes the
sources, the flags and the torch, CUDA, nvcc and Python versions: a changed
source or toolchain builds afresh, and processes on one machine share a build
under a file lock. ``pip install`` compiles nothing.

    python -m cake_ops.build              # prebuild; prints the cache path and time
    python -m cake_ops.build --print-key  # the key and hashed sources, no build

Set ``CAKE_OPS_VERBOSE_BUILD=1`` to see the compiler commands.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils import cpp_extension

CUDA_CFLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo")
# The binding includes torch headers, so it uses torch's own language standard (C++20
# since torch 2.10, what cpp_extension passes by default); kernel files include no
# torch header and stay C++17.
CFLAGS = ("-O3", "-std=c++20")
# The shared libstdc++ by its file name, ahead of torch's libraries: on the H200 image
# the extension linked without it (and with a plain -lstdc++) came out with no
# libstdc++.so dependency and its own copies of libstdc++'s ostream code, whose locale
# lookups crashed (SIGSEGV) the first time an error message formatted an integer; why
# the link picked a static copy is not pinned down. Checked by tests/test_build.py
# test_binding_rejects_bad_arguments_with_runtime_error.
LDFLAGS = ("-l:libstdc++.so.6",)

_COMPILED_SUFFIXES = (".cu", ".cpp")
_HASHED_SUFFIXES = (".cu", ".cpp", ".h", ".cuh")

_ops = None
_load_lock = threading.Lock()


def csrc_dir() -> Path:
    """The CUDA sources: ``cake_ops/csrc`` when installed, ``<repo>/csrc`` in a checkout."""
    package = Path(__file__).resolve().parent
    candidates = (package / "csrc", package.parent / "csrc")
    for candidate in candidates:
        # binding.cpp marks our csrc, not some other project's folder beside site-packages.
        if (candidate / "binding.cpp").is_file():
            return candidate
    raise RuntimeError(
        f"cake_ops: CUDA sources not found in {' or '.join(map(str, candidates))}; "
        "reinstall cake-ops (the wheel ships them as package data)"
    )


def hashed_files(root: Path) -> list[Path]:
    """Every file of ``root`` that the build reads (sources and headers), sorted by name."""
    files = (p for p in root.rglob("*") if p.is_file() and p.suffix in _HASHED_SUFFIXES)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def compiled_files(root: Path) -> list[Path]:
    """The translation units: one kernel family per ``.cu`` plus the binding ``.cpp``."""
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _COMPILED_SUFFIXES)


def _nvcc() -> str | None:
    """The nvcc torch's build will run (``$CUDA_HOME/bin/nvcc``), else the one on PATH.

    A CPU build of torch has no CUDA_HOME; the PATH nvcc then still names the
    toolchain in ``--print-key``.
    """
    if cpp_extension.CUDA_HOME:
        nvcc = Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
        return str(nvcc) if nvcc.is_file() else None
    return shutil.which("nvcc")


@functools.cache
def _nvcc_version(nvcc: str | None) -> str:
    if nvcc is None:
        return "no nvcc"
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def build_key(
    root: Path | None = None,
    cuda_cflags: Sequence[str] = CUDA_CFLAGS,
    cflags: Sequence[str] = CFLAGS,
) -> str:
    """First 16 hex digits of a sha256 over everything that decides the binary."""
    root = csrc_dir() if root is None else root
    digest = hashlib.sha256()
    for path in hashed_files(root):
        data = path.read_bytes()
        # Name and length before the bytes, so no two file sets hash alike.
        digest.update(json.dumps([path.relative_to(root).as_posix(), len(data)]).encode())
        digest.update(data)
    toolchain = {
        "cuda_cflags": list(cuda_cflags),
        "cflags": list(cflags),
        "ldflags": list(LDFLAGS),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvcc": _nvcc_version(_nvcc()),
        # The extension links libtorch_python, built per Python version.
        "python": list(sys.version_info[:2]),
    }
    digest.update(json.dumps(toolchain, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("CAKE_OPS_CACHE") or Path.home() / ".cache" / "cake_ops")


def unavailable_reason() -> str | None:
    """Why the CUDA kernels cannot be built and run here, or None when they can."""
    if torch.version.cuda is None:
        return (
            f"this PyTorch ({torch.__version__}) is built without CUDA; install a CUDA "
            "build of torch, or use the PyTorch implementation (CPU)"
        )
    if not torch.cuda.is_available():
        return (
            "no CUDA device is visible; check the NVIDIA driver and CUDA_VISIBLE_DEVICES, "
            "or use the PyTorch implementation"
        )
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) != (9, 0):
            return (
                f"GPU {index} ({torch.cuda.get_device_name(index)}) has compute capability "
                f"{major}.{minor}, but the kernels are built for sm_90a only (Hopper: "
                "H100/H200); run on Hopper, or use the PyTorch implementation"
            )
    if _nvcc() is None:
        where = (
            f"{cpp_extension.CUDA_HOME}/bin/nvcc does not exist"
            if cpp_extension.CUDA_HOME
            else "no CUDA toolkit was found"
        )
        return (
            f"nvcc is needed to build the kernels at first use, but {where}; install the "
            "CUDA toolkit (12.x or newer, for sm_90a) and set CUDA_HOME to it"
        )
    if not cpp_extension.is_ninja_available():
        return (
            "ninja is needed to build the kernels but is not on PATH; `pip install ninja` "
            "(and activate the environment so that its bin/ is on PATH)"
        )
    return None


@functools.cache
def available() -> bool:
    """True when a Hopper GPU, nvcc and ninja are present: CUDA kernels can be used.

    Never raises; callers fall back to the PyTorch implementation when False.
    """
    return unavailable_reason() is None


def load():
    """Build (once per machine and key) and load the extension; returns ``torch.ops.cake_cuda``.

    Raises RuntimeError saying what is missing when the kernels cannot be used here.
    """
    global _ops
    with _load_lock:
        if _ops is None:
            reason = unavailable_reason()
            if reason is not None:
                raise RuntimeError(f"cake_ops CUDA kernels are unavailable: {reason}")
            _build_and_load(build_key())
            _ops = torch.ops.cake_cuda
    return _ops


def _build_and_load(key: str) -> None:
    build_directory = cache_dir() / key
    build_directory.mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f"{key}.lock", "w") as lock:
        # Serialises pytest-xdist workers and torchrun ranks: one builds, the rest
        # then find the build done; the lock is released when the file closes.
        fcntl.flock(lock, fcntl.LOCK_EX)
        # torch's own baton file outlives a build that was killed and then makes
        # every later load wait forever; under our lock nobody builds, so any
        # baton left is stale.
        (build_directory / "lock").unlink(missing_ok=True)
        cpp_extension.load(
            # The key in the name keeps two builds' libraries apart.
            name=f"cake_cuda_{key}",
            sources=[str(p) for p in compiled_files(csrc_dir())],
            extra_cflags=list(CFLAGS),
            extra_cuda_cflags=list(CUDA_CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_directory),
            is_python_module=False,
            verbose=os.environ.get("CAKE_OPS_VERBOSE_BUILD", "") not in ("", "0"),
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m cake_ops.build",
        description="Build the cake_ops CUDA extension into its cache.",
    )
    parser.add_argument(
        "--print-key",
        action="store_true",
        help="print the cache key and the files it hashes, without building",
    )
    args = parser.parse_args(argv)
    key = build_key()
    if args.print_key:
        print(f"key {key}")
        print(f"build_directory {cache_dir() / key}")
        for path in hashed_files(csrc_dir()):
            print(f"source {path}")
        return
    start = time.perf_counter()
    try:
        load()
    except RuntimeError as error:
        raise SystemExit(f"cake_ops.build: {error}") from error
    print(f"built {cache_dir() / key} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()

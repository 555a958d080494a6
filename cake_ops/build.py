"""JIT build of the CUDA extension that provides ``torch.ops.cake_cuda``.

The sources are the tree ``csrc/``: ``common/`` (shared headers) and one folder per
kernel family (``gdn/``, ``short_conv/``), each with its own ``binding.cpp`` that adds
the family's ops to ``cake_cuda`` (``TORCH_LIBRARY_FRAGMENT``). Every ``.cu`` and
``.cpp`` under ``csrc/`` is a translation unit, and every project ``#include`` is
relative to the csrc root, which the build passes as an include path (``-I``).

They are compiled at first CUDA use by ``torch.utils.cpp_extension.load`` (ninja) into
``<cache>/<key>``, where the cache is ``$CAKE_OPS_CACHE`` or ``~/.cache/cake_ops`` and
the key hashes every source and header (relative path and bytes), the flags, the
include paths and the torch, CUDA, nvcc and Python versions: a changed source or
toolchain builds afresh, and processes on one machine share a build under a file lock.
``pip install`` compiles nothing.

cpp_extension names each object file after its source's base name, so
``gdn/binding.cpp`` and ``short_conv/binding.cpp`` would both become ``binding.o``. The
build therefore hands it one generated unit per source, ``<key>/units/gdn__binding.cpp``
(the relative path with ``/`` as ``__``), which includes the real file by its
absolute path (so ``__FILE__``, line info and compiler messages name the real file).

    python -m cake_ops.build              # prebuild; prints the cache path and time
    python -m cake_ops.build --print-key  # the key, hashed sources and units, no build

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
# the link picked a static copy is not pinned down. Checked by
# tests/cuda/test_build.py test_binding_rejects_bad_arguments_with_runtime_error.
LDFLAGS = ("-l:libstdc++.so.6",)

# Include paths, relative to the csrc root: every project #include names a file from
# the root ("common/dtype.h", "gdn/gdn.h"). Relative here so that the key does not
# depend on where the tree lies.
INCLUDE_DIRS = (".",)

_COMPILED_SUFFIXES = (".cu", ".cpp")
_HASHED_SUFFIXES = (".cu", ".cpp", ".h", ".cuh")
# A file that only our csrc has, to tell it from some other project's csrc/ beside
# site-packages: the GDN family's binding. binding.cpp at the top is the flat layout
# that preceded the family folders (kept so that a checkout mid-move still builds).
_MARKERS = ("gdn/binding.cpp", "binding.cpp")
UNITS = "units"  # the generated translation units, a folder of the build directory

_ops = None
_load_lock = threading.Lock()


def csrc_dir() -> Path:
    """The CUDA sources: ``cake_ops/csrc`` when installed, ``<repo>/csrc`` in a checkout."""
    package = Path(__file__).resolve().parent
    candidates = (package / "csrc", package.parent / "csrc")
    for candidate in candidates:
        if any((candidate / marker).is_file() for marker in _MARKERS):
            return candidate
    raise RuntimeError(
        f"cake_ops: CUDA sources not found in {' or '.join(map(str, candidates))} (no "
        f"{' or '.join(_MARKERS)}); reinstall cake-ops (the wheel ships them as package data)"
    )


def _relative(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def hashed_files(root: Path) -> list[Path]:
    """Every file under ``root`` that the build reads (sources and headers, all folders),
    sorted by relative path."""
    files = (p for p in root.rglob("*") if p.is_file() and p.suffix in _HASHED_SUFFIXES)
    return sorted(files, key=lambda p: _relative(root, p))


def compiled_files(root: Path) -> list[Path]:
    """The translation units: every ``.cu`` and ``.cpp`` under ``root`` (kernel files and
    each family's ``binding.cpp``), sorted by relative path."""
    files = (p for p in root.rglob("*") if p.is_file() and p.suffix in _COMPILED_SUFFIXES)
    return sorted(files, key=lambda p: _relative(root, p))


def include_paths(root: Path) -> list[Path]:
    """The ``-I`` paths of the build: the csrc root (``INCLUDE_DIRS``)."""
    return [(root / d).resolve() for d in INCLUDE_DIRS]


def unit_name(relative: str) -> str:
    """The generated unit's file name for a source: ``gdn/binding.cpp`` -> ``gdn__binding.cpp``."""
    return relative.replace("/", "__")


def object_name(unit: str) -> str:
    """The object file cpp_extension makes of a unit (its ``object_file_path``: the base
    name's stem, ``.cuda.o`` for CUDA files, ``.o`` for the rest)."""
    stem, suffix = os.path.splitext(os.path.basename(unit))
    return f"{stem}.cuda.o" if suffix == ".cu" else f"{stem}.o"


def units(root: Path) -> dict[str, str]:
    """Relative source path -> generated unit name, for every translation unit of ``root``.

    Raises RuntimeError when two sources would still share an object file (say
    ``a__b.cu`` beside ``a/b.cu``): ninja would build one and link it twice.
    """
    names = {_relative(root, p): unit_name(_relative(root, p)) for p in compiled_files(root)}
    by_object: dict[str, list[str]] = {}
    for relative, unit in names.items():
        by_object.setdefault(object_name(unit), []).append(relative)
    clashes = {obj: rels for obj, rels in by_object.items() if len(rels) > 1}
    if clashes:
        raise RuntimeError(
            "cake_ops: sources that would share an object file in the build directory: "
            + "; ".join(f"{' and '.join(rels)} -> {obj}" for obj, rels in sorted(clashes.items()))
        )
    return names


def write_units(root: Path, directory: Path) -> list[Path]:
    """Write one unit per translation unit of ``root`` into ``directory`` and return them
    in source order. Each holds ``#include "<absolute path of the source>"``: absolute,
    because a quoted name is looked up beside the unit first, where a top-level
    ``binding.cpp`` would find the unit itself. A unit whose text is already right is
    not rewritten (its mtime then keeps ninja from recompiling it); stale units are
    removed."""
    directory.mkdir(parents=True, exist_ok=True)
    wanted = units(root)
    paths = []
    for relative, unit in wanted.items():
        path = directory / unit
        source = (root / relative).resolve().as_posix()
        if '"' in source or "\n" in source:
            # A header name has no escapes: it cannot hold a quote or a newline.
            raise RuntimeError(f"cake_ops: cannot #include {source!r} (a quote or newline in the path)")
        text = (
            f"// Generated by cake_ops.build: compiles csrc/{relative} under a name of its own\n"
            f"// (cpp_extension names objects by base name). Edit csrc/{relative}, not this.\n"
            f'#include "{source}"\n'
        )
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        paths.append(path)
    for stale in directory.iterdir():
        if stale.suffix in _COMPILED_SUFFIXES and stale.name not in wanted.values():
            stale.unlink()
    return paths


def nvcc() -> str | None:
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
        "include_dirs": list(INCLUDE_DIRS),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvcc": _nvcc_version(nvcc()),
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
    if nvcc() is None:
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
        root = csrc_dir()
        cpp_extension.load(
            # The key in the name keeps two builds' libraries apart.
            name=f"cake_cuda_{key}",
            sources=[str(p) for p in write_units(root, build_directory / UNITS)],
            extra_cflags=list(CFLAGS),
            extra_cuda_cflags=list(CUDA_CFLAGS),
            extra_ldflags=list(LDFLAGS),
            extra_include_paths=[str(p) for p in include_paths(root)],
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
        help="print the cache key, the files it hashes and the units compiled, without building",
    )
    args = parser.parse_args(argv)
    key = build_key()
    if args.print_key:
        root = csrc_dir()
        print(f"key {key}")
        print(f"build_directory {cache_dir() / key}")
        for path in include_paths(root):
            print(f"include {path}")
        for path in hashed_files(root):
            print(f"source {path}")
        for relative, unit in units(root).items():
            print(f"unit {relative} {UNITS}/{unit} {object_name(unit)}")
        return
    start = time.perf_counter()
    try:
        load()
    except RuntimeError as error:
        raise SystemExit(f"cake_ops.build: {error}") from error
    print(f"built {cache_dir() / key} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()

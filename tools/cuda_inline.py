"""Builds a tool's inline CUDA source against csrc/ for the H200 (sm_90a), the one way the
GPU probes and checks in tools/ compile (torch.utils.cpp_extension.load_inline)."""

from __future__ import annotations

import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(name: str, cpp_sources: str, cuda_sources: str, functions=("run",), ptxas_verbose: bool = False):
    """The extension module `name` built from the sources in a fresh temporary directory;
    ptxas_verbose prints each kernel's registers and spills while it builds."""
    from torch.utils.cpp_extension import load_inline

    flags = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"]
    if ptxas_verbose:
        flags += ["-Xptxas", "-v"]
    return load_inline(
        name,
        cpp_sources=cpp_sources,
        cuda_sources=cuda_sources,
        functions=list(functions),
        extra_include_paths=[str(ROOT / "csrc")],
        extra_cuda_cflags=flags,
        build_directory=tempfile.mkdtemp(prefix=f"{name}_"),
        verbose=False,
    )

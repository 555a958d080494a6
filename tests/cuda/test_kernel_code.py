"""Static checks of the CUDA kernel files, on the CPU: each .cu of the csrc tree (every
folder: csrc/gdn/fwd_walk.cu, csrc/short_conv/fwd.cu, ...) is compiled for sm_90a with the
build's flags and include root (-I csrc) by the nvcc the build would use (skipped where
there is none), and

- ptxas reports no register spills and no warnings (a wgmma serialised for want of
  registers, C7512/C7515, shows up as one);
- no 16-byte store left as four 4-byte stores in the PTX: NVVM did that twice to a uint4
  assembled in registers (the prep's normalised rows, a reordered walk epilogue), for 4x
  the L2 sectors of the store; the walk ran 60 % slower. ``mma::st_global_16`` forces the
  vector store.

The device-side probes of tools/ whose kernels include no torch header
(tools/gdn_bwd_chain_probe.py, tools/gdn_bwd_cluster_probe.py, tools/gdn_bwd_fused_probe.py) are compiled the same way, so that a tool the next GPU
session will run still builds and does not spill.
"""

import re
import subprocess
from pathlib import Path

import pytest

from cake_ops import build

from conftest import load_tool

CSRC = Path(build.__file__).resolve().parents[1] / "csrc"
KERNEL_FILES = sorted(p.relative_to(CSRC).as_posix() for p in CSRC.rglob("*.cu"))

_STORE_32 = re.compile(r"^\s*st\.global\.[busf]32\s+\[(%rd\d+)(?:\+(\d+))?\]")


@pytest.fixture(scope="module")
def nvcc():
    path = build.nvcc()
    if path is None:
        pytest.skip("no nvcc")
    return path


def split_vector_stores(ptx: str) -> list[str]:
    """Runs of four 32-bit global stores to base+o, +4, +8, +12 (o a multiple of 16) on
    consecutive store lines: a 16-byte vector stored piecewise."""
    found, run = [], []
    for line in ptx.splitlines():
        m = _STORE_32.match(line)
        if not m:
            if line.strip().startswith("st."):
                run = []
            continue
        base, off = m.group(1), int(m.group(2) or 0)
        if run and run[-1][0] == base and run[-1][1] + 4 == off:
            run.append((base, off))
        else:
            run = [(base, off)]
        if len(run) == 4 and run[0][1] % 16 == 0:
            found.append(f"{base}+{run[0][1]}")
            run = []
    return found


def test_split_store_detector():
    four = "\n".join(f"\tst.global.u32 \t[%rd7+{o}], %r{o};" for o in (16, 20, 24, 28))
    assert split_vector_stores(four) == ["%rd7+16"]
    strided = "\n".join(f"\tst.global.f32 \t[%rd7+{o}], %f1;" for o in (0, 512, 1024, 1536))
    assert split_vector_stores(strided) == []
    assert split_vector_stores("\tst.global.v4.u32 \t[%rd7], {%r1, %r2, %r3, %r4};") == []


def _compile_clean(nvcc, source: Path, tmp_path: Path) -> str:
    """Compiles one kernel file with the build's flags; fails on errors, spills and
    ptxas warnings. Returns the PTX."""
    flags = [f for f in build.CUDA_CFLAGS if f != "-lineinfo"]
    includes = [f"-I{p}" for p in build.include_paths(CSRC)]
    cmd = [nvcc, *flags, *includes, "-Xptxas", "-v", "--keep", "--keep-dir", str(tmp_path), "-cubin",
           "-o", str(tmp_path / "k.cubin"), str(source)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert all(s == "0" and l == "0" for s, l in spills), f"{source.name} spills registers:\n{log}"
    warnings = [line for line in log.splitlines() if re.search(r"warning|C75\d\d", line, re.IGNORECASE)]
    assert not warnings, f"{source.name}:\n" + "\n".join(warnings)
    return "\n".join(p.read_text() for p in tmp_path.glob("*.ptx"))


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_kernel_file_compiles_clean(nvcc, name, tmp_path):
    ptx = _compile_clean(nvcc, CSRC / name, tmp_path)
    assert ptx, "nvcc --keep left no PTX"
    split = split_vector_stores(ptx)
    assert not split, f"{name}: 16-byte stores split into 4-byte stores at {split}"


PROBE_TOOLS = ("gdn_bwd_chain_probe", "gdn_bwd_cluster_probe", "gdn_bwd_fused_probe")


@pytest.mark.parametrize("tool", PROBE_TOOLS)
def test_probe_tool_compiles_clean(nvcc, tool, tmp_path):
    module = load_tool(tool)
    source = tmp_path / f"{tool}.cu"
    source.write_text(module.KERNEL_SRC)
    assert _compile_clean(nvcc, source, tmp_path)

"""The constants that the PyTorch implementation and the CUDA kernels both define (one
definition per language) hold the same values: read from csrc/gdn/gdn.h and plan.h on
the CPU."""

import re
import subprocess
from pathlib import Path

import pytest

from cake_ops import dispatch
from cake_ops.kcp import context as kcp_context
from cake_ops.pytorch import gdn as pytorch_gdn

HEADERS = [Path(__file__).resolve().parents[2] / "csrc" / "gdn" / h for h in ("gdn.h", "plan.h")]


def cpp_constant(name: str) -> float:
    """The value of ``name`` in a ``constexpr`` declaration (one name or several, comma
    separated) of the headers."""
    for header in HEADERS:
        m = re.search(rf"^constexpr\s+\w+\s+[^;]*\b{name}\s*=\s*([-+0-9.eE]+)f?\s*[,;]", header.read_text(), re.M)
        if m:
            return float(m.group(1))
    raise AssertionError(f"{name} not found in {[str(h) for h in HEADERS]}")


@pytest.mark.parametrize(
    "cpp,python",
    [
        ("kGdnChunk", pytorch_gdn.CHUNK),
        ("kL2NormEps", pytorch_gdn.L2NORM_EPS),
        ("kGdnGateFloor", pytorch_gdn.GATE_FLOOR),
        ("kGdnHeadDim", dispatch.GDN_CUDA_HEAD_DIM),
        ("kGdnDetSegChunks", kcp_context._DET_SEG_CHUNKS),
        ("kGdnDetFillWalks", kcp_context._DET_FILL_WALKS),
        ("kGdnOpensInside", kcp_context.OPENS_INSIDE),
        ("kGdnClosesInside", kcp_context.CLOSES_INSIDE),
        ("kGdnHalfGrid", kcp_context.HALF_GRID),
        ("kGdnFullGrid", kcp_context.FULL_GRID),
    ],
)
def test_python_and_cuda_constants_agree(cpp, python):
    assert cpp_constant(cpp) == pytest.approx(python, rel=0, abs=0)


def test_python_half_grid_is_the_plans(tmp_path):
    """KCP's mirror of the deterministic plan's grid class (``kcp.context.half_grid``) gives,
    for every HV 1 .. 64 and document of 1 .. 4200 chunks, the grid that the plan's own host
    code gives (csrc/gdn/chunks.cuh ``doc_cut_chunks`` at plan.cu's
    ``gdn_fwd_choose_segment_long_max``), compiled by nvcc into a host program run on the CPU
    (a fragment cut at the other class would break deterministic KCP's bits)."""
    from cake_ops import build

    nvcc = build.nvcc()
    if nvcc is None:
        pytest.skip("no nvcc")
    (tmp_path / "main.cu").write_text(
        '#include <cstdio>\n#include "gdn/plan.cu"\nint main() {\n'
        "  for (int hv = 1; hv <= 64; ++hv) {\n"
        "    const int long_max = cake::gdn_fwd_choose_segment_long_max(hv, true);\n"
        "    for (int c = 1; c <= 4200; ++c)\n"
        "      std::putchar(cake::doc_cut_chunks(c, cake::kGdnDetSegChunks, long_max) == cake::kGdnDetSegChunks / 2\n"
        "                   ? '1' : '0');\n"
        "    std::putchar('\\n');\n  }\n}\n")
    csrc = HEADERS[0].parents[1]
    subprocess.run([nvcc, "-std=c++17", f"-I{csrc}", "-o", str(tmp_path / "main"), str(tmp_path / "main.cu")],
                   check=True, capture_output=True, timeout=300)
    rows = subprocess.run([str(tmp_path / "main")], check=True, capture_output=True, text=True).stdout.split()
    assert len(rows) == 64
    for hv, row in enumerate(rows, start=1):
        want = "".join("1" if kcp_context.half_grid(c, hv) else "0" for c in range(1, 4201))
        assert row == want, f"HV = {hv}: the plan halves chunks {[c for c in range(1, 4201) if row[c - 1] == '1'][:3]}..."

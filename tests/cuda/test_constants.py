"""The constants that the PyTorch implementation and the CUDA kernels both define (one
definition per language) hold the same values: read from csrc/gdn/gdn.h and plan.h on
the CPU."""

import re
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

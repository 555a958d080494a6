"""The constants that the PyTorch implementation and the CUDA kernels both define (one
definition per language) hold the same values: read from csrc/gdn/gdn.h on the CPU."""

import re
from pathlib import Path

import pytest

from cake_ops import dispatch
from cake_ops.pytorch import gdn as pytorch_gdn

GDN_H = Path(__file__).resolve().parents[2] / "csrc" / "gdn" / "gdn.h"


def cpp_constant(name: str) -> float:
    m = re.search(rf"constexpr\s+\w+\s+{name}\s*=\s*([-+0-9.eE]+)f?\s*;", GDN_H.read_text())
    assert m, f"{name} not found in {GDN_H}"
    return float(m.group(1))


@pytest.mark.parametrize(
    "cpp,python",
    [
        ("kGdnChunk", pytorch_gdn.CHUNK),
        ("kL2NormEps", pytorch_gdn.L2NORM_EPS),
        ("kGdnGateFloor", pytorch_gdn.GATE_FLOOR),
        ("kGdnHeadDim", dispatch.GDN_CUDA_HEAD_DIM),
    ],
)
def test_python_and_cuda_constants_agree(cpp, python):
    assert cpp_constant(cpp) == pytest.approx(python, rel=0, abs=0)

"""Every python code block of README.md runs as printed (on a CPU here; the blocks pick
the GPU when there is one). A block with the line `# requires: cuda` runs only on a GPU."""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(block):
    if "# requires: cuda" in block and not torch.cuda.is_available():
        pytest.skip("the block needs a CUDA GPU")
    exec(compile(block, str(README), "exec"), {"__name__": "readme"})

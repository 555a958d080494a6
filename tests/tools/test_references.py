"""Every repository path that the code, the tests, the README and docs/ cite exists (the
docs are the repository's own: nothing may cite a file outside it)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    + [p for d in ("cake_ops", "csrc", "meta", "tests", "tools", "examples") for p in (ROOT / d).rglob("*")
       if p.suffix in (".py", ".cu", ".cuh", ".h", ".cpp", ".md") and "__pycache__" not in p.parts]
)
# A path into one of the repository's folders, ending in a file name with a known suffix.
PATH = re.compile(r"(?<![\w./-])((?:docs|csrc|cake_ops|meta|tests|tools|examples)/[\w./-]*\.(?:cuh|cpp|cu|md|py|h|txt))(?![\w])")
# These build fake csrc trees or name the files of older trees on purpose (the build's and
# the A/B tool's tests; the A/B tool and its timer read old revisions' layouts too).
SYNTHETIC = {"tests/cuda/test_build.py", "tests/tools/test_ab_csrc.py", "tools/ab_csrc.py", "tools/gdn_fwd_gpu_check.py"}
OUTSIDE = re.compile(r"\b(DESIGN\.md|KERNELS\.md|BENCH\.md|STYLE\.md)\b")


def cited(path: Path) -> list[str]:
    return sorted(set(PATH.findall(path.read_text(errors="replace"))))


@pytest.mark.parametrize("source", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_cited_paths_exist(source):
    text = source.read_text(errors="replace")
    missing = [p for p in cited(source) if not (ROOT / p).exists() and not (ROOT / "csrc" / p).exists()]
    if str(source.relative_to(ROOT)) in SYNTHETIC:
        missing = []
    assert not missing, f"{source.relative_to(ROOT)} cites {missing}"
    if source.name != "test_references.py":
        assert not OUTSIDE.findall(text), f"{source.relative_to(ROOT)} cites a document outside the repository"

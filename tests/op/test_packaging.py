"""The installed package holds every module of the source tree: pyproject.toml lists its
packages by hand (meta/ and csrc/ sit beside cake_ops and are mapped into it), so a new
subpackage missing from the list would be left out of a wheel while every test run from
the tree still passes."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_subpackage_is_packaged():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    dirs = config["package-dir"]
    tree = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "cake_ops").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert tree, "no package found under cake_ops/"
    missing = sorted(tree - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages leaves out {missing}"
    for name in listed:
        # Each listed package is a folder of the tree, directly or through package-dir.
        folder = dirs.get(name, name.replace(".", "/"))
        assert (ROOT / folder).is_dir(), f"packages lists {name}, but {folder}/ does not exist"

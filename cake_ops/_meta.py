"""Finds the fake kernels of ``meta/``: inside the package once installed, beside it in a
source checkout (where ``meta/`` is a top-level folder, see pyproject's package-dir)."""

import importlib
import importlib.util
import sys
from pathlib import Path


def load_fake_kernels() -> None:
    try:
        importlib.import_module("cake_ops.meta")
        return
    except ModuleNotFoundError as e:
        if e.name != "cake_ops.meta":
            raise
    folder = Path(__file__).resolve().parent.parent / "meta"
    spec = importlib.util.spec_from_file_location(
        "cake_ops.meta", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or not (folder / "__init__.py").exists():
        raise ImportError(f"cake_ops: fake kernels not found (looked for cake_ops.meta and {folder})")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cake_ops.meta"] = module
    spec.loader.exec_module(module)

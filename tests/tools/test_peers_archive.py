"""tools/peers_archive.py: one wheel per project, pip's arguments for the GPU machine's
Python, and the archive's layout (no download here)."""

import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import peers_archive as tool  # noqa: E402


def test_one_wheel_per_project_keeps_the_newest_manylinux():
    names = ["apache_tvm_ffi-0.1.12-cp312-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
             "apache_tvm_ffi-0.1.12-cp312-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
             "fla_core-0.6.0-py3-none-any.whl"]
    assert tool.one_wheel_per_project(names) == names[1:]


def test_pip_installs_for_the_gpu_machines_python(tmp_path):
    (tmp_path / "a-1-py3-none-any.whl").write_bytes(b"")
    args = tool.pip_target_args(tmp_path, tmp_path / "peers")
    assert args[:2] == ["install", "--quiet"] and "--no-deps" in args and "--no-index" in args
    assert args[args.index("--python-version") + 1] == "3.12" and args[args.index("--target") + 1].endswith("peers")
    assert args[-1].endswith("a-1-py3-none-any.whl")


def test_pack_keeps_the_top_folder_and_drops_bytecode(tmp_path):
    peers = tmp_path / "peers"
    (peers / "fla" / "__pycache__").mkdir(parents=True)
    (peers / "fla" / "__init__.py").write_text("x = 1\n")
    (peers / "fla" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"\0")
    tool.pack(peers, tmp_path / "p.tar.xz")
    with tarfile.open(tmp_path / "p.tar.xz") as tar:
        assert sorted(tar.getnames()) == ["peers", "peers/fla", "peers/fla/__init__.py"]


def test_out_must_be_a_tar_xz():
    with pytest.raises(SystemExit):
        tool.main(["peers.zip"])

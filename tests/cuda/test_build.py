"""The JIT build (cake_ops.build), on the CPU, and the bindings it builds, on the GPU.

CPU: which files of the csrc tree are compiled and hashed (every folder), the cache
key (sources, headers, flags, include paths; not the location), the generated units
that give same-named sources in two folders their own object files (checked against
the ninja file torch writes, and compiled with nvcc where there is one), what
cpp_extension.load is handed, where the sources are found, and the errors without a
GPU. GPU (Hopper): the bindings of both kernel families reject bad arguments with a
RuntimeError. The kernels themselves are tested in test_short_conv_fwd_cuda.py and
test_gdn_fwd_cuda.py.
"""

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from cake_ops import build

from conftest import HAS_CUDA

REPO = Path(__file__).resolve().parents[2]

# A small csrc tree of the family layout: a shared header, two families whose sources
# share base names (binding.cpp, fwd.cu), a header of a family, and a file the build
# neither compiles nor hashes.
TREE = {
    "common/dtype.h": "#pragma once\nusing half_t = unsigned short;\n",
    "common/scan.cuh": "#pragma once\n__device__ inline int twice(int x) { return 2 * x; }\n",
    "gdn/gdn.h": '#pragma once\n#include "common/dtype.h"\n',
    "gdn/plan.cu": '#include "gdn/gdn.h"\nint gdn_plan() { return 1; }\n',
    "gdn/fwd.cu": (
        '#include "gdn/gdn.h"\n#include "common/scan.cuh"\n'
        "__global__ void gdn_fwd_kernel(int* y) { y[0] = twice(y[0]); }\n"
    ),
    "gdn/binding.cpp": '#include "gdn/gdn.h"\nint gdn_binding() { return 2; }\n',
    "short_conv/short_conv.h": '#pragma once\n#include "common/dtype.h"\n',
    "short_conv/fwd.cu": (
        '#include "short_conv/short_conv.h"\n#include "common/scan.cuh"\n'
        "__global__ void short_conv_fwd_kernel(int* y) { y[0] = twice(y[1]); }\n"
    ),
    "short_conv/binding.cpp": '#include "short_conv/short_conv.h"\nint short_conv_binding() { return 3; }\n',
    "gdn/layout.txt": "not a source\n",
}


def _tree(root: Path, files: dict[str, str] = TREE) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture()
def tree(tmp_path):
    return _tree(tmp_path / "csrc")


def _relative(root, paths):
    return [p.relative_to(root).as_posix() for p in paths]


# ---------------------------------------------------------------- build (CPU)


def _print_key() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cake_ops.build", "--print-key"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_print_key_is_stable_and_lists_sources_and_units():
    """Of the checkout's csrc, whichever layout it has."""
    first, second = _print_key(), _print_key()
    assert first == second
    lines = first.splitlines()
    root = build.csrc_dir()
    assert lines[0] == f"key {build.build_key()}"
    assert [line.split(" ", 1)[1] for line in lines if line.startswith("include ")] == [str(root.resolve())]
    sources = [Path(line.split(" ", 1)[1]) for line in lines if line.startswith("source ")]
    assert sources == build.hashed_files(root)
    assert any(p.name == "binding.cpp" for p in sources) and any(p.suffix == ".cu" for p in sources)
    units = [line.split()[1:] for line in lines if line.startswith("unit ")]
    assert [u[0] for u in units] == _relative(root, build.compiled_files(root))
    assert len({u[2] for u in units}) == len(units)  # one object file each


def test_compiled_and_hashed_files_are_the_whole_tree_by_relative_path(tree):
    assert _relative(tree, build.compiled_files(tree)) == [
        "gdn/binding.cpp", "gdn/fwd.cu", "gdn/plan.cu", "short_conv/binding.cpp", "short_conv/fwd.cu",
    ]
    assert _relative(tree, build.hashed_files(tree)) == [
        "common/dtype.h", "common/scan.cuh", "gdn/binding.cpp", "gdn/fwd.cu", "gdn/gdn.h", "gdn/plan.cu",
        "short_conv/binding.cpp", "short_conv/fwd.cu", "short_conv/short_conv.h",
    ]


def test_key_changes_with_flags():
    key = build.build_key()
    assert len(key) == 16 and int(key, 16) >= 0
    assert build.build_key(cuda_cflags=build.CUDA_CFLAGS + ("-DCAKE_X",)) != key
    assert build.build_key(cflags=build.CFLAGS[:-1]) != key


def test_key_changes_with_the_include_dirs(tree, monkeypatch):
    key = build.build_key(tree)
    monkeypatch.setattr(build, "INCLUDE_DIRS", build.INCLUDE_DIRS + ("common",))
    assert build.build_key(tree) != key


def test_key_of_the_checkout_does_not_depend_on_its_location(tmp_path):
    copy = tmp_path / "csrc"
    shutil.copytree(build.csrc_dir(), copy)
    assert build.build_key(copy) == build.build_key()


@dataclass(frozen=True)
class Edit:
    id: str
    write: dict[str, str]  # relative path -> new text ("" removes the file)
    changes_key: bool = True


def _edit(root: Path, write: dict[str, str]) -> None:
    for relative, text in write.items():
        path = root / relative
        if text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        else:
            path.unlink()


EDITS = [
    Edit("header_in_common", {"common/dtype.h": TREE["common/dtype.h"] + "// edited\n"}),
    Edit("header_in_a_family", {"short_conv/short_conv.h": TREE["short_conv/short_conv.h"] + "// edited\n"}),
    Edit("kernel_in_a_family", {"gdn/fwd.cu": TREE["gdn/fwd.cu"] + "// edited\n"}),
    Edit("new_header_in_a_new_folder", {"gdn/walk/tile.cuh": "#pragma once\n"}),
    Edit("file_moved_to_another_folder", {"common/gdn.h": TREE["gdn/gdn.h"], "gdn/gdn.h": ""}),
    Edit("removed_source", {"gdn/plan.cu": ""}),
    Edit("notes_not_hashed", {"gdn/layout.txt": "edited\n", "common/README": "new\n"}, changes_key=False),
]


@pytest.mark.parametrize("edit", EDITS, ids=lambda e: e.id)
def test_key_follows_the_sources_in_every_folder(tree, tmp_path, edit):
    key = build.build_key(tree)
    assert build.build_key(_tree(tmp_path / "elsewhere" / "csrc")) == key  # not the location
    _edit(tree, edit.write)
    assert (build.build_key(tree) != key) == edit.changes_key


def test_same_named_sources_in_two_folders_get_distinct_units_and_objects(tree):
    units = build.units(tree)
    assert units == {
        "gdn/binding.cpp": "gdn__binding.cpp",
        "gdn/fwd.cu": "gdn__fwd.cu",
        "gdn/plan.cu": "gdn__plan.cu",
        "short_conv/binding.cpp": "short_conv__binding.cpp",
        "short_conv/fwd.cu": "short_conv__fwd.cu",
    }
    assert [build.object_name(u) for u in units.values()] == [
        "gdn__binding.o", "gdn__fwd.cuda.o", "gdn__plan.cuda.o", "short_conv__binding.o", "short_conv__fwd.cuda.o",
    ]


@dataclass(frozen=True)
class Clash:
    id: str
    files: tuple[str, ...]
    message: str


CLASHES = [
    Clash("flattened_name_taken", ("a/b.cu", "a__b.cu"), r"a/b.cu and a__b.cu -> a__b.cuda.o"),
    Clash("two_levels_deep", ("x/y/z.cpp", "x__y/z.cpp"), r"x/y/z.cpp and x__y/z.cpp -> x__y__z.o"),
]


@pytest.mark.parametrize("clash", CLASHES, ids=lambda c: c.id)
def test_sources_that_would_still_share_an_object_are_refused(tmp_path, clash):
    root = _tree(tmp_path / "csrc", {f: "int x;\n" for f in clash.files})
    with pytest.raises(RuntimeError, match="share an object file") as error:
        build.units(root)
    assert clash.message in str(error.value)


def test_a_cu_and_a_cpp_of_one_name_keep_their_objects_apart(tmp_path):
    root = _tree(tmp_path / "csrc", {"gdn/plan.cu": "", "gdn/plan.cpp": ""})
    assert sorted(build.object_name(u) for u in build.units(root).values()) == ["gdn__plan.cuda.o", "gdn__plan.o"]


def test_units_include_the_real_files_and_are_rewritten_only_when_stale(tree, tmp_path):
    directory = tmp_path / "build" / build.UNITS
    units = build.write_units(tree, directory)
    assert [u.name for u in units] == list(build.units(tree).values())
    for relative, unit in zip(build.units(tree), units):
        # By absolute path: a quoted relative name is looked up beside the unit first.
        assert f'#include "{(tree / relative).resolve().as_posix()}"' in unit.read_text().splitlines()
    before = {u: u.stat().st_mtime_ns for u in units}
    (directory / "old__gone.cu").write_text("stale")
    os.utime(units[0], ns=(1, 1))
    assert build.write_units(tree, directory) == units
    assert units[0].stat().st_mtime_ns == 1  # right text: not rewritten, so ninja keeps the object
    assert all(u.stat().st_mtime_ns == before[u] for u in units[1:])
    assert not (directory / "old__gone.cu").exists()
    (tree / "gdn" / "plan.cu").unlink()
    assert [u.name for u in build.write_units(tree, directory)] == [
        "gdn__binding.cpp", "gdn__fwd.cu", "short_conv__binding.cpp", "short_conv__fwd.cu",
    ]
    assert not (directory / "gdn__plan.cu").exists()


def test_a_top_level_source_is_not_included_by_its_own_unit(tmp_path):
    """units/binding.cpp holding #include "binding.cpp" would include itself."""
    root = _tree(tmp_path / "csrc", {"binding.cpp": "int binding();\n"})
    (unit,) = build.write_units(root, tmp_path / "units")
    assert unit.name == "binding.cpp" and f'#include "{(root / "binding.cpp").resolve()}"' in unit.read_text()


def _ninja_builds(tree, tmp_path, monkeypatch):
    """(object, rule, source) of each compile step of the ninja file that torch writes for
    the units, and the file's text."""
    writer = getattr(cpp_extension, "_write_ninja_file_to_build_library", None)
    if writer is None:
        pytest.skip("torch.utils.cpp_extension has no _write_ninja_file_to_build_library")
    if cpp_extension.CUDA_HOME is None:  # a CPU torch: only the include path is taken from it
        monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "cuda"))
    units = build.write_units(tree, tmp_path / "build" / build.UNITS)
    ninja = tmp_path / "build" / "build.ninja"
    writer(
        path=str(ninja), name="cake_cuda_test", sources=[str(u) for u in units],
        extra_cflags=list(build.CFLAGS), extra_cuda_cflags=list(build.CUDA_CFLAGS), extra_sycl_cflags=[],
        extra_ldflags=list(build.LDFLAGS), extra_include_paths=[str(p) for p in build.include_paths(tree)],
        with_cuda=True, with_sycl=False, is_standalone=False,
    )
    text = ninja.read_text()
    steps = []
    for line in text.splitlines():
        if line.startswith("build ") and "compile " in line:
            target, rule_and_source = line.removeprefix("build ").split(": ", 1)
            rule, source = rule_and_source.split(" ", 1)
            steps.append((target, rule, source))
    return steps, text


def test_torch_builds_each_unit_into_its_own_object(tree, tmp_path, monkeypatch):
    steps, text = _ninja_builds(tree, tmp_path, monkeypatch)
    units = build.units(tree)
    assert [(o, s) for o, _, s in steps] == [
        (build.object_name(u), str(tmp_path / "build" / build.UNITS / u)) for u in units.values()
    ]
    assert len({o for o, _, _ in steps}) == len(units) == 5
    assert {o: r for o, r, _ in steps}["short_conv__fwd.cuda.o"] == "cuda_compile"
    assert {o: r for o, r, _ in steps}["short_conv__binding.o"] == "compile"
    # The csrc root is an include path of both compilers.
    for flags in ("cflags = ", "cuda_cflags = "):
        (line,) = [line for line in text.splitlines() if line.startswith(flags)]
        assert f"-I{tree.resolve()}" in line.split()


def test_units_compile_with_nvcc(tree, tmp_path):
    """Each .cu unit compiles from the build directory, its includes found from the
    csrc root; the two fwd.cu give two objects with their own kernels."""
    nvcc = build.nvcc()
    if nvcc is None:
        pytest.skip("no nvcc")
    units = [u for u in build.write_units(tree, tmp_path / build.UNITS) if u.suffix == ".cu"]
    includes = [f"-I{p}" for p in build.include_paths(tree)]
    for unit in units:
        obj = tmp_path / build.object_name(unit.name)
        done = subprocess.run([nvcc, *build.CUDA_CFLAGS, *includes, "-c", str(unit), "-o", str(obj)],
                              capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.glob("*.o")) == ["gdn__fwd.cuda.o", "gdn__plan.cuda.o", "short_conv__fwd.cuda.o"]
    assert b"short_conv_fwd_kernel" in (tmp_path / "short_conv__fwd.cuda.o").read_bytes()
    assert b"gdn_fwd_kernel" in (tmp_path / "gdn__fwd.cuda.o").read_bytes()


def test_load_hands_cpp_extension_the_units_and_the_include_root(tree, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(build, "csrc_dir", lambda: tree)
    monkeypatch.setattr(build, "unavailable_reason", lambda: None)
    monkeypatch.setattr(build, "_ops", None)
    monkeypatch.setenv("CAKE_OPS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build.cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    build.load()
    key = build.build_key(tree)
    (call,) = calls
    assert call["name"] == f"cake_cuda_{key}"
    assert call["build_directory"] == str(tmp_path / "cache" / key)
    assert call["sources"] == [str(tmp_path / "cache" / key / build.UNITS / u) for u in build.units(tree).values()]
    assert call["extra_include_paths"] == [str(tree.resolve())]
    assert call["extra_cflags"] == list(build.CFLAGS) and call["extra_cuda_cflags"] == list(build.CUDA_CFLAGS)


@dataclass(frozen=True)
class Layout:
    id: str
    files: tuple[str, ...]  # relative to a scratch folder holding cake_ops/build.py
    found: str | None  # the folder csrc_dir() returns, None: RuntimeError


LAYOUTS = [
    Layout("installed", ("cake_ops/csrc/gdn/binding.cpp",), "cake_ops/csrc"),
    Layout("checkout", ("csrc/gdn/binding.cpp", "csrc/common/dtype.h"), "csrc"),
    Layout("installed_before_checkout", ("cake_ops/csrc/gdn/binding.cpp", "csrc/gdn/binding.cpp"), "cake_ops/csrc"),
    Layout("flat_layout_before_the_folders", ("csrc/binding.cpp",), "csrc"),
    Layout("some_other_projects_csrc", ("csrc/kernel.cu", "csrc/ops/binding.cpp"), None),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.id)
def test_csrc_dir_finds_our_sources(tmp_path, monkeypatch, layout):
    _tree(tmp_path, {f: "" for f in layout.files})
    (tmp_path / "cake_ops").mkdir(exist_ok=True)
    monkeypatch.setattr(build, "__file__", str(tmp_path / "cake_ops" / "build.py"))
    if layout.found is None:
        with pytest.raises(RuntimeError, match="CUDA sources not found"):
            build.csrc_dir()
    else:
        assert build.csrc_dir() == tmp_path / layout.found


@pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour without a GPU")
def test_available_is_false_without_gpu():
    assert build.available() is False


@pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour without a GPU")
def test_load_without_gpu_says_why():
    with pytest.raises(RuntimeError, match=r"unavailable: .*(without CUDA|no CUDA device)"):
        build.load()


@pytest.mark.parametrize("capability,outcome", [((9, 0), "fail"), ((8, 0), "skip")], ids=["hopper", "ampere"])
def test_kernel_suites_fail_on_hopper_when_the_kernels_cannot_be_built(monkeypatch, capability, outcome):
    """conftest.kernel_ops: a Hopper GPU without nvcc or ninja fails the kernel suites
    instead of reporting them skipped; another GPU skips them."""
    import conftest
    import torch

    monkeypatch.setattr(build, "unavailable_reason", lambda: "nvcc was not found")
    monkeypatch.setattr(conftest, "HAS_CUDA", True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    # Both outcomes caught, then told apart: an uncaught skip would report this test skipped.
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception), match="nvcc was not found") as raised:
        conftest.kernel_ops()
    assert raised.type is (pytest.fail.Exception if outcome == "fail" else pytest.skip.Exception)


# ---------------------------------------------------------------- bindings (GPU)


# Bad arguments that reach the binding must raise RuntimeError. Each call runs in a child
# process: on the H200 (torch 2.11, g++ 13) a TORCH_CHECK message that formatted an
# integer once killed the process with a segfault (a static libstdc++ copy in the
# extension; build.LDFLAGS fixes it), and a crash must fail one case, not the session.
# The public cake:: ops validate in Python first and never reach these checks with bad input.
_GDN_ARGS = (
    "q = torch.randn(10, 1, 128, device='cuda', dtype=torch.bfloat16)\n"
    "g = -torch.rand(10, 1, device='cuda')\n"
    "cu = torch.tensor([0, 10], device='cuda', dtype=torch.int32)\n"
)
_BAD_CALLS = {
    "short_conv_fwd width 5": (
        "x = torch.randn(7, 16, device='cuda', dtype=torch.bfloat16)\n"
        "w = torch.randn(16, 5, device='cuda', dtype=torch.bfloat16)\n"
        "cu = torch.tensor([0, 7], device='cuda', dtype=torch.int32)\n"
        "ops.short_conv_fwd(x, w, None, cu, None, False)",
        "1 <= W <= 4",
    ),
    "gdn_fwd head dim 64": (
        "q = torch.randn(10, 1, 64, device='cuda', dtype=torch.bfloat16)\n"
        "g = -torch.rand(10, 1, device='cuda')\n"
        "cu = torch.tensor([0, 10], device='cuda', dtype=torch.int32)\n"
        "ops.gdn_fwd(q, q, q, g, torch.rand_like(g), cu, None, 0.125, True, True)",
        "K = 128",
    ),
    # Messages that format integers and sizes: with a static libstdc++ in the extension
    # they crashed the process (build.LDFLAGS).
    "gdn_fwd value_splits 3": (
        _GDN_ARGS + "ops.gdn_fwd(q, q, q, g, torch.rand_like(g), cu, None, 0.125, True, True, -1, 3)",
        "value_splits must be -1 (the plan's choice), 1 or 2, got 3",
    ),
    "gdn_fwd segment_chunks -5": (
        _GDN_ARGS + "ops.gdn_fwd(q, q, q, g, torch.rand_like(g), cu, None, 0.125, True, True, -5)",
        "or a cut grid in chunks, got -5",
    ),
    "gdn_fwd initial_state shape": (
        _GDN_ARGS + "ops.gdn_fwd(q, q, q, g, torch.rand_like(g), cu, torch.zeros(2, 3, device='cuda'), 0.125, True, True)",
        "initial_state must be [N, HV, K, V] = [1, 1, 128, 128], got [2, 3]",
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("call", list(_BAD_CALLS))
def test_binding_rejects_bad_arguments_with_runtime_error(call):
    code, message = _BAD_CALLS[call]
    program = (
        "import torch\nfrom cake_ops import build\nops = build.load()\ntry:\n"
        + "".join("    " + line + "\n" for line in code.splitlines())
        + "except RuntimeError as e:\n    print('RAISED', e)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", program], cwd=repo, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "RAISED" in done.stdout and message in done.stdout, (
        f"exit {done.returncode}: {done.stdout[-500:]} {done.stderr[-500:]}"
    )

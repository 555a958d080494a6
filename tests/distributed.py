"""Runs a test body on several ranks: spawned processes, on the CPU with the gloo backend
(``run_ranks``) or one a GPU with NCCL (``run_nccl_ranks``), a FileStore rendezvous (no
ports), and a deadline after which every rank is killed. (Ranks as threads of one process:
``cake_ops.testing.run_rank_threads``.)"""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist

from cake_ops.testing import run_spawned


def _entry(rank: int, world: int, store_path: str, fn, args, backend: str = "gloo") -> None:
    import torch

    device = None
    if backend == "nccl":  # one rank a GPU; NVLink multicast off (run_spawned's environment)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            device_id=device)
    try:
        fn(rank, world, *args)
        dist.barrier()  # no rank leaves while another still exchanges with it
    finally:
        dist.destroy_process_group()
    if backend == "gloo":
        _assert_no_gloo_threads()


def _assert_no_gloo_threads() -> None:
    """A destroyed group's gloo threads end with it. One whose group something still holds
    lives on and dies with the interpreter, which has aborted ranks at exit after their
    checks had passed ("terminate called without an active exception"; the cause and its
    fix in cake_ops.kcp.collectives)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):  # thread names are Linux's
        return
    names = []
    for t in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, t, "comm")) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    left = [n for n in names if "gloo" in n]
    if left:
        raise AssertionError(f"gloo threads outlive destroy_process_group: {left}")


def run_ranks(fn, world: int, *args, timeout: float = 300.0, backend: str = "gloo") -> None:
    """``fn(rank, world, *args)`` on ``world`` ranks (gloo on the CPU, or NCCL with rank r on
    cuda:r); an exception on any rank (its traceback) or the deadline fails the caller.
    ``fn`` must be importable (module level)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_spawned(_entry, world, (world, os.path.join(tmp, "store"), fn, args, backend), timeout)


def run_nccl_ranks(fn, world: int, *args, timeout: float = 600.0) -> None:
    """``run_ranks`` with NCCL, one process a GPU (needs ``world`` GPUs)."""
    run_ranks(fn, world, *args, timeout=timeout, backend="nccl")


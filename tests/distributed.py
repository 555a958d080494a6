"""Runs a test body on several ranks: spawned CPU processes with the gloo backend, a
FileStore rendezvous (no ports), and a deadline after which every rank is killed. (Ranks
as threads of one process: ``cake_ops.testing.run_rank_threads``.)"""

from __future__ import annotations

import os
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, store_path: str, fn, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 300.0) -> None:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; an exception on any rank (its
    traceback) or the deadline fails the caller. ``fn`` must be importable (module level)."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world} ranks did not finish within {timeout} s")


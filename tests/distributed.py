"""Runs a test body on several ranks: spawned CPU processes with the gloo backend, a
FileStore rendezvous (no ports), and a deadline after which every rank is killed. (Ranks
as threads of one process: ``cake_ops.testing.run_rank_threads``.)"""

from __future__ import annotations

import os
import sys
import tempfile

import torch.distributed as dist

from cake_ops.testing import run_spawned


def _entry(rank: int, world: int, store_path: str, fn, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()  # no rank leaves while another still exchanges with it
    finally:
        dist.destroy_process_group()
    # Passed: leave at once. A spawned rank's interpreter shutdown after torch.compile
    # has aborted in native thread teardown ("terminate called without an active
    # exception", SIGABRT; once in CI, in test_kcp_traces_and_checkpoints) after all of
    # its checks had passed. A failing check raises above and never gets here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout: float = 300.0) -> None:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; an exception on any rank (its
    traceback) or the deadline fails the caller. ``fn`` must be importable (module level)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_spawned(_entry, world, (world, os.path.join(tmp, "store"), fn, args), timeout)


"""The accuracy contract (docs/contract.md, Accuracy) as code, shared by the tests and the benchmark.

Every output and gradient must be finite and meet, against the FP64 reference,
    rel-RMS = ||x - ref|| / ||ref|| <= 1e-2   and   max|x - ref| <= 2e-2 * max|ref|.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

REL_RMS_TOL = 1e-2
MAX_ABS_TOL = 2e-2


@dataclass
class Accuracy:
    rel_rms: float
    max_abs_ratio: float  # max|x - ref| / max|ref|
    finite: bool

    @property
    def ok(self) -> bool:
        return self.finite and self.rel_rms <= REL_RMS_TOL and self.max_abs_ratio <= MAX_ABS_TOL


def accuracy(x: torch.Tensor, ref: torch.Tensor) -> Accuracy:
    if x.shape != ref.shape:
        raise ValueError(f"shape {tuple(x.shape)} != reference shape {tuple(ref.shape)}")
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    finite = bool(torch.isfinite(x).all())
    err = x - ref
    ref_norm = ref.norm().item()
    ref_max = ref.abs().max().item() if ref.numel() else 0.0
    # Against an all-zero reference (e.g. no tokens) the bounds hold for the error itself.
    rel = err.norm().item() / ref_norm if ref_norm > 0 else err.norm().item()
    mx = (err.abs().max().item() if err.numel() else 0.0) / (ref_max if ref_max > 0 else 1.0)
    return Accuracy(rel, mx, finite)


@contextlib.contextmanager
def poisoned_allocations():
    """Fill every fresh allocation (outputs, workspaces) with NaN for the duration.

    Uses torch.use_deterministic_algorithms with fill_uninitialized_memory, which makes
    torch.empty (and at::empty in extensions) write NaN into float memory, so a kernel
    that leaves an element unwritten returns NaN there instead of stale values.
    """
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)


def make_gdn_inputs(
    lengths,
    H: int,
    HV: int,
    K: int,
    V: int,
    *,
    gate: str = "normal",
    beta: str = "uniform",
    beta_dtype: torch.dtype = torch.float32,
    dtype: torch.dtype = torch.bfloat16,
    normalized_qk: bool = False,
    initial_state: bool = False,
    device="cpu",
    seed: int = 0,
) -> dict:
    """Fresh random inputs (never zeros) for a packed GDN call.

    gate: "normal" (g in [-1, 0)), "strong" (down to -20 per token), "slow" (about -1e-3).
    beta: "uniform" in (0, 1) or "extreme" (a mix of values near 0 and near 1).
    normalized_qk: unit-norm q/k rows, for calls without the in-op L2 norm (the chunked
    algorithm, like the peers', assumes normalised keys).
    """
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(T, H, K), randn(T, H, K)
    if normalized_qk:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    v = randn(T, HV, V)
    u = torch.rand(T, HV, generator=gen)
    g = {"normal": -(u + 1e-3), "strong": -20 * u - 1e-3, "slow": -1e-3 * (u + 0.5)}[gate]
    if beta == "uniform":
        b = torch.rand(T, HV, generator=gen) * 0.98 + 0.01
    else:
        near_one = torch.rand(T, HV, generator=gen) < 0.5
        b = torch.where(near_one, 1 - 1e-3 * u, 1e-3 * u + 1e-6)
    out = dict(
        q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.float(), beta=b.to(beta_dtype),
        cu_seqlens=torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32),
        initial_state=randn(len(lengths), HV, K, V) * 0.5 if initial_state else None,
    )
    return {n: (t.to(device) if t is not None else None) for n, t in out.items()}


# NVLink multicast off in NCCL, PyTorch and NVSHMEM, in every process of a multi-GPU run
# before it starts NCCL: on the lent multi-GPU machines a program that uses it can take
# the host's shared GPUs out of service (their environment sets these; a run keeps them).
NO_NVLINK_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _without_nvlink_multicast(rank: int, entry, *args) -> None:
    import os

    os.environ.update(NO_NVLINK_MULTICAST)
    entry(rank, *args)


def run_spawned(entry, nprocs: int, args: tuple, timeout: float) -> None:
    """``entry(rank, *args)`` in ``nprocs`` spawned processes (with NO_NVLINK_MULTICAST in
    their environment); an exception in any (its traceback) fails the caller, and past
    ``timeout`` seconds every process is killed. ``entry`` must be importable (module level)."""
    import time

    import torch.multiprocessing as mp

    procs = mp.start_processes(_without_nvlink_multicast, args=(entry, *args), nprocs=nprocs, join=False,
                               start_method="spawn")
    deadline = time.monotonic() + timeout
    while not procs.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            raise TimeoutError(f"{nprocs} ranks did not finish within {timeout} s")


def run_rank_threads(fn, world: int, *args, timeout: float = 300.0) -> None:
    """``fn(rank, world, *args)`` on ``world`` ranks as threads of this process, on
    torch's threaded process group (real data exchange between the threads; the ranks
    share this process's devices, so several ranks run on one GPU). An exception on any
    rank fails the caller with that rank's traceback."""
    import threading
    import time

    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup, _install_threaded_pg, _uninstall_threaded_pg)

    errors: list[tuple[int, BaseException]] = []
    world_data = _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()

    def worker(rank):
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            fn(rank, world, *args)
        except BaseException as e:  # noqa: BLE001 - reported below with its rank
            errors.append((rank, e))
            ProcessLocalGroup.exception_handle(e)  # wakes the ranks waiting in a collective
        finally:
            if dist.distributed_c10d._world is world_data:
                try:
                    dist.destroy_process_group()
                except AttributeError as e:
                    # torch 2.11's destroy_process_group reads a field (comms) that its own
                    # threaded world lacks; _uninstall_threaded_pg below drops that world anyway.
                    if "comms" not in str(e):
                        raise

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"{world} rank threads did not finish within {timeout} s")
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
        ProcessLocalGroup.reset()
    if errors:
        # The failing rank's own error, not the SystemExit the threaded group raises in the
        # ranks it then wakes from their collectives.
        rank, e = min(errors, key=lambda x: (isinstance(x[1], SystemExit), x[0]))
        raise AssertionError(f"rank {rank} of {world} failed: {type(e).__name__}: {e}") from e

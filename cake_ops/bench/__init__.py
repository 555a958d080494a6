"""Benchmark of GDN training ops against the public peers: ``python -m cake_ops.bench``.

cake (``cake_ops.gdn``, deterministic and not, plus an A/A copy) against FLA, FlashQLA
and this project's PyTorch path, in one process on one device: ``fwd``, ``fwdbwd`` and
``ckpt`` on the benchmark shapes, every arm first checked against the FP64 reference;
per cell ``kernel_ms`` (profiler), ``stream_ms`` and ``sync_ms`` (CUDA events),
``floor_ms`` (FLOP over the measured matmul rate) and ``peak_mem_bytes``, in a table
and a strict JSON. The protocol and shapes: docs/benchmark.md.

Usage: ``python -m cake_ops.bench --shapes s32k_h16 --json out/s32k_h16.json``;
``--quick`` is a smoke test (tiny shapes, two calls) that also runs on a CPU. TileLang
compiles each kernel shape on first use (20-40 s each): keep the shape list of one
invocation short.

The parts: ``shapes`` (shapes, inputs, FLOP model and floor), ``arms`` (the arms and
ops: import, skip, call), ``accuracy`` (the FP64 check), ``timing`` (the protocol and
peak memory), ``report`` (meta, tables, JSON) and ``__main__`` (the command line).
"""

from .shapes import SHAPES, chunks_per_head, fwd_flop_per_head_chunk, make_inputs

__all__ = ["SHAPES", "chunks_per_head", "fwd_flop_per_head_chunk", "make_inputs"]

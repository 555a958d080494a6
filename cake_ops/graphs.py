"""``graph="replay"``: a CUDA op call replayed from a CUDA graph of its own launches.

At the small shapes the host issues a GDN step's launches more slowly than the device
runs them (docs/kernels.md, "Host time"). With ``graph="replay"`` the CUDA kernels of
``cake::gdn_fwd``, ``cake::gdn_fwd_full`` and ``cake::gdn_bwd`` run a call as one graph
replay: the first call of a shape key runs eagerly and then captures the same launches
into a CUDA graph with static inputs and outputs (``torch.cuda.graph``, which synchronizes
the device once, there); later calls copy their inputs into the static ones, replay, and
return copies of the static outputs. That works because no op
reads ``cu_seqlens`` on the host: its values are an input like any other, and the plan
kernel reads them on the device. The bits are those of the eager call (the same kernels,
plan and order).

A key is the op, every tensor argument's shape, strides and dtype, and the scalar
arguments. Each key holds its graph, its static inputs and outputs, and the private
memory pool of its captured workspaces (about what one eager call peaks at) until it is
evicted: at most ``MAX_KEYS`` keys per process, least recently used out first
(``clear()`` drops them all). A call made while the current stream is capturing (the
caller's own graph) runs its launches into that capture instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

MAX_KEYS = 8

_graphs: OrderedDict[tuple, _Replay] = OrderedDict()


def key(op, args: Sequence) -> tuple:
    """The key of a call: ``op`` (any hashable) and each argument's shape, strides, dtype
    and device, or its value."""
    parts: list = [op]
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((a.shape, a.stride(), a.dtype, a.device))
        else:
            parts.append(a)
    return tuple(parts)


class _Replay:
    """One key's graph: static copies of the tensor arguments, the captured outputs."""

    def __init__(self, launch: Callable, args: Sequence):
        self.launch = launch
        self.static = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                       if isinstance(a, torch.Tensor) else a for a in args]
        for s, a in zip(self.static, args):
            if isinstance(a, torch.Tensor):
                s.copy_(a)
        self.graph = torch.cuda.CUDAGraph()
        # Captured on a side stream (as torch.cuda.graph does), after the copies above.
        with torch.cuda.graph(self.graph):
            out = launch(*self.static)
        self.outputs = out if isinstance(out, tuple) else (out,)

    def __call__(self, args: Sequence) -> tuple:
        # One host call for all the copies: at the small shapes the host sets the pace.
        pairs = [(s, a) for s, a in zip(self.static, args) if isinstance(a, torch.Tensor)]
        torch._foreach_copy_([s for s, _ in pairs], [a for _, a in pairs])
        self.graph.replay()
        return tuple(o.clone() for o in self.outputs)


def replay(op, launch: Callable, args: Sequence):
    """``launch(*args)`` as a graph replay of its key (module docstring); the first call
    of a key runs eagerly and captures. Returns what ``launch`` returns."""
    if torch.cuda.is_current_stream_capturing():
        return launch(*args)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    with torch.cuda.device(device):
        k = key(op, args)
        graph = _graphs.get(k)
        if graph is None:
            out = launch(*args)
            while len(_graphs) >= MAX_KEYS:
                _graphs.popitem(last=False)
            _graphs[k] = _Replay(launch, args)
            return out
        _graphs.move_to_end(k)
        out = graph(args)
    return out if len(out) > 1 else out[0]


def clear() -> None:
    """Drops every key's graph and memory."""
    _graphs.clear()


def keys() -> int:
    """How many keys hold a graph now."""
    return len(_graphs)

"""The GDN ops ``cake::gdn_fwd``, ``cake::gdn_fwd_full`` / ``cake::gdn_bwd``,
``cake::gdn_fwd_final_state`` and ``cake::gdn_bwd_initial_state`` (the final states
alone and the initial states' gradient alone, for KCP), ``cake::gdn_segment_summaries``
and ``cake::gdn_segment_grad_summaries`` (documents' summaries and their gradients'
mirror, for KCP's relays), ``cake::gdn_state_chain`` and
``cake::gdn_state_grad_chain`` (the cut walks' chains on given segment summaries, for
KCP) and the user entry point ``gdn``.

The ops work in the packed layout (q, k: [T, H, K]; v: [T, HV, V]; g, beta: [T, HV];
``cu_seqlens`` [N+1] on the device). ``cake::gdn_fwd`` carries the autograd formula, so
a compiled model can call ``torch.ops.cake.gdn_fwd`` directly. Which implementation
runs a call is decided by ``cake_ops.dispatch`` (the CUDA kernels of ``csrc/gdn/`` on
Hopper for K = V = 128 and bf16 q/k/v, forward and backward, else the chunked
PyTorch algorithm of ``cake_ops.pytorch.gdn``). Fake kernels: ``meta/gdn.py``. The math: docs/math.md.

Save modes (``gdn(save_mode=...)``; docs/contract.md, "Save modes"): ``"light"`` (the
default) saves the inputs only and the backward recomputes the forward's tapes;
``"full"`` runs ``cake::gdn_fwd_full``, whose CUDA forward also writes the tapes (the
per-chunk block of csrc/gdn/plan.h, ``gdn_tapes_bytes`` bytes) for the backward to read;
``gdn_saved_bytes`` counts everything a call keeps for its backward.
The gradients are bitwise the same in both. The PyTorch path keeps no tapes (its
``tapes`` output is empty) and recomputes in either mode.
"""

from __future__ import annotations

import threading
import warnings

import torch

from .. import checkpointing, dispatch, graphs
from . import cuda_kernel
from ..checks import (check_cu_seqlens_values, check_doc_flags, check_gdn, check_gdn_grads, check_piece_flags,
                      check_scale, default_scale, check_segment_chunks, check_state_chain)
from ..pytorch import gdn as pytorch_gdn
from ..varlen import to_packed

_warned_nondeterministic = False

# Set by gdn() around its one op call, each consumed by the first reader:
# ``discarded``, a checkpoint recompute whose output torch discards (cake_ops.checkpointing):
# the op's kernels leave o and the final state unwritten and launch nothing;
# ``stand_in``, a checkpoint run in which the call keeps no tapes while the region's other
# run may (reuse_recompute_tapes): the autograd saves a stand-in in the tapes' slot.
_call = threading.local()


def _consume(flag: str) -> bool:
    if getattr(_call, flag, False):
        setattr(_call, flag, False)
        return True
    return False


def _output_discarded() -> bool:
    return _consume("discarded")


def _unwritten_outputs(q, v, cu_seqlens):
    T, HV, V = v.shape
    K = q.shape[-1]
    return v.new_empty(T, HV, V), v.new_empty(cu_seqlens.shape[0] - 1, HV, K, V, dtype=torch.float32)


def effective_deterministic(deterministic: bool) -> bool:
    """``torch.use_deterministic_algorithms(True)`` overrides ``deterministic=False``."""
    global _warned_nondeterministic
    if deterministic or not torch.are_deterministic_algorithms_enabled():
        return deterministic
    if not _warned_nondeterministic:
        _warned_nondeterministic = True
        warnings.warn(
            "cake_ops: deterministic=False was asked for while torch.use_deterministic_algorithms(True) "
            "is set; running the deterministic variant.",
            stacklevel=3,
        )
    return True


@torch.library.custom_op("cake::gdn_fwd", mutates_args=())
def gdn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
    deterministic: bool,
    graph: bool = False,
    segment_chunks: int = -1,
    doc_flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked GDN forward over packed documents.

    Returns (o [T, HV, V] in v's dtype, final_state [N, HV, K, V] fp32). The final state
    is always produced (it is small); ``cake_ops.gdn`` drops it unless asked. ``graph``:
    the CUDA kernels' launches replayed from a CUDA graph (``cake_ops.graphs``; the
    PyTorch path ignores it). ``segment_chunks``: the CUDA walks' cut grid, -1 (the
    plan's: docs/kernels.md, "Plan and cut grid"), 0 (uncut) or every that many chunks
    of each document (the PyTorch path walks uncut either way; the backward of the call
    takes the same grid). ``doc_flags``: uint8 [N], where a document is a piece of a
    longer one cut on its grid, whether it opens (1) and closes (2) inside it (the CUDA
    plan's empty segments) and whether it is cut at the half (4) or the full (8) grid of
    the longer document's class (docs/kernels.md, "Plan and cut grid"; needs a cut plan;
    4 needs a plan with a half grid: a bit the call cannot honour stops the stream with a
    device-side assert naming doc_flags; the PyTorch path ignores it: it changes no math,
    only which fp32 chain a piece's edge state comes from and where it is cut).
    """
    return _gdn_fwd_pytorch(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic,
                            segment_chunks=segment_chunks, doc_flags=doc_flags)


def gdn_tapes_bytes(T: int, N: int, H: int, HV: int, use_qk_l2norm: bool) -> int:
    """Bytes of the full save mode's tapes on the CUDA path (csrc/gdn/plan.cu
    ``gdn_chunk_layout`` with the tapes): per chunk slot (ceil(T / 64) + N of them) and
    value head A (bf16 64 x 64), gcum and beta (fp32 64 each), the chunk decay (fp32) and
    the start state S^T (bf16 128 x 128; the backward forms v_new again from it); per
    chunk slot and q/k head the rows' log inverse norms with ``use_qk_l2norm`` (fp32
    2 x 64); each piece rounded up to 256 bytes."""
    tiles = (-(-T // pytorch_gdn.CHUNK) + N) * HV
    pieces = (tiles * 64 * 64 * 2, tiles * 64 * 4, tiles * 64 * 4, tiles * 4,
              (-(-T // pytorch_gdn.CHUNK) + N) * H * 2 * 64 * 4 if use_qk_l2norm else 0,
              tiles * 128 * 128 * 2)
    return sum(-(-n // 256) * 256 for n in pieces)


def gdn_saved_bytes(
    T: int,
    N: int,
    H: int,
    HV: int,
    K: int = 128,
    V: int = 128,
    *,
    dtype: torch.dtype = torch.bfloat16,
    beta_dtype: torch.dtype = torch.float32,
    cu_seqlens_dtype: torch.dtype = torch.int32,
    initial_state: bool = False,
    use_qk_l2norm: bool = False,
    save_mode: str = "light",
    device: str = "cuda",
) -> int:
    """Bytes of the tensors a ``gdn`` call's autograd node keeps from the forward to the
    backward, for T tokens in N documents, H q/k heads and HV value heads of dims K, V:
    q, k, v (``dtype``), g (fp32), beta, ``cu_seqlens`` and the initial state when given
    (tensors the caller holds anyway unless they are temporaries of its forward), and in
    the full save mode the tapes the CUDA forward writes (``gdn_tapes_bytes``; none where
    the call runs the PyTorch implementation, which keeps no tapes: ``device`` other than
    "cuda", or a dtype or head dims the CUDA kernels do not take, ``cake_ops.dispatch``).
    Tests compare it with the tensors the op saves (tests/op/test_byte_queries.py)."""
    if save_mode not in SAVE_MODES:
        raise ValueError(f"save_mode must be one of {SAVE_MODES}, got {save_mode!r}")
    saved = ((2 * T * H * K + T * HV * V) * dtype.itemsize + T * HV * (4 + beta_dtype.itemsize)
             + (N + 1) * cu_seqlens_dtype.itemsize + (N * HV * K * V * 4 if initial_state else 0))
    cuda_kernels = (device == "cuda" and dtype == torch.bfloat16
                    and (K, V) == (dispatch.GDN_CUDA_HEAD_DIM, dispatch.GDN_CUDA_HEAD_DIM))
    if save_mode == "full" and cuda_kernels:
        saved += gdn_tapes_bytes(T, N, H, HV, use_qk_l2norm)
    return saved


def gdn_workspace_bytes(
    T: int,
    N: int,
    H: int,
    HV: int,
    *,
    use_qk_l2norm: bool = False,
    deterministic: bool = True,
    save_mode: str = "light",
    direction: str = "forward",
    segment_chunks: int = -1,
    doc_flags: bool = False,
) -> int:
    """Bytes of the one workspace a ``gdn`` call's CUDA kernels allocate beside its
    inputs and outputs, on the current CUDA device (the plan reads its SM count), for
    the forward or the backward (``direction``) in the save mode's form: the call's
    allocator peak of requested bytes is this plus its outputs' bytes
    (tests/cuda/test_gdn_byte_queries.py). ``direction="initial_state"``: a
    ``cake::gdn_bwd_initial_state`` call's (the light backward's workspace and the dv_new
    its reverse walk writes on the way, bf16 [T, HV, 128]; ``save_mode`` does not enter);
    ``direction="final_state"``: a ``cake::gdn_fwd_final_state`` call's (the light
    forward's workspace: it allocates no o); ``"segment_summaries"`` and
    ``"segment_grad_summaries"``: a ``cake::gdn_segment_summaries`` and
    ``cake::gdn_segment_grad_summaries`` call's (the light forward's and backward's
    workspaces; they always take doc_flags). ``segment_chunks``: the ops' cut grid (-1:
    the plan's); ``doc_flags``: the call passes per-document flags (their empty segments
    take slots of the plan).
    Needs the CUDA extension (the PyTorch implementation has no workspace of its own); a
    ValueError names a bad option."""
    if save_mode not in SAVE_MODES:
        raise ValueError(f"save_mode must be one of {SAVE_MODES}, got {save_mode!r}")
    if direction not in WORKSPACE_DIRECTIONS:
        raise ValueError(f"direction must be one of {WORKSPACE_DIRECTIONS}, got {direction!r}")
    check_segment_chunks(segment_chunks)
    from .. import build

    if not build.available():
        raise RuntimeError(f"gdn_workspace_bytes needs the CUDA kernels: {build.unavailable_reason()}")
    if direction == "initial_state":
        dv_new = T * HV * dispatch.GDN_CUDA_HEAD_DIM * 2  # bf16
        return build.load().gdn_workspace_bytes(T, N, H, HV, use_qk_l2norm, deterministic, True, False,
                                                segment_chunks, doc_flags) + dv_new
    if direction in ("final_state", "segment_summaries", "segment_grad_summaries"):
        return build.load().gdn_workspace_bytes(T, N, H, HV, use_qk_l2norm, deterministic,
                                                direction == "segment_grad_summaries", False, segment_chunks,
                                                doc_flags or direction != "final_state")
    return build.load().gdn_workspace_bytes(T, N, H, HV, use_qk_l2norm, deterministic, direction == "backward",
                                            save_mode == "full", segment_chunks, doc_flags)


WORKSPACE_DIRECTIONS = ("forward", "backward", "initial_state", "final_state", "segment_summaries",
                        "segment_grad_summaries")


@torch.library.custom_op("cake::gdn_fwd_full", mutates_args=())
def gdn_fwd_full(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
    deterministic: bool,
    graph: bool = False,
    segment_chunks: int = -1,
    doc_flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cake::gdn_fwd`` of the full save mode: (o, final_state, tapes), tapes uint8
    [``gdn_tapes_bytes``] on the CUDA path (the forward's tapes for ``cake::gdn_bwd``),
    empty on the PyTorch path. o and final_state are bitwise ``cake::gdn_fwd``'s."""
    return _gdn_fwd_full_pytorch(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic,
                                 segment_chunks=segment_chunks, doc_flags=doc_flags)


def _gdn_fwd_full_pytorch(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic,
                          segment_chunks=-1, doc_flags=None):
    o, final_state = _gdn_fwd_pytorch(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                                      deterministic, segment_chunks=segment_chunks, doc_flags=doc_flags)
    return o, final_state, q.new_empty(0, dtype=torch.uint8)  # no tapes: its backward recomputes


def _launch(op: str, graph: bool, args: tuple):
    """The CUDA extension's ``op`` on ``args``, as a graph replay with ``graph``."""
    from .. import build

    launch = getattr(build.load(), op)
    return graphs.replay(op, launch, args) if graph else launch(*args)


@cuda_kernel("gdn_fwd_full")
def _gdn_fwd_full_cuda(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic,
                       graph=False, segment_chunks=-1, doc_flags=None):
    check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)
    check_scale(scale)
    check_segment_chunks(segment_chunks)
    check_doc_flags(doc_flags, cu_seqlens.shape[0] - 1, q.device)
    if dispatch.gdn_fwd_cuda_refusal(q, k, v, g, beta, cu_seqlens, scale) is not None:
        return _gdn_fwd_full_pytorch(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                                     deterministic)
    return _launch("gdn_fwd_full", graph, (q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                                           effective_deterministic(deterministic), segment_chunks, -1, doc_flags))


def _gdn_fwd_pytorch(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic,
                     segment_chunks=-1, doc_flags=None):
    T = check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)[0]
    check_scale(scale)
    check_segment_chunks(segment_chunks)
    check_doc_flags(doc_flags, cu_seqlens.shape[0] - 1, q.device)
    check_cu_seqlens_values(cu_seqlens, T)
    effective_deterministic(deterministic)  # the PyTorch path is deterministic either way
    if _output_discarded():
        return _unwritten_outputs(q, v, cu_seqlens)
    return pytorch_gdn.gdn_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


@cuda_kernel("gdn_fwd")
def _gdn_fwd_cuda(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic, graph=False,
                  segment_chunks=-1, doc_flags=None):
    check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)
    check_scale(scale)
    check_segment_chunks(segment_chunks)
    check_doc_flags(doc_flags, cu_seqlens.shape[0] - 1, q.device)
    if dispatch.gdn_fwd_cuda_refusal(q, k, v, g, beta, cu_seqlens, scale) is not None:
        return _gdn_fwd_pytorch(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic)
    deterministic = effective_deterministic(deterministic)
    if _output_discarded():
        return _unwritten_outputs(q, v, cu_seqlens)
    # The kernels' first stage checks cu_seqlens's values itself (csrc/gdn/plan.cu).
    return _launch("gdn_fwd", graph, (q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                                      deterministic, segment_chunks, -1, doc_flags))


@torch.library.custom_op("cake::gdn_fwd_final_state", mutates_args=())
def gdn_fwd_final_state(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
    deterministic: bool,
    segment_chunks: int = -1,
    doc_flags: torch.Tensor | None = None,
) -> torch.Tensor:
    """The final states alone: [N, HV, K, V] fp32, bitwise the final state of
    ``cake::gdn_fwd`` on the same arguments (``doc_flags`` as that op's). On the CUDA kernels it runs the forward's
    plan, prep and cut summaries and chain, then walks only each document's last segment,
    without the output (no q, P~ or o: csrc/gdn/gdn.h ``gdn_fwd_final_state_walk_launch``).
    KCP's forward uses it for the summaries of the fragments another of their document
    follows (cake_ops/kcp/gdn.py); ``scale`` is checked but enters no state."""
    return _gdn_fwd_final_state_pytorch(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                                        deterministic, segment_chunks, doc_flags)


def _gdn_fwd_final_state_pytorch(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic,
                                 segment_chunks=-1, doc_flags=None):
    T = check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)[0]
    check_scale(scale)
    check_segment_chunks(segment_chunks)
    check_doc_flags(doc_flags, cu_seqlens.shape[0] - 1, q.device)
    check_cu_seqlens_values(cu_seqlens, T)
    effective_deterministic(deterministic)  # the PyTorch path is deterministic either way
    return pytorch_gdn.gdn_fwd_final_state(q, k, v, g, beta, cu_seqlens, initial_state, use_qk_l2norm)


@cuda_kernel("gdn_fwd_final_state")
def _gdn_fwd_final_state_cuda(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic,
                              segment_chunks=-1, doc_flags=None):
    check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)
    check_scale(scale)
    check_segment_chunks(segment_chunks)
    check_doc_flags(doc_flags, cu_seqlens.shape[0] - 1, q.device)
    if dispatch.gdn_fwd_cuda_refusal(q, k, v, g, beta, cu_seqlens, scale) is not None:
        return _gdn_fwd_final_state_pytorch(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                                            deterministic)
    from .. import build

    return build.load().gdn_fwd_final_state(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                                            effective_deterministic(deterministic), segment_chunks, -1, doc_flags)


@torch.library.custom_op("cake::gdn_bwd", mutates_args=())
def gdn_bwd(
    do: torch.Tensor,
    dht: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
    deterministic: bool,
    tapes: torch.Tensor | None = None,
    graph: bool = False,
    segment_chunks: int = -1,
    doc_flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked GDN backward: the forward's tapes (recomputed from the inputs in the light
    save mode; ``tapes`` from ``cake::gdn_fwd_full`` in the full one), dS walked back,
    then the chunk-local gradients.

    Returns (dq, dk, dv, dg, dbeta, dh0) with the dtypes of (q, k, v, g, beta) and
    dh0 [N, HV, K, V] fp32 (the gradient of the initial state, zero or not).
    ``segment_chunks``, ``doc_flags``: the forward's (``cake::gdn_fwd``).
    """
    args = (do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic)
    return _gdn_bwd_pytorch(*args, segment_chunks=segment_chunks, doc_flags=doc_flags)


def _check_gdn_bwd(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale) -> int:
    """The backward's static checks; returns T."""
    T, H, K, HV, V, N = check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)
    check_gdn_grads(do, dht, T, HV, V, N, K)
    check_scale(scale)
    return T


def _gdn_bwd_pytorch(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic,
                     segment_chunks=-1, doc_flags=None):
    T = _check_gdn_bwd(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale)
    check_segment_chunks(segment_chunks)
    check_doc_flags(doc_flags, cu_seqlens.shape[0] - 1, q.device)
    check_cu_seqlens_values(cu_seqlens, T)
    effective_deterministic(deterministic)  # the PyTorch path is deterministic either way
    return pytorch_gdn.gdn_bwd(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


@cuda_kernel("gdn_bwd")
def _gdn_bwd_cuda(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic,
                  tapes=None, graph=False, segment_chunks=-1, doc_flags=None):
    _check_gdn_bwd(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale)
    check_segment_chunks(segment_chunks)
    check_doc_flags(doc_flags, cu_seqlens.shape[0] - 1, q.device)
    if dispatch.gdn_bwd_cuda_refusal(do, dht, q, k, v, g, beta, cu_seqlens, scale) is not None:
        return _gdn_bwd_pytorch(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                                deterministic)
    deterministic = effective_deterministic(deterministic)
    # Recomputes the forward's tapes with the forward's own plan, or takes the kept ones
    # (its first kernel checks cu_seqlens's values), then walks dS back and forms the
    # chunk-local gradients. An empty tapes tensor is a forward that ran the PyTorch path.
    kept = tapes if tapes is not None and tapes.numel() > 0 else None
    return _launch("gdn_bwd", graph, (do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                                      deterministic, segment_chunks, -1, -1, kept, doc_flags))


@torch.library.custom_op("cake::gdn_bwd_initial_state", mutates_args=())
def gdn_bwd_initial_state(
    do: torch.Tensor,
    dht: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    deterministic: bool,
    segment_chunks: int = -1,
    doc_flags: torch.Tensor | None = None,
) -> torch.Tensor:
    """The initial states' gradient alone: dh0 [N, HV, K, V] fp32, bitwise the dh0 of
    ``cake::gdn_bwd`` on the same arguments. The state gradient's walk back reads q, k,
    the gates, do and dht only (its recursion holds no state: docs/math.md), so this op
    takes no v and no initial state, and runs the backward's prep and reverse walk
    without the tape walk and the chunk-local gradients. KCP's backward uses it for the
    fragments that follow another of their document (cake_ops/kcp/gdn.py)."""
    return _gdn_bwd_initial_state_pytorch(do, dht, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm, deterministic,
                                          segment_chunks, doc_flags)


def _gdn_bwd_initial_state_pytorch(do, dht, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm, deterministic,
                                   segment_chunks=-1, doc_flags=None):
    _check_gdn_bwd_initial_state(do, dht, q, k, g, beta, cu_seqlens, scale)
    check_segment_chunks(segment_chunks)
    check_doc_flags(doc_flags, cu_seqlens.shape[0] - 1, q.device)
    check_cu_seqlens_values(cu_seqlens, q.shape[0])
    effective_deterministic(deterministic)  # the PyTorch path is deterministic either way
    return pytorch_gdn.gdn_bwd_initial_state(do, dht, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm)


def _check_gdn_bwd_initial_state(do, dht, q, k, g, beta, cu_seqlens, scale) -> None:
    # do stands in v's place for the shapes: it has v's.
    T, H, K, HV, V, N = check_gdn(q, k, do, g, beta, cu_seqlens, None, v_name="do")
    check_gdn_grads(do, dht, T, HV, V, N, K)
    check_scale(scale)


@cuda_kernel("gdn_bwd_initial_state")
def _gdn_bwd_initial_state_cuda(do, dht, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm, deterministic,
                                segment_chunks=-1, doc_flags=None):
    _check_gdn_bwd_initial_state(do, dht, q, k, g, beta, cu_seqlens, scale)
    check_segment_chunks(segment_chunks)
    check_doc_flags(doc_flags, cu_seqlens.shape[0] - 1, q.device)
    if dispatch.gdn_bwd_cuda_refusal(do, dht, q, k, do, g, beta, cu_seqlens, scale) is not None:
        return _gdn_bwd_initial_state_pytorch(do, dht, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm,
                                              deterministic)
    from .. import build

    return build.load().gdn_bwd_initial_state(do, dht, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm,
                                              effective_deterministic(deterministic), segment_chunks, -1, doc_flags)


def _tapes_stand_in(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm):
    """A tensor of the tapes' shape, dtype and device (what ``cake::gdn_fwd_full`` would
    return for these inputs) over one byte (stride 0), which the backward reads as "no
    tapes": a checkpoint checks that the two runs of a region save alike."""
    cuda = _cuda_kernels(q, k, v, g, beta, cu_seqlens, scale)
    n = gdn_tapes_bytes(q.shape[0], cu_seqlens.shape[0] - 1, q.shape[1], v.shape[1], use_qk_l2norm) if cuda else 0
    return stand_in_over(q, n)


def stand_in_over(x: torch.Tensor, n: int) -> torch.Tensor:
    """n uint8 elements of stride 0 over the first byte of x's memory, so that the stand-in
    allocates nothing: a byte of its own holds one 512-byte allocator block through the
    backward, which put "auto"'s recompute form one block above False's peak (issue 19's
    rule). x is only viewed, never read; a call without tokens takes a byte of its own."""
    if n == 0 or x.numel() == 0:
        return x.new_empty(min(n, 1), dtype=torch.uint8).expand(n)
    first = x.detach().as_strided((1,), (1,), x.storage_offset())
    return first.view(torch.uint8)[:1].expand(n)


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic, graph, segment_chunks,
     doc_flags) = inputs
    # Light save mode: inputs only; the backward recomputes the chunk tensors and the walk.
    # Full save mode (gdn_fwd_full, a third output): the forward's tapes too. In a
    # checkpoint run that keeps no tapes while the region's other run may: a stand-in.
    if len(output) == 3:
        tapes = output[2]
        ctx.mark_non_differentiable(tapes)
    elif _consume("stand_in"):
        tapes = _tapes_stand_in(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm)
    else:
        tapes = None
    ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, initial_state, tapes, doc_flags)
    # An unused o or final state arrives as None: autograd would otherwise fill a zero
    # gradient for it (the final state's in almost every call: a kernel and about 60 us
    # of host time at s16k_h8; the tapes' size in the full mode, 0.48 ms at s32k_h16).
    ctx.set_materialize_grads(False)
    ctx.args = (scale, use_qk_l2norm, deterministic)
    ctx.graph, ctx.segment_chunks = graph, segment_chunks


def _backward(ctx, do, dht, _dtapes=None):
    q, k, v, g, beta, cu_seqlens, initial_state, tapes, doc_flags = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.cake.gdn_bwd(
        do, dht, q, k, v, g, beta, cu_seqlens, initial_state, *ctx.args,
        tapes if checkpointing.kept(tapes) else None, ctx.graph, ctx.segment_chunks, doc_flags
    )
    return (dq, dk, dv, dg, dbeta, None, dh0 if initial_state is not None else None, None, None, None, None, None,
            None)


gdn_fwd.register_autograd(_backward, setup_context=_setup_context)
gdn_fwd_full.register_autograd(_backward, setup_context=_setup_context)


def _setup_final_state(ctx, inputs, output):
    *args, segment_chunks, doc_flags = inputs
    _setup_context(ctx, (*args, False, segment_chunks, doc_flags), (None, output))


def _backward_final_state(ctx, dht):
    # The final states' gradient alone is the forward's with o's gradient zero.
    return _backward(ctx, None, dht)[:-1]


gdn_fwd_final_state.register_autograd(_backward_final_state, setup_context=_setup_final_state)


@torch.library.custom_op("cake::gdn_segment_summaries", mutates_args=())
def gdn_segment_summaries(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    deterministic: bool,
    segment_chunks: int = -1,
    doc_flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each document's summary (E [N, HV, K, V], M [N, HV, K, K], fp32): its final state
    from a zero initial state (E) and the map of its initial state to its final state
    (M: the final state from the identity with v = 0), so that a start state S
    walks to M S + E; the values of two ``cake::gdn_fwd_final_state`` calls on the same
    documents and ``doc_flags``. ``doc_flags`` is required: every document a piece that
    opens and closes inside a longer one (bits 1 | 2, with its grid class), at most one
    segment of its cut grid (the CUDA kernels assert both on the device; they need a cut
    plan: deterministic, or ``segment_chunks`` > 0). One prep and one pass of summary
    walks give both, where the two calls each run a prep and both walks; its workspace:
    ``gdn_workspace_bytes(direction="segment_summaries")``. KCP's relays
    (cake_ops/kcp/gdn.py; docs/kcp.md, "Relays")."""
    return _gdn_segment_summaries_pytorch(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, deterministic,
                                          segment_chunks, doc_flags)


def _identity_states(N, HV, K, device):
    return torch.eye(K, device=device).expand(N, HV, K, K).contiguous()


def _gdn_segment_summaries_pytorch(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, deterministic,
                                   segment_chunks=-1, doc_flags=None):
    _check_gdn_segment_summaries(q, k, v, g, beta, cu_seqlens, scale, segment_chunks, doc_flags)
    check_cu_seqlens_values(cu_seqlens, q.shape[0])
    effective_deterministic(deterministic)  # the PyTorch path is deterministic either way
    T, HV, K, N = q.shape[0], v.shape[1], q.shape[-1], cu_seqlens.shape[0] - 1
    E = pytorch_gdn.gdn_fwd_final_state(q, k, v, g, beta, cu_seqlens, None, use_qk_l2norm)
    M = pytorch_gdn.gdn_fwd_final_state(q, k, v.new_zeros(T, HV, K), g, beta, cu_seqlens,
                                        _identity_states(N, HV, K, q.device), use_qk_l2norm)
    return E, M


def _check_gdn_segment_summaries(q, k, v, g, beta, cu_seqlens, scale, segment_chunks, doc_flags) -> None:
    N = check_gdn(q, k, v, g, beta, cu_seqlens, None)[5]
    check_scale(scale)
    check_segment_chunks(segment_chunks)
    check_piece_flags(doc_flags, N, q.device)


@cuda_kernel("gdn_segment_summaries")
def _gdn_segment_summaries_cuda(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, deterministic,
                                segment_chunks=-1, doc_flags=None):
    _check_gdn_segment_summaries(q, k, v, g, beta, cu_seqlens, scale, segment_chunks, doc_flags)
    if dispatch.gdn_fwd_cuda_refusal(q, k, v, g, beta, cu_seqlens, scale) is not None:
        return _gdn_segment_summaries_pytorch(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, deterministic,
                                              segment_chunks, doc_flags)
    from .. import build

    return build.load().gdn_segment_summaries(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm,
                                              effective_deterministic(deterministic), segment_chunks, -1, doc_flags)


@torch.library.custom_op("cake::gdn_segment_grad_summaries", mutates_args=())
def gdn_segment_grad_summaries(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    deterministic: bool,
    segment_chunks: int = -1,
    doc_flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cake::gdn_segment_summaries``' mirror for the state gradient: (F [N, HV, K, V],
    B [N, HV, K, K], fp32), each document's initial state gradient from do with a zero
    final state gradient (F) and the map of its final state gradient to its initial one
    (B: from dht = I with do = 0), so that an end gradient dS walks back to B dS + F; the
    values of two ``cake::gdn_bwd_initial_state`` calls. ``doc_flags`` as that op's
    (required: pieces inside longer ones, at most one segment each); on the CUDA kernels
    one prep and one pass of reverse summary walks a head slice; its workspace:
    ``gdn_workspace_bytes(direction="segment_grad_summaries")``."""
    return _gdn_segment_grad_summaries_pytorch(do, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm, deterministic,
                                               segment_chunks, doc_flags)


def _gdn_segment_grad_summaries_pytorch(do, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm, deterministic,
                                        segment_chunks=-1, doc_flags=None):
    _check_gdn_segment_grad_summaries(do, q, k, g, beta, cu_seqlens, scale, segment_chunks, doc_flags)
    check_cu_seqlens_values(cu_seqlens, q.shape[0])
    effective_deterministic(deterministic)  # the PyTorch path is deterministic either way
    T, HV, K, N = q.shape[0], do.shape[1], q.shape[-1], cu_seqlens.shape[0] - 1
    F = pytorch_gdn.gdn_bwd_initial_state(do, None, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm)
    B = pytorch_gdn.gdn_bwd_initial_state(do.new_zeros(T, HV, K), _identity_states(N, HV, K, q.device), q, k, g,
                                          beta, cu_seqlens, scale, use_qk_l2norm)
    return F, B


def _check_gdn_segment_grad_summaries(do, q, k, g, beta, cu_seqlens, scale, segment_chunks, doc_flags) -> None:
    _check_gdn_bwd_initial_state(do, None, q, k, g, beta, cu_seqlens, scale)
    check_segment_chunks(segment_chunks)
    check_piece_flags(doc_flags, cu_seqlens.shape[0] - 1, q.device)


@cuda_kernel("gdn_segment_grad_summaries")
def _gdn_segment_grad_summaries_cuda(do, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm, deterministic,
                                     segment_chunks=-1, doc_flags=None):
    _check_gdn_segment_grad_summaries(do, q, k, g, beta, cu_seqlens, scale, segment_chunks, doc_flags)
    if dispatch.gdn_bwd_cuda_refusal(do, None, q, k, do, g, beta, cu_seqlens, scale) is not None:
        return _gdn_segment_grad_summaries_pytorch(do, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm,
                                                   deterministic, segment_chunks, doc_flags)
    from .. import build

    return build.load().gdn_segment_grad_summaries(do, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm,
                                                   effective_deterministic(deterministic), segment_chunks, -1,
                                                   doc_flags)


@torch.library.custom_op("cake::gdn_state_chain", mutates_args=())
def gdn_state_chain(E: torch.Tensor, M: torch.Tensor, S_start: torch.Tensor, seg_cu: torch.Tensor) -> torch.Tensor:
    """The end states [N, HV, K, V] fp32 of a chain of segment summaries: per document n,
    from ``S_start[n]`` through its segments' rows ``seg_cu[n] .. seg_cu[n + 1]`` of ``E``
    [R, HV, K, V] and ``M`` [R, HV, K, K] (fp32), in order, S <- M_s S + E_s (S <- E_s
    where M_s is all zeros: a truncated cut's). On the CUDA kernels it is the forward's
    chain kernel, so with the summaries a cut call forms (E_s from zero and M_s from the
    identity with v = 0, each segment a ``cake::gdn_fwd_final_state`` document flagged to
    open and close inside its document) its bits are those the whole call's chain gives
    the state after the segments. Deterministic KCP's relays (docs/kcp.md)."""
    return _gdn_state_chain_pytorch(E, M, S_start, seg_cu)


def _gdn_state_chain_pytorch(E, M, S_start, seg_cu):
    check_state_chain(E, M, S_start, seg_cu)
    return pytorch_gdn.state_chain(E, M, S_start, seg_cu)


def _state_chain_cuda(name, pytorch_fn, values, transfers, state, seg_cu):
    """A chain op on CUDA tensors: the extension's chain kernel where the dispatch rule
    takes the call (``dispatch.gdn_state_chain_cuda_refusal``), else the PyTorch path."""
    check_state_chain(values, transfers, state, seg_cu)
    if dispatch.gdn_state_chain_cuda_refusal(state) is not None:
        return pytorch_fn(values, transfers, state, seg_cu)
    from .. import build

    return getattr(build.load(), name)(values, transfers, state, seg_cu)


@cuda_kernel("gdn_state_chain")
def _gdn_state_chain_cuda(E, M, S_start, seg_cu):
    return _state_chain_cuda("gdn_state_chain", pytorch_gdn.state_chain, E, M, S_start, seg_cu)


def _setup_state_chain(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward_state_chain(ctx, grad):
    E, M, S_start, seg_cu = ctx.saved_tensors
    return (*pytorch_gdn.state_chain_backward(grad, E, M, S_start, seg_cu), None)


gdn_state_chain.register_autograd(_backward_state_chain, setup_context=_setup_state_chain)


@torch.library.custom_op("cake::gdn_state_grad_chain", mutates_args=())
def gdn_state_grad_chain(F: torch.Tensor, B: torch.Tensor, dS_end: torch.Tensor, seg_cu: torch.Tensor) -> torch.Tensor:
    """The state gradients at the documents' starts [N, HV, K, V] fp32 from those at their
    ends: per document n, from ``dS_end[n]`` back through its segments' rows ``seg_cu[n] ..
    seg_cu[n + 1]`` of ``F`` [R, HV, K, V] and ``B`` [R, HV, K, K], the last first,
    dS <- B_s dS + F_s (dS <- F_s where B_s is all zeros: a truncated cut's). On the CUDA
    kernels it is the backward's chain kernel: with the summaries of the backward's
    reverse walk (F_s from zero, B_s = M_s^T from the identity with do = 0: each segment a
    ``cake::gdn_bwd_initial_state`` document flagged to open and close inside its
    document) its bits are the whole call's chained gradient before the segments."""
    return _gdn_state_grad_chain_pytorch(F, B, dS_end, seg_cu)


def _gdn_state_grad_chain_pytorch(F, B, dS_end, seg_cu):
    check_state_chain(F, B, dS_end, seg_cu)
    return pytorch_gdn.state_grad_chain(F, B, dS_end, seg_cu)


@cuda_kernel("gdn_state_grad_chain")
def _gdn_state_grad_chain_cuda(F, B, dS_end, seg_cu):
    return _state_chain_cuda("gdn_state_grad_chain", pytorch_gdn.state_grad_chain, F, B, dS_end, seg_cu)


def _backward_state_grad_chain(ctx, grad):
    F, B, dS_end, seg_cu = ctx.saved_tensors
    return (*pytorch_gdn.state_grad_chain_backward(grad, F, B, dS_end, seg_cu), None)


gdn_state_grad_chain.register_autograd(_backward_state_grad_chain, setup_context=_setup_state_chain)

SAVE_MODES = ("light", "full")
RECOMPUTE_OUTPUT = ("auto", "always")
REUSE_RECOMPUTE_TAPES = ("auto", True, False)
GRAPH = ("off", "replay")

_last_call: dict[str, str] = {}


def gdn_diagnostics() -> dict[str, str]:
    """What the last ``gdn`` call of this process decided: ``recompute_output`` is
    ``"skipped"`` (a checkpoint recompute whose output torch discards: nothing was
    launched) or ``"launched"``, and ``why`` says why it was launched; ``tapes`` is
    ``"kept"`` (its backward reads the tapes this forward wrote, unless a later GDN call
    of the same checkpoint recompute keeps its own: ``reuse_recompute_tapes``) or
    ``"recomputed"`` (its backward recomputes them), and ``tapes_why`` says why."""
    return dict(_last_call)


def _cuda_kernels(q, k, v, g, beta, cu_seqlens, scale) -> bool:
    return q.is_cuda and dispatch.gdn_fwd_cuda_refusal(q, k, v, g, beta, cu_seqlens, scale) is None


def _kept_tapes_peak(q, v, cu_seqlens, use_qk_l2norm: bool, deterministic: bool) -> tuple[int, int]:
    """Bytes a checkpointed call's recompute and backward hold at their peak beside the
    outputs: (keeping the recompute's tapes, recomputing them in the backward), from the
    plans' workspaces (``gdn_workspace_bytes``) and the tapes' size."""
    T, H, HV, N = q.shape[0], q.shape[1], v.shape[1], cu_seqlens.shape[0] - 1
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    with torch.cuda.device(q.device):
        ws = {(mode, d): gdn_workspace_bytes(T, N, H, HV, use_qk_l2norm=use_qk_l2norm, deterministic=deterministic,
                                             save_mode=mode, direction=d)
              for mode in SAVE_MODES for d in ("forward", "backward")}
    kept = gdn_tapes_bytes(T, N, H, HV, use_qk_l2norm) + max(ws["full", "forward"], ws["full", "backward"])
    return kept, max(ws["light", "forward"], ws["light", "backward"])


def _checkpoint_plan(base_saves: int, full_mode: bool, recompute_output: str, reuse, replay: bool, cuda, peak):
    """How a call runs given the checkpoint run it is in (cake_ops.checkpointing):
    (run cake::gdn_fwd_full, output discarded, save a tapes stand-in, the recompute Pass
    whose tapes it keeps or None, the diagnostics record). ``base_saves``: the tensors
    the light node saves (0 without an autograd node); ``cuda()``: whether the CUDA
    kernels take the call (the PyTorch implementation keeps no tapes); ``peak()``:
    ``_kept_tapes_peak`` of the call. Both are asked only where the answer decides."""
    if base_saves == 0:
        why = "the call saves no tensors for backward (no input requires grad, or grad mode is off)"
        return False, False, False, None, dict(recompute_output="launched", why=why, tapes="recomputed",
                                                tapes_why=why)
    p = checkpointing.checkpoint_pass()
    # Where either run of a region may keep tapes, both save a tensor in the tapes' slot
    # (torch pairs the two runs' saves by position): the tapes, or a stand-in.
    slot = p.kind != "" and (full_mode or reuse is not False)
    saves = base_saves + (1 if slot or full_mode else 0)
    if p.kind == "":
        return full_mode, False, False, None, dict(
            recompute_output="launched", why=p.why, tapes="kept" if full_mode else "recomputed",
            tapes_why="save_mode='full'" if full_mode else "save_mode='light'")
    if p.kind == "first":  # torch drops what this run saves: keep nothing
        return False, False, slot, None, dict(recompute_output="launched", why=p.why, tapes="recomputed",
                                              tapes_why="the first forward of a checkpointed region (torch drops its saves)")
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    closing = checkpointing.closing_proof(p, saves)
    why = ("recompute_output='always'" if recompute_output == "always" else
           "graph='replay'" if replay else
           "the current CUDA stream is capturing a graph" if capturing else closing)
    if why is None:
        return False, True, slot, None, dict(recompute_output="skipped", why="", tapes="recomputed",
                                             tapes_why="the recompute launches nothing")
    keep_why = ("reuse_recompute_tapes=False" if not slot else
                "the current CUDA stream is capturing a graph" if capturing else
                "the PyTorch implementation keeps no tapes" if not cuda() else None)
    if keep_why is None and not full_mode and reuse == "auto":
        if closing is not None:
            keep_why = f"reuse_recompute_tapes='auto' and {closing}: kept tapes would live through its backward"
        else:
            kept_bytes, recomputed_bytes = peak()
            if kept_bytes > recomputed_bytes:
                keep_why = (f"reuse_recompute_tapes='auto': kept tapes would raise the peak "
                            f"({kept_bytes} > {recomputed_bytes} bytes)")
    keep = keep_why is None
    return keep, False, slot and not keep, p if keep else None, dict(
        recompute_output="launched", why=why, tapes="kept" if keep else "recomputed", tapes_why=keep_why or "")


def gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    deterministic: bool = True,
    save_mode: str = "light",
    recompute_output: str = "auto",
    reuse_recompute_tapes: str | bool | None = None,
    graph: str = "off",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet (chunked, differentiable) over packed variable-length documents.

    Args:
        q, k: [T, H, K] (packed) or [B, T, H, K]; bf16 (fp16/fp32 also accepted).
        v: [T, HV, V] or [B, T, HV, V], HV a multiple of H (GVA).
        g: [T, HV] / [B, T, HV] fp32 log decay (<= 0; -inf is a full reset).
        beta: same shape, fp32 or q's dtype.
        cu_seqlens: [N+1] int32/int64 tensor of document boundaries on q's device; None
            means one document per batch row. Not allowed with B > 1.
        scale: a finite float; defaults to K ** -0.5.
        initial_state: [N, HV, K, V] fp32 (N = documents, or B).
        output_final_state: return the final state [N, HV, K, V] fp32.
        use_qk_l2norm: L2-normalise q and k inside the op (with its backward).
        deterministic: bitwise reproducible (default). False allows faster plans.
        save_mode: what the forward keeps for the backward: "light" (default) the inputs
            only, the backward recomputes the rest; "full" also the forward's tapes
            (``gdn_tapes_bytes``, about 650 bytes per token and value head on the CUDA path;
            ``gdn_saved_bytes`` counts all a call keeps),
            so the backward runs faster. Gradients are bitwise the same in both.
        recompute_output: "auto" (default): in the recompute of a non-reentrant
            ``torch.utils.checkpoint`` whose last saved tensors are this call's (nothing
            after it in the region saves), launch nothing, since torch discards the
            output (``cake_ops.checkpointing``; ``gdn_diagnostics()`` says what the last
            call did and why). "always": launch the forward in every case. Gradients and
            saved bytes are the same either way.
        reuse_recompute_tapes: in a non-reentrant checkpoint's recompute that launches
            the forward, whether it also writes the tapes for the backward to read instead
            of recomputing them (bitwise the same gradients; it keeps what save_mode="full"
            keeps, in the recompute only: the region's first run keeps nothing in either
            save mode). True: keep them, in the region's last GDN call only (a later call
            of the same recompute frees an earlier one's, so one kept set is live).
            "auto" (the default): keep them only where the call closes the region (its
            backward runs first) and keeping peaks no higher than recomputing (from the
            plans' workspaces); so with recompute_output="auto", which launches nothing
            there, it keeps none. False: never. save_mode="full" keeps them in every
            recompute that launches and refuses False; graph="replay" refuses True and
            "auto", and its default is False.
        graph: "off" (default) or "replay": on the CUDA kernels, the forward's and the
            backward's launches replay from a CUDA graph per shape key (the first call of a
            key runs eagerly, synchronizes once and captures; ``cake_ops.graphs``: at most
            ``MAX_KEYS`` keys, each holding one call's memory). The bits are the eager
            ones; a checkpoint recompute then always launches.
    Returns:
        (o in v's layout and dtype, final_state or None).
    """
    q, packed, cu_seqlens, batch = to_packed(
        "q", q, 3, cu_seqlens, {"k": (k, 3), "v": (v, 3), "g": (g, 2), "beta": (beta, 2)}
    )
    check_gdn(q, packed["k"], packed["v"], packed["g"], packed["beta"], cu_seqlens, initial_state)
    if save_mode not in SAVE_MODES:
        raise ValueError(f"save_mode must be one of {SAVE_MODES}, got {save_mode!r}")
    if recompute_output not in RECOMPUTE_OUTPUT:
        raise ValueError(f"recompute_output must be one of {RECOMPUTE_OUTPUT}, got {recompute_output!r}")
    if graph not in GRAPH:
        raise ValueError(f"graph must be one of {GRAPH}, got {graph!r}")
    if reuse_recompute_tapes is None:
        reuse_recompute_tapes = False if graph == "replay" else "auto"
    elif not (reuse_recompute_tapes is True or reuse_recompute_tapes is False or reuse_recompute_tapes == "auto"):
        raise ValueError(f"reuse_recompute_tapes must be one of {REUSE_RECOMPUTE_TAPES}, got {reuse_recompute_tapes!r}")
    elif graph == "replay" and reuse_recompute_tapes is not False:
        raise ValueError(f"reuse_recompute_tapes={reuse_recompute_tapes!r} cannot be used with graph='replay' (a "
                         "replayed recompute's tapes live in its graph's static pool): pass False or leave it unset")
    elif save_mode == "full" and reuse_recompute_tapes is False:
        raise ValueError("reuse_recompute_tapes=False contradicts save_mode='full' (which keeps the tapes of every "
                         "forward that launches, a checkpoint recompute's too): pass 'auto', True, or leave it unset")
    if scale is None:
        scale = default_scale(q.shape[-1])
    else:
        check_scale(scale)
    args = (q, packed["k"], packed["v"], packed["g"], packed["beta"], cu_seqlens, initial_state, float(scale),
            use_qk_l2norm, deterministic, graph == "replay")
    # A forward that autograd will not save for (no_grad, as reentrant checkpointing's first pass)
    # keeps no tapes in either mode.
    saves = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, packed["k"], packed["v"], packed["g"], packed["beta"],
                                                   initial_state))
    full, discarded, stand_in, keeper = save_mode == "full" and saves, False, False, None
    # Traced, there is no frame to read and no Python state to keep: `_call` is left alone (a
    # write to it inside a compiled checkpoint region is a side effect Dynamo refuses).
    traced = torch.compiler.is_compiling()
    if not traced:
        def cuda():
            return _cuda_kernels(*args[:6], args[7])

        def peak():
            return _kept_tapes_peak(q, packed["v"], cu_seqlens, use_qk_l2norm, deterministic)

        # The light node saves q, k, v, g, beta, cu_seqlens and the initial state.
        base_saves = (7 if initial_state is not None else 6) if saves else 0
        full, discarded, stand_in, keeper, record = _checkpoint_plan(
            base_saves, save_mode == "full", recompute_output, reuse_recompute_tapes, graph == "replay", cuda, peak)
        _last_call.clear()
        _last_call.update(record)
    if keeper is not None:
        checkpointing.release_kept_tapes(keeper)
    if not traced:
        _call.discarded, _call.stand_in = discarded, stand_in
    try:
        if full:
            o, final_state, tapes = torch.ops.cake.gdn_fwd_full(*args)
            if keeper is not None:
                checkpointing.record_kept_tapes(keeper, tapes)
        else:
            o, final_state = torch.ops.cake.gdn_fwd(*args)
    finally:
        if not traced:
            _call.discarded = _call.stand_in = False
    if batch is not None:
        o = o.unflatten(0, batch)
    return o, (final_state if output_final_state else None)

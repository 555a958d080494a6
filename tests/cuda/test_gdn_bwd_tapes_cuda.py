"""The CUDA recompute of the GDN backward (``torch.ops.cake_cuda.gdn_bwd_tapes``, csrc/gdn/:
the forward's plan, prep, summaries and chain, then the walk in tape mode) on
the GPU, against the PyTorch chunked backward's forward walk (``cake_ops.pytorch.gdn``
``prepare`` + ``walk_tapes``, fp32): the h tape (S^T at each chunk's start) on the used
chunk slots (the backward forms v_new again from it; no tape of v_new), a = A and
chunk_beta (bitwise the forward prep's), gcum, qk_lrn and chunk_offsets; under NaN-poisoned
allocation (the workspace's bytes are 0xff: NaN in bf16 and fp32), so an unwritten
element shows. Plus cut grids (exact and truncated cuts), the value split (bitwise),
bitwise repeatability and T = 0. Every test is marked ``gpu`` and skipped without a GPU.

The tolerance is the contract's (``accuracy(...).ok``); expected rel-RMS is ~1e-3..4e-3:
the tapes are bf16 and the walk's products take bf16 operands.
"""

import pytest
import torch

from cake_ops.pytorch import gdn as pytorch_gdn
from cake_ops.testing import accuracy, poisoned_allocations
from cake_ops.varlen import to_chunks

from cases import GdnCase
from conftest import kernel_ops, record_accuracy

pytestmark = pytest.mark.gpu

C = 64
SCALE = 128**-0.5
DOCS = (0, 1, 63, 64, 65, 200)  # empty, single token, ragged, exact, one over, several chunks

CASES = [
    GdnCase("docs_g1", DOCS),
    GdnCase("docs_g1_l2_h0", DOCS, l2norm=True, initial_state=True),
    GdnCase("docs_h2_g2_bf16beta_h0", DOCS, H=2, G=2, beta_dtype=torch.bfloat16, initial_state=True,
            cu_dtype=torch.int64),
    GdnCase("docs_g3_strong_extreme_l2_h0", DOCS, G=3, gate="strong", beta="extreme", l2norm=True, initial_state=True),
    GdnCase("docs_h2_g3_slow_l2", DOCS, H=2, G=3, gate="slow", l2norm=True),
    GdnCase("edges_g2_extreme_l2_h0", (0, 65, 0, 1, 64, 63, 0), G=2, beta="extreme", l2norm=True, initial_state=True),
    GdnCase("long_doc_l2_h0", (700,), l2norm=True, initial_state=True),
]

# Documents of several chunks, cut at small grids: truncated cuts (normal and strong
# gates: a chunk's log decay is far below -20) and exact ones (the slow gate).
SEGMENT_CASES = [
    GdnCase("seg_h2_l2_h0", (1, 63, 64, 65, 200, 700), H=2, l2norm=True, initial_state=True),
    GdnCase("seg_g3_strong_extreme_l2_h0", (130, 0, 450), G=3, gate="strong", beta="extreme", l2norm=True,
            initial_state=True, cu_dtype=torch.int64),
    GdnCase("seg_h2_g2_slow_bf16beta_h0", (520, 3, 260), H=2, G=2, gate="slow", beta_dtype=torch.bfloat16,
            initial_state=True),
]


@pytest.fixture(scope="module")
def ops():
    return kernel_ops()


def _call(ops, inp, l2, deterministic=True, segment_chunks=-1, value_splits=-1):
    return ops.gdn_bwd_tapes(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"], inp["initial_state"],
        SCALE, l2, deterministic, segment_chunks, value_splits,
    )


def _used(lengths):
    return sum(-(-n // C) for n in lengths)


def _reference(inp, l2):
    """The PyTorch prep and its forward walk's tapes (fp32); do does not enter h."""
    q, k, v, g, beta, cu = (inp[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens"))
    prep, rstd = pytorch_gdn.prepare(q, k, v, g, beta, cu, l2)
    tapes = pytorch_gdn.walk_tapes(prep, torch.zeros_like(v), None, inp["initial_state"], SCALE)
    return prep, rstd, tapes


def _check_against_reference(out, inp, l2, lengths, label):
    """Every returned tape against the PyTorch path; unwritten (NaN) elements fail."""
    h, a, chunk_beta, gcum, qk_lrn, chunk_offsets = out
    prep, rstd, tapes = _reference(inp, l2)
    T, HV = inp["v"].shape[:2]
    H = inp["q"].shape[1]
    N = len(lengths)
    NC = -(-T // C) + N
    used = _used(lengths)
    assert h.shape == (NC, HV, 128, 128) and h.dtype == torch.bfloat16
    assert a.shape == (NC, HV, C, C) and a.dtype == torch.bfloat16
    assert chunk_beta.shape == (NC, HV, C) and chunk_beta.dtype == torch.float32
    assert gcum.shape == (NC, HV, C) and gcum.dtype == torch.float32
    assert qk_lrn.shape == ((NC, H, 2, C) if l2 else (0,)) and qk_lrn.dtype == torch.float32
    assert chunk_offsets.shape == (N + 1,) and chunk_offsets.dtype == torch.int32

    chunks = torch.tensor([0] + [-(-n // C) for n in lengths]).cumsum(0).to(torch.int32)
    assert torch.equal(chunk_offsets.cpu(), chunks), f"{label}: chunk_offsets"
    for name, x in (("h", h), ("a", a), ("chunk_beta", chunk_beta), ("gcum", gcum)):
        assert torch.isfinite(x[:used].float()).all(), f"{label}: {name} has unwritten (NaN) elements"

    real = prep.layout.token[:used] < T  # [used, C]: the slot's token rows inside its document
    failures = []
    checks = (
        ("h", h[:used].float(), tapes.h[:used].transpose(-1, -2)),
        ("a", a[:used].float(), prep.A[:used]),
    )
    for name, x, ref in checks:
        acc = accuracy(x, ref)
        record_accuracy(f"cuda gdn_bwd_tapes {name}", acc)
        if not acc.ok:
            failures.append(f"{name}: {acc}")
    assert not failures, f"{label}: " + "; ".join(failures)
    acc_g = accuracy(gcum[:used], prep.gcum[:used])
    assert acc_g.finite and acc_g.rel_rms < 1e-5, f"{label}: gcum: {acc_g}"
    assert torch.equal(chunk_beta[:used], prep.beta[:used]), f"{label}: chunk_beta"
    if l2:
        _, rq, _, rk = rstd  # 1 / |x| per row, [T, H, 1]
        for i, r in enumerate((rq, rk)):
            ref = to_chunks(torch.log2(r), prep.layout)[:used, :, :, 0]  # [used, H, C]
            x = qk_lrn[:used, :, i]
            rows = real[:, None, :].expand_as(x)
            assert torch.isfinite(x[rows]).all(), f"{label}: qk_lrn {'qk'[i]} unwritten"
            assert (x[rows] - ref[rows]).abs().max() < 1e-4, f"{label}: qk_lrn {'qk'[i]}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tapes_match_pytorch(ops, case):
    inp = case.inputs("cuda", seed=1)
    with poisoned_allocations():
        out = _call(ops, inp, case.l2norm)
    _check_against_reference(out, inp, case.l2norm, case.lengths, case.id)


@pytest.mark.parametrize("case", CASES[:4], ids=[c.id for c in CASES[:4]])
def test_a_is_the_forward_preps(ops, case):
    """The backward's prep gives the forward prep's A, gcum and beta rows bit for bit: the
    tapes are those of the forward's own walk."""
    inp = case.inputs("cuda", seed=2)
    _, a, beta, gcum, _, _ = _call(ops, inp, case.l2norm)
    a_fwd, gcum_fwd, beta_fwd, _ = ops.gdn_fwd_prep(inp["q"], inp["k"], inp["g"], inp["beta"], inp["cu_seqlens"],
                                                    case.l2norm)
    used = _used(case.lengths)
    assert torch.equal(a[:used], a_fwd[:used]) and torch.equal(gcum[:used], gcum_fwd[:used])
    assert torch.equal(beta[:used], beta_fwd[:used])


@pytest.mark.parametrize("segment_chunks", [1, 2, 3])
@pytest.mark.parametrize("case", SEGMENT_CASES, ids=[c.id for c in SEGMENT_CASES])
def test_cut_walk_tapes_match_pytorch(ops, case, segment_chunks):
    """The tape walk from the chained start states (summaries E_s and M_s, the fp32
    chain), cut every 1, 2, 3 chunks: truncated cuts (normal, strong gates) and exact
    ones (slow gate); every tape against the uncut PyTorch walk, NaN-poisoned."""
    inp = case.inputs("cuda", seed=20 + segment_chunks)
    with poisoned_allocations():
        out = _call(ops, inp, case.l2norm, segment_chunks=segment_chunks)
    _check_against_reference(out, inp, case.l2norm, case.lengths, f"{case.id} cut every {segment_chunks} chunks")


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=[c.id for c in SEGMENT_CASES])
def test_value_split_is_bitwise_the_unsplit_walk(ops, case):
    """Two CTAs per walk, a half of the value columns each, give the unsplit walk's tapes
    bit for bit, uncut and cut (the summaries split too)."""
    inp = case.inputs("cuda", seed=50)
    used = _used(case.lengths)
    for segment_chunks in (0, 2):
        results = []
        for value_splits in (1, 2):
            with poisoned_allocations():
                results.append(_call(ops, inp, case.l2norm, segment_chunks=segment_chunks, value_splits=value_splits))
        for name, x1, x2 in zip(("h", "a", "chunk_beta", "gcum"), results[0], results[1]):
            assert torch.equal(x1[:used], x2[:used]), f"{name}, cut every {segment_chunks} chunks"


def test_bitwise_deterministic(ops):
    case = GdnCase("det", (1, 63, 64, 65, 200, 700), H=2, G=3, l2norm=True, initial_state=True)
    inp = case.inputs("cuda", seed=5)
    used = _used(case.lengths)
    for segment_chunks in (-1, 2):
        out1 = _call(ops, inp, True, segment_chunks=segment_chunks)
        out2 = _call(ops, inp, True, segment_chunks=segment_chunks)
        for name, x1, x2 in zip(("h", "a", "chunk_beta", "gcum", "qk_lrn"), out1, out2):
            assert torch.equal(x1[:used], x2[:used]), f"{name}, segment_chunks {segment_chunks}"


def test_tapes_start_where_the_forward_ends(ops):
    """The h tape of a document's first chunk is its initial state (transposed, rounded to
    bf16) bit for bit, and the forward's final state of a one-chunk document follows from
    the tapes (the state update applied to the kernel's own h and A, with v_new formed
    from them as the chunk-local kernel forms it)."""
    case = GdnCase("starts", (64, 40, 64), G=2, l2norm=True, initial_state=True)
    inp = case.inputs("cuda", seed=6)
    h, a, chunk_beta, gcum, _, _ = _call(ops, inp, True)
    h0 = inp["initial_state"]  # [N, HV, K, V]
    assert torch.equal(h[:3], h0.transpose(-1, -2).to(torch.bfloat16))
    _, ht = ops.gdn_fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"], h0, SCALE, True, True)
    prep, _, _ = _reference(inp, True)
    gl = gcum[:3, :, -1:]
    k_dec = (gl - gcum[:3]).exp()[..., None] * prep.k[:3]  # e^(gl - gcum) k, [3, HV, C, K]
    S0 = h[:3].float().transpose(-1, -2)
    e = chunk_beta[:3, ..., None] * (prep.v[:3] - gcum[:3].exp()[..., None] * (prep.k[:3] @ S0))
    v_new = a[:3].float() @ e  # A diag(beta) (v - e^gcum k S)
    S = gl[..., None].exp() * S0 + k_dec.transpose(-1, -2) @ v_new
    assert accuracy(S, ht).ok


def test_no_tokens(ops):
    """T = 0: no chunk slot is used; chunk_offsets are zeros; the call succeeds."""
    case = GdnCase("none", (0, 0), G=2, initial_state=True)
    inp = case.inputs("cuda", seed=4)
    with poisoned_allocations():
        h, a, chunk_beta, gcum, qk_lrn, chunk_offsets = _call(ops, inp, False)
    assert h.shape == (2, 2, 128, 128) and qk_lrn.shape == (0,)
    assert torch.equal(chunk_offsets.cpu(), torch.zeros(3, dtype=torch.int32))


def test_argument_checks_are_the_forwards(ops):
    """gdn_bwd_tapes refuses what gdn_fwd refuses, naming itself."""
    inp = GdnCase("bad", (70, 10), G=2).inputs("cuda", seed=7)
    args = [inp[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")]
    with pytest.raises(RuntimeError, match="gdn_bwd_tapes: scale must be finite"):
        ops.gdn_bwd_tapes(*args, None, 0.0, False, True, -1, -1)
    with pytest.raises(RuntimeError, match="gdn_bwd_tapes: value_splits"):
        ops.gdn_bwd_tapes(*args, None, SCALE, False, True, -1, 3)
    with pytest.raises(RuntimeError, match="gdn_bwd_tapes: initial_state"):
        ops.gdn_bwd_tapes(*args, torch.zeros(2, 3, device="cuda"), SCALE, False, True, -1, -1)
    with pytest.raises(RuntimeError, match="gdn_bwd_tapes: q must be bfloat16"):
        ops.gdn_bwd_tapes(args[0].half(), *args[1:], None, SCALE, False, True, -1, -1)

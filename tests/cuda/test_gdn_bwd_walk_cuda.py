"""The CUDA reverse walk of the GDN backward (``torch.ops.cake_cuda.gdn_bwd_walk``, uncut:
csrc/gdn/bwd_chain.cu launching the forward walk's CTA in its reverse mode,
csrc/gdn/fwd_walk_reverse.cuh) on the GPU, against the PyTorch chunked backward's walk
(``cake_ops.pytorch.gdn.walk_tapes``, fp32) from the same prep (A, gcum, beta per row and
the log2 inverse row norms of ``pytorch_gdn.prepare``): the dS tape (transposed) on the
used chunk slots, dv_new ([T, HV, 128], dv's layout: every token's row), dh0; under
NaN-poisoned allocation, so an unwritten element shows. Plus bitwise repeatability, a
document alone = the same document packed with others (bitwise), and argument checks.
Every test but the CPU check of its setup is marked ``gpu`` and skipped without a GPU.
"""

import math

import pytest
import torch

from cake_ops.pytorch import gdn as pytorch_gdn
from cake_ops.testing import accuracy, poisoned_allocations
from cake_ops.varlen import from_chunks, to_chunks

from cases import GdnCase
from conftest import kernel_ops, record_accuracy

C = 64
EDGES = (0, 1, 63, 64, 65, 0)  # empty, single token, ragged, exact, one over; empty last
PACK = (37, 0, 129, 64, 3, 191, 1, 70)  # a "random" pack (fixed, so failures reproduce)

# (case, dht present). GdnCase.initial_state is unused here (the walk reads no state).
CASES = [
    (GdnCase("edges_g1", EDGES), True),
    (GdnCase("edges_g1_nodht", EDGES), False),
    (GdnCase("edges_g2_l2", EDGES, G=2, l2norm=True, cu_dtype=torch.int64), True),
    (GdnCase("edges_g3_strong_extreme", EDGES, G=3, gate="strong", beta="extreme"), True),
    (GdnCase("pack_h2_g1_l2", PACK, H=2, l2norm=True), True),
    (GdnCase("pack_h2_g2_nodht", PACK, H=2, G=2), False),
    (GdnCase("pack_g3_strong_extreme_l2", PACK, G=3, gate="strong", beta="extreme", l2norm=True), True),
    (GdnCase("pack_h2_g3_slow_l2_nodht", PACK, H=2, G=3, gate="slow", l2norm=True, cu_dtype=torch.int64), False),
    (GdnCase("long_doc_l2", (700,), l2norm=True), True),
    (GdnCase("long_doc_g2_strong", (700,), G=2, gate="strong"), True),
    (GdnCase("long_doc_g3_extreme_nodht", (700,), G=3, beta="extreme", l2norm=True), False),
]
IDS = [c.id for c, _ in CASES]


@pytest.fixture(scope="module")
def ops():
    return kernel_ops()


def walk_inputs(case: GdnCase, dht: bool, device="cuda", seed=0, scale=128**-0.5) -> dict:
    """The walk's inputs from the PyTorch prep, and its reference tapes (fp32)."""
    inp = case.inputs(device, seed)
    q, k, v, g, beta, cu = inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"]
    prep, rstd = pytorch_gdn.prepare(q, k, v, g, beta, cu, case.l2norm)
    lay = prep.layout
    T, HV = v.shape[:2]
    N = cu.numel() - 1
    gen = torch.Generator().manual_seed(case.seed + 7 + seed)
    do = torch.randn(T, HV, 128, generator=gen).to(torch.bfloat16).to(device)
    dht_t = (torch.randn(N, HV, 128, 128, generator=gen) * 0.5).to(device) if dht else None
    qk_lrn = None
    if case.l2norm:
        _, rq, _, rk = rstd  # [T, H, 1] inverse norms
        lrq = to_chunks(torch.log2(rq), lay)[..., 0]  # [NC, H, C] (pad rows: 0)
        lrk = to_chunks(torch.log2(rk), lay)[..., 0]
        qk_lrn = torch.stack([lrq, lrk], 2).contiguous()  # [NC, H, 2, C]
    nch = (cu[1:].long() - cu[:-1].long() + C - 1) // C
    chunk_offsets = torch.cat([nch.new_zeros(1), nch.cumsum(0)]).to(torch.int32)
    tapes = pytorch_gdn.walk_tapes(prep, do, dht_t, None, scale)
    return dict(
        q=q, k=k, do=do, a=prep.A.to(torch.bfloat16).contiguous(),
        gcum=prep.gcum.contiguous(), chunk_beta=prep.beta.contiguous(), qk_lrn=qk_lrn, dht=dht_t, chunk_offsets=chunk_offsets, cu_seqlens=cu,
        HV=HV, scale=scale, layout=lay, tapes=tapes, used=int(nch.sum()),
    )


def call(ops, w: dict, value_splits=-1):
    return ops.gdn_bwd_walk(
        w["q"], w["k"], w["do"], w["a"], w["gcum"], w["chunk_beta"], w["qk_lrn"], w["dht"], w["chunk_offsets"],
        w["cu_seqlens"],
        w["HV"], w["scale"], value_splits,
    )


def test_walk_inputs_cpu():
    """The test's own setup (prep, norms, slot grid, reference) on the CPU: shapes and the
    reference's invariants, so that a GPU failure is the kernel's."""
    case = GdnCase("edges_g2_l2", EDGES, G=2, l2norm=True)
    w = walk_inputs(case, True, device="cpu")
    NC = w["a"].shape[0]
    T = sum(EDGES)
    assert NC == -(-T // C) + len(EDGES)
    assert w["qk_lrn"].shape == (NC, 1, 2, C) and w["gcum"].shape == (NC, 2, C)
    assert w["chunk_offsets"].tolist() == [0, 0, 1, 2, 3, 5, 5]
    assert w["used"] == 5 and torch.isfinite(w["qk_lrn"]).all()
    t = w["tapes"]
    assert t.dS_end.shape == (NC, 2, 128, 128) and t.dv_new.shape == (NC, 2, C, 128)
    # Empty documents: dh0 = dht.
    assert torch.equal(t.dh0[0], w["dht"][0]) and torch.equal(t.dh0[5], w["dht"][5])


def check_against_reference(out, w, label):
    dS, dv_new, dh0 = out
    lay, t, used = w["layout"], w["tapes"], w["used"]
    NC, HV = w["a"].shape[:2]
    N = w["cu_seqlens"].numel() - 1
    assert dS.shape == (NC, HV, 128, 128) and dS.dtype == torch.bfloat16
    assert dv_new.shape == w["do"].shape and dv_new.dtype == torch.bfloat16
    assert dh0.shape == (N, HV, 128, 128) and dh0.dtype == torch.float32
    failures = []
    checks = (
        ("dS tape", dS[:used].float(), t.dS_end[:used].transpose(-1, -2)),
        ("dv_new", dv_new.float(), from_chunks(t.dv_new, lay)),
        ("dh0", dh0, t.dh0),
    )
    for name, x, ref in checks:
        acc = accuracy(x, ref)
        record_accuracy(f"cuda bwd walk {name}", acc)
        if not acc.ok:
            failures.append(f"{name}: {acc}")
    assert not failures, f"{label}: " + "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2], ids=["whole", "split"])
@pytest.mark.parametrize("case,dht", CASES, ids=IDS)
def test_bwd_walk_matches_pytorch(ops, case, dht, splits):
    """Each walk on one CTA (both state warpgroups) and split by value columns over two."""
    w = walk_inputs(case, dht)
    with poisoned_allocations():
        out = call(ops, w, splits)
    check_against_reference(out, w, f"{case.id}, value_splits={splits}")


@pytest.mark.gpu
def test_bwd_walk_value_splits_same_bits(ops):
    """Value columns never mix: a column's result is the same instructions on either CTA."""
    case = GdnCase("pack_h2_g3_slow_l2", PACK, H=2, G=3, gate="slow", l2norm=True)
    w = walk_inputs(case, True)
    used = w["used"]
    whole, split = call(ops, w, 1), call(ops, w, 2)
    assert torch.equal(whole[0][:used], split[0][:used])
    assert torch.equal(whole[1], split[1]) and torch.equal(whole[2], split[2])


@pytest.mark.gpu
def test_bwd_walk_scale(ops):
    """A scale other than K^-0.5 (it enters P and the output's state term)."""
    case = GdnCase("pack_scale", PACK, H=2, G=2, l2norm=True)
    w = walk_inputs(case, True, scale=0.37)
    with poisoned_allocations():
        out = call(ops, w)
    check_against_reference(out, w, case.id)


@pytest.mark.gpu
def test_bwd_walk_empty_documents_only(ops):
    """T = 0: every CTA writes dh0 = dht (and zeros without dht), no tape."""
    q = torch.zeros(0, 1, 128, dtype=torch.bfloat16, device="cuda")
    do = torch.zeros(0, 2, 128, dtype=torch.bfloat16, device="cuda")
    NC = 3
    a = torch.zeros(NC, 2, C, C, dtype=torch.bfloat16, device="cuda")
    gcum = torch.zeros(NC, 2, C, device="cuda")
    cu = torch.zeros(4, dtype=torch.int32, device="cuda")
    offs = torch.zeros(4, dtype=torch.int32, device="cuda")
    dht = torch.randn(3, 2, 128, 128, device="cuda")
    with poisoned_allocations():
        _, _, dh0 = ops.gdn_bwd_walk(q, q, do, a, gcum, gcum, None, dht, offs, cu, 2, 0.1)
        _, _, dh0_zero = ops.gdn_bwd_walk(q, q, do, a, gcum, gcum, None, None, offs, cu, 2, 0.1)
    assert torch.equal(dh0, dht)
    assert torch.equal(dh0_zero, torch.zeros_like(dh0_zero))


@pytest.mark.gpu
def test_bwd_walk_bitwise_repeatable(ops):
    case = GdnCase("pack_g3_strong_extreme_l2", PACK, G=3, gate="strong", beta="extreme", l2norm=True)
    w = walk_inputs(case, True)
    used = w["used"]
    first = call(ops, w)
    for _ in range(3):
        again = call(ops, w)
        assert torch.equal(first[0][:used], again[0][:used])
        assert torch.equal(first[1], again[1])
        assert torch.equal(first[2], again[2])


@pytest.mark.gpu
@pytest.mark.parametrize("l2norm", [False, True])
def test_bwd_walk_alone_equals_packed(ops, l2norm):
    """A document walked alone (its rows, its slots of the same prep tensors) gives the
    bits it gets packed between others."""
    case = GdnCase("pack_alone", PACK, H=2, G=2, l2norm=l2norm)
    w = walk_inputs(case, True)
    packed = call(ops, w)
    cu = w["cu_seqlens"].long().tolist()
    offs = w["chunk_offsets"].tolist()
    for n in range(len(cu) - 1):
        t0, t1, s0, s1 = cu[n], cu[n + 1], offs[n], offs[n + 1]
        if t1 == t0:
            continue
        nch = s1 - s0

        def slots(x):  # the document's slots, then one spare (NC = ceil(L / 64) + 1)
            return torch.cat([x[s0:s1], torch.zeros_like(x[:1])]).contiguous()

        alone = dict(w)
        alone.update(
            q=w["q"][t0:t1].contiguous(), k=w["k"][t0:t1].contiguous(), do=w["do"][t0:t1].contiguous(),
            a=slots(w["a"]), gcum=slots(w["gcum"]), chunk_beta=slots(w["chunk_beta"]),
            qk_lrn=slots(w["qk_lrn"]) if l2norm else None,
            dht=w["dht"][n : n + 1].contiguous(),
            chunk_offsets=torch.tensor([0, nch], dtype=torch.int32, device="cuda"),
            cu_seqlens=torch.tensor([0, t1 - t0], dtype=w["cu_seqlens"].dtype, device="cuda"),
        )
        dS, dv, dh0 = call(ops, alone)
        assert torch.equal(dS[:nch], packed[0][s0:s1]), f"document {n}: dS tape"
        assert torch.equal(dv, packed[1][t0:t1]), f"document {n}: dv_new"
        assert torch.equal(dh0[0], packed[2][n]), f"document {n}: dh0"


@pytest.mark.gpu
def test_bwd_walk_rejects_bad_arguments(ops):
    case = GdnCase("edges_g2", EDGES, G=2)
    w = walk_inputs(case, True)

    def bad(**kw):
        x = dict(w)
        x.update(kw)
        with pytest.raises(RuntimeError, match=kw.pop("match")):
            call(ops, x)

    bad(a=w["a"].float(), match="a must be bfloat16")
    bad(a=w["a"][:1], match="a: NC")
    bad(gcum=w["gcum"][..., :32], match="gcum must be")
    bad(chunk_beta=w["chunk_beta"][..., :32], match="chunk_beta must be")
    bad(do=w["do"][:, :1], match="do must be")
    bad(dht=w["dht"][:1], match="dht must be")
    bad(qk_lrn=torch.zeros(w["a"].shape[0], 1, 2, 32, device="cuda"), match="qk_lrn must be")
    bad(chunk_offsets=w["chunk_offsets"].long(), match="chunk_offsets must be int32")
    bad(HV=3, match="do must be")
    bad(scale=math.inf, match="scale must be finite")
    bad(q=w["q"].float(), match="q must be bfloat16")
    with pytest.raises(RuntimeError, match="value_splits must be"):
        call(ops, w, 3)

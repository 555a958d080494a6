"""The CUDA chunk-local gradients of the GDN backward (``torch.ops.cake_cuda.gdn_bwd_local``,
csrc/gdn/bwd_local.cu) on the GPU.

The kernel's inputs are built by the PyTorch chunked path (``prepare`` and ``walk_tapes``,
rounded to the kernel's bf16 layouts: S^T and dS^T tapes, A without beta), and its five
gradients are checked under NaN-poisoned allocation against ``local_gradients`` on the
same rounded tapes, with v_new formed from the rounded S tape as the kernel forms it
(dg zeroed below the gate floor, as ``gdn_bwd`` does). Plus bitwise
repeatability and a document's bits alone and packed with others. Every test is marked
``gpu`` and skipped without a Hopper GPU.
"""

import math

import pytest
import torch

from cake_ops.pytorch import gdn as pytorch_gdn
from cake_ops.testing import accuracy, poisoned_allocations
from cake_ops.varlen import from_chunks

from cases import GdnCase, params
from conftest import kernel_ops, record_accuracy

pytestmark = pytest.mark.gpu

SCALE = 128**-0.5
DOCS = (1, 63, 64, 65, 200)
C = pytorch_gdn.CHUNK

CASES = [
    GdnCase("one_chunk", (64,)),
    GdnCase("ragged_chunk_l2", (37,), l2norm=True),
    GdnCase("docs_h1", DOCS),
    GdnCase("docs_with_empty_h1", (0, 1, 63, 0, 64, 65)),
    GdnCase("docs_h2_l2_h0", DOCS, H=2, l2norm=True, initial_state=True, cu_dtype=torch.int64),
    GdnCase("docs_gva2_bf16beta_h0", DOCS, H=2, G=2, beta_dtype=torch.bfloat16, initial_state=True),
    GdnCase("docs_gva3_strong_extreme_l2_h0", DOCS, G=3, gate="strong", beta="extreme", l2norm=True, initial_state=True),
    GdnCase("docs_h2_gva3_strong_bf16beta_l2", DOCS, H=2, G=3, gate="strong", beta_dtype=torch.bfloat16, l2norm=True,
            cu_dtype=torch.int64),
    GdnCase("docs_h2_gva2_slow_extreme_h0", DOCS, H=2, G=2, gate="slow", beta="extreme", initial_state=True),
    GdnCase("empty_docs", (0, 70, 0, 3, 0), G=2, beta="extreme", l2norm=True, initial_state=True),
    GdnCase("random_pack_h2_gva2_l2", (5, 129, 17, 300, 64, 1, 91, 128, 33), H=2, G=2, l2norm=True, initial_state=True),
    GdnCase("random_pack_h1_gva3", (190, 7, 256, 2, 70), G=3, gate="strong", beta="extreme"),
]


@pytest.fixture(scope="module")
def ops():
    return kernel_ops()


def _bf(x):
    return x.to(torch.bfloat16).contiguous()


def _setup(case: GdnCase, *, dht: bool, seed: int = 0, floor_tokens: bool = False):
    """The kernel's arguments and the reference gradients for one case."""
    inp = case.inputs("cuda", seed)
    q, k, v, g, beta, cu = inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"]
    if floor_tokens and g.shape[0] > 0:  # a few tokens below the gate floor (g = -inf is a reset)
        g = g.clone()
        g[:: max(1, g.shape[0] // 5)] = -float("inf")
        g[3 :: max(1, g.shape[0] // 4)] = -200.0
    T, HV = v.shape[0], v.shape[1]
    N = cu.numel() - 1
    gen = torch.Generator().manual_seed(case.seed + 7919 * seed + 1)
    do = torch.randn(T, HV, 128, generator=gen).to(torch.bfloat16).cuda()
    dht_t = (torch.randn(N, HV, 128, 128, generator=gen) * 0.5).cuda() if dht else None
    prep, rstd = pytorch_gdn.prepare(q, k, v, g, beta, cu, case.l2norm)
    tapes = pytorch_gdn.walk_tapes(prep, do, dht_t, inp["initial_state"], SCALE)
    lens = (cu[1:] - cu[:-1]).long()
    chunk_offsets = torch.cat([lens.new_zeros(1), torch.cumsum((lens + C - 1) // C, 0)]).to(torch.int32)
    args = dict(
        q=q, k=k, v=v, do=do, g=g, beta=beta,
        gcum=prep.gcum.contiguous(),
        A=_bf(prep.A),
        h=_bf(tapes.h.transpose(-1, -2)),
        dS=_bf(tapes.dS_end.transpose(-1, -2)),
        dv_new=_bf(from_chunks(tapes.dv_new, prep.layout)),  # [T, HV, 128], dv's layout
        initial_state=inp["initial_state"],
        dht=dht_t,
        chunk_offsets=chunk_offsets,
        cu_seqlens=cu,
        l2=case.l2norm,
    )
    # The reference on what the kernel reads: the tapes and A rounded to bf16, except a
    # document's first state and last state gradient, which it reads in fp32 for dg's term
    # e^gl <dS_end, S> (its products take them in bf16: within the contract's tolerance).
    r = lambda x: x.to(torch.bfloat16).float()
    lay = prep.layout
    h_r = torch.where(lay.first[:, None, None, None], tapes.h, r(tapes.h))
    dS_r = torch.where(lay.last[:, None, None, None], tapes.dS_end, r(tapes.dS_end))
    # v_new = A diag(beta) (v - e^gcum k S) from the bf16 S tape, as the kernel forms it
    # (its operand and result are bf16 there: within the contract's tolerance).
    e = prep.beta[..., None] * (prep.v - prep.gcum.exp()[..., None] * (prep.k @ r(tapes.h)))
    tapes_r = tapes._replace(h=h_r, v_new=r(prep.A) @ e, dS_end=dS_r, dv_new=r(tapes.dv_new))
    prep_r = prep._replace(A=r(prep.A))
    dq, dk, dv, dg, dbeta = pytorch_gdn.local_gradients(prep_r, rstd, tapes_r, do, SCALE, case.G)
    dg = torch.where(g < pytorch_gdn.GATE_FLOOR, 0.0, dg)
    return args, dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta)


def _call(ops, a):
    return ops.gdn_bwd_local(
        a["q"], a["k"], a["v"], a["do"], a["g"], a["beta"], a["gcum"], a["A"], a["h"], a["dS"],
        a["dv_new"], a["initial_state"], a["dht"], a["chunk_offsets"], a["cu_seqlens"], SCALE, a["l2"],
    )


NAMES = ("dq", "dk", "dv", "dg", "dbeta")


def _check(out, ref, record_as):
    failures = []
    for name, x in zip(NAMES, out):
        acc = accuracy(x.float(), ref[name])
        record_accuracy(f"bwd_local {name}", acc)
        if not acc.ok:
            failures.append(f"{name}: {acc}")
    assert not failures, f"{record_as}: " + "; ".join(failures)


@pytest.mark.parametrize("dht", [False, True], ids=["no_dht", "dht"])
@pytest.mark.parametrize("case", params(CASES))
def test_matches_pytorch_local_gradients(ops, case, dht):
    args, ref = _setup(case, dht=dht)
    with poisoned_allocations():
        out = _call(ops, args)
    torch.cuda.synchronize()
    T, H, HV = args["q"].shape[0], args["q"].shape[1], args["v"].shape[1]
    assert out[0].shape == (T, H, 128) and out[0].dtype == torch.bfloat16
    assert out[1].shape == (T, H, 128) and out[1].dtype == torch.bfloat16
    assert out[2].shape == (T, HV, 128) and out[2].dtype == torch.bfloat16
    assert out[3].shape == (T, HV) and out[3].dtype == torch.float32
    assert out[4].shape == (T, HV) and out[4].dtype == args["beta"].dtype
    _check(out, ref, case.id)


@pytest.mark.parametrize("l2", [False, True], ids=["unit_keys", "l2norm"])
def test_gates_below_floor(ops, l2):
    """Tokens with g = -inf or g < -128: dg is 0 there, everything stays finite."""
    case = GdnCase(f"floor_{l2}", DOCS, H=2, G=2, l2norm=l2, initial_state=True)
    args, ref = _setup(case, dht=True, floor_tokens=True)
    with poisoned_allocations():
        out = _call(ops, args)
    below = args["g"] < pytorch_gdn.GATE_FLOOR
    assert below.any()
    assert bool((out[3][below] == 0).all())
    _check(out, ref, case.id)


def test_bitwise_repeatable(ops):
    case = GdnCase("repeat", (5, 129, 17, 300, 64), H=2, G=3, l2norm=True, initial_state=True)
    args, _ = _setup(case, dht=True)
    a = _call(ops, args)
    b = _call(ops, args)
    for name, x, y in zip(NAMES, a, b):
        assert torch.equal(x, y), name


def test_many_waves_back_to_back(ops):
    """A grid of many CTAs an SM in turn (2080 CTAs), called back to back without a sync,
    so that CTAs start on shared memory earlier ones left (the loads' barrier word among
    it): every call bitwise equal to the first, that one within the contract. (It passed
    on 4f57bde's parent too, whose barrier could be waited on before thread 0 initialised
    it: that race faulted only in the benchmark's forward+backward timing loop.)"""
    case = GdnCase("many_waves", (4096,) * 4, H=8, G=2, l2norm=True)
    args, ref = _setup(case, dht=False)
    with poisoned_allocations():
        outs = [_call(ops, args) for _ in range(4)]
    torch.cuda.synchronize()
    _check(outs[0], ref, case.id)
    for out in outs[1:]:
        for name, x, y in zip(NAMES, out, outs[0]):
            assert torch.equal(x, y), name


def test_packed_vs_alone(ops):
    """A document's gradients are bitwise the same alone and packed between others: the
    alone call gets the packed call's inputs for that document's tokens and chunk slots."""
    lengths = (70, 129, 1, 64)
    case = GdnCase("packed_alone", lengths, H=2, G=2, l2norm=True, initial_state=True)
    args, _ = _setup(case, dht=True)
    packed = _call(ops, args)
    cu = args["cu_seqlens"].tolist()
    co = args["chunk_offsets"].tolist()
    for n in range(len(lengths)):
        t0, t1, s0, s1 = cu[n], cu[n + 1], co[n], co[n + 1]
        T1 = t1 - t0
        NC1 = math.ceil(T1 / C) + 1
        alone = {}
        for name in ("q", "k", "v", "do", "g", "beta", "dv_new"):
            alone[name] = args[name][t0:t1].contiguous()
        for name in ("gcum", "A", "h", "dS"):
            x = args[name]
            pad = x[s0:s1]
            # The alone call's grid has NC1 >= s1 - s0 slots; the extra ones are unused.
            alone[name] = torch.cat([pad, x.new_zeros((NC1 - (s1 - s0),) + tuple(x.shape[1:]))]).contiguous()
        alone["initial_state"] = args["initial_state"][n : n + 1].contiguous()
        alone["dht"] = args["dht"][n : n + 1].contiguous()
        alone["chunk_offsets"] = torch.tensor([0, s1 - s0], dtype=torch.int32, device="cuda")
        alone["cu_seqlens"] = torch.tensor([0, T1], dtype=args["cu_seqlens"].dtype, device="cuda")
        alone["l2"] = args["l2"]
        with poisoned_allocations():
            out = _call(ops, alone)
        for name, x, y in zip(NAMES, out, packed):
            assert torch.equal(x, y[t0:t1]), f"document {n}: {name}"


def test_rejects_bad_arguments(ops):
    case = GdnCase("bad", (64,))
    args, _ = _setup(case, dht=False)
    bad = dict(args, A=args["A"].float())
    with pytest.raises(RuntimeError, match="A must be"):
        _call(ops, bad)
    bad = dict(args, h=args["h"][:, :, :64].contiguous())
    with pytest.raises(RuntimeError, match="h must be"):
        _call(ops, bad)

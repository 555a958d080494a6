"""The FP64 reference itself (cake_ops.reference.gdn_reference): its gradients, the
recurrence's adjoint walked back token by token from checkpoints, against autograd through
the plain token loop, on packs with empty, one-token and block-crossing documents, GVA,
raw and normalised keys, initial states and full resets (g = -inf)."""

import pytest
import torch

from cake_ops.reference import _BLOCK, gdn_reference, l2norm


def loop_reference(q, k, v, g, beta, bounds, scale, initial_state, use_qk_l2norm):
    """The recurrence as a plain loop of autograd ops (what the reference's own backward
    must agree with): o, final states."""
    HV = v.shape[1]
    G = HV // q.shape[1]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q, k = q.repeat_interleave(G, dim=1), k.repeat_interleave(G, dim=1)
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        S = initial_state[n] if initial_state is not None else q.new_zeros(HV, q.shape[2], v.shape[2])
        for t in range(bounds[n], bounds[n + 1]):
            S = S * g[t].exp()[:, None, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
            S = S + k[t][:, :, None] * u[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, q[t]) * scale)
        finals.append(S)
    return torch.stack(outs), torch.stack(finals)


@pytest.mark.parametrize(
    "lengths, H, G, K, V, l2, h0, resets",
    [
        ((5, 0, 70, 2 * _BLOCK + 1), 2, 2, 16, 8, True, True, False),
        ((1, _BLOCK, _BLOCK + 1, 0), 1, 3, 8, 8, False, True, True),
        ((3 * _BLOCK,), 1, 1, 4, 12, False, False, False),
    ],
    ids=["pack_gva2_l2_h0", "block_edges_gva3_resets", "one_doc_no_h0"],
)
def test_gradients_are_autograd_through_the_loop(lengths, H, G, K, V, l2, h0, resets):
    gen = torch.Generator().manual_seed(len(lengths) * 31 + K)
    T, HV, N = sum(lengths), H * G, len(lengths)
    bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    k = randn(T, H, K)
    g = -torch.rand(T, HV, generator=gen, dtype=torch.float64) * 2
    if resets:
        g[[0, _BLOCK - 1, _BLOCK + 1]] = float("-inf")
    inputs = [randn(T, H, K), k if l2 else torch.nn.functional.normalize(k, dim=-1), randn(T, HV, V), g,
              torch.rand(T, HV, generator=gen, dtype=torch.float64)]
    h = randn(N, HV, K, V) if h0 else None
    do, dht = randn(T, HV, V), randn(N, HV, K, V)
    got, want = [], []
    for fn, out in ((gdn_reference, got), (loop_reference, want)):
        leaves = [x.clone().requires_grad_() for x in inputs + ([h] if h0 else [])]
        args = (*leaves[:5], torch.tensor(bounds)) if fn is gdn_reference else (*leaves[:5], bounds)
        kw = dict(scale=0.3, initial_state=leaves[5] if h0 else None, use_qk_l2norm=l2)
        o, ht = fn(*args, **kw) if fn is gdn_reference else fn(*args, kw["scale"], kw["initial_state"], l2)
        torch.autograd.backward([o, ht], [do, dht])
        out += [o.detach(), ht.detach()] + [x.grad for x in leaves]
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta"] + (["dh0"] if h0 else [])
    for name, a, b in zip(names, got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * b.abs().max().item(), msg=name)


def test_cu_seqlens_must_cover_the_tokens():
    x = torch.zeros(4, 1, 4, dtype=torch.float64)
    g = torch.zeros(4, 1, dtype=torch.float64)
    for bad in ([0, 3], [1, 4], [0, 3, 2, 4]):
        with pytest.raises(ValueError, match="cu_seqlens must run from 0 to T"):
            gdn_reference(x, x, x, g, g, torch.tensor(bad))


def test_no_documents():
    x = torch.zeros(0, 1, 4, dtype=torch.float64, requires_grad=True)
    g = torch.zeros(0, 1, dtype=torch.float64, requires_grad=True)
    h = torch.zeros(0, 1, 4, 4, dtype=torch.float64, requires_grad=True)
    o, ht = gdn_reference(x, x, x, g, g, torch.tensor([0]), initial_state=h)
    (o.sum() + ht.sum()).backward()
    assert o.shape == (0, 1, 4) and ht.shape == (0, 1, 4, 4) and h.grad.shape == (0, 1, 4, 4)

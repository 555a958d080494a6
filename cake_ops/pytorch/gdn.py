"""The chunked GDN algorithm (chunk C = 64, fp32) in plain PyTorch: forward and backward.

Device-agnostic implementation behind ``cake::gdn_fwd`` / ``cake::gdn_bwd`` wherever
no CUDA kernel takes a call (``cake_ops.dispatch``). Everything that does not depend on
the state is vectorised over chunks and heads; only the walk over chunk slots is a loop
(one step covers every head). Notation (docs/math.md, Chunked form), per chunk and value
head:

    gcum = chunk-local cumsum of g,  gl = gcum[-1],  D_ij = exp(gcum_i - gcum_j) (i >= j)
    A = (I + tril(beta_i D_ij k_i.k_j, -1))^-1,  w = A (beta e^gcum k),  u = A (beta v)
    v_new = u - w S,   S' = e^gl S + (e^(gl - gcum) k)^T v_new
    o = scale (e^gcum q) S + scale tril(q k^T * D) v_new

The backward recomputes the forward (nothing but the inputs is saved) and walks the
state gradient dS back over the chunks; the remaining gradients are then chunk-local
and vectorised again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..varlen import ChunkLayout, chunk_layout, from_chunks, to_chunks

CHUNK = 64  # csrc/gdn/gdn.h kGdnChunk (tests/cuda/test_kernel_code.py holds them equal)
L2NORM_EPS = 1e-6  # csrc/gdn/gdn.h kL2NormEps
# g = -inf is a full reset (e^g = 0), but inside a chunk's cumsum it would make
# gcum_i - gcum_j = -inf - (-inf) = NaN. g is clamped to this floor first (csrc/gdn/gdn.h
# kGdnGateFloor): e^-128 is 0 in fp32, so the clamped token resets the state exactly as
# e^-inf does, and chunk-local |gcum| <= 64 * 128 keeps its differences accurate. NaN
# stays NaN (torch.clamp propagates it).
GATE_FLOOR = -128.0


class Prepared(NamedTuple):
    """Per-chunk tensors that do not depend on the state. Shapes [NC, HV, C, ...]."""

    layout: ChunkLayout
    q: torch.Tensor  # normalised q, expanded to value heads, fp32 [NC, HV, C, K]
    k: torch.Tensor  # [NC, HV, C, K]
    v: torch.Tensor  # [NC, HV, C, V]
    beta: torch.Tensor  # [NC, HV, C]
    gcum: torch.Tensor  # [NC, HV, C]
    decay: torch.Tensor  # D, [NC, HV, C, C], zero above the diagonal
    kk: torch.Tensor  # k k^T, [NC, HV, C, C]
    qk: torch.Tensor  # q k^T, [NC, HV, C, C]
    A: torch.Tensor  # [NC, HV, C, C]
    w: torch.Tensor  # [NC, HV, C, K]
    u: torch.Tensor  # [NC, HV, C, V]
    k_decayed: torch.Tensor  # e^(gl - gcum) k, [NC, HV, C, K]


def _l2norm_fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rstd = torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
    return x * rstd, rstd


def _l2norm_bwd(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    return (dy - y * (dy * y).sum(-1, keepdim=True)) * rstd


def _per_value_head(x: torch.Tensor, G: int) -> torch.Tensor:
    """[NC, H, ...] -> [NC, H*G, ...]: value head hv reads q/k head hv // G."""
    return x if G == 1 else x.repeat_interleave(G, dim=1)


def _per_qk_head(x: torch.Tensor, G: int) -> torch.Tensor:
    """Sum a gradient over each GVA group, in a fixed order: [NC, H*G, ...] -> [NC, H, ...]."""
    return x if G == 1 else x.unflatten(1, (-1, G)).sum(2)


def prepare(q, k, v, g, beta, cu_seqlens, use_qk_l2norm) -> tuple[Prepared, tuple | None]:
    """The per-chunk tensors that do not depend on the state (the CUDA prep's outputs,
    gcum and A, among them), and the L2 norm's (q, 1/|q|, k, 1/|k|) when applied. With v
    None (the state gradient's walk alone, which never reads v) ``v`` and ``u`` are None."""
    T, H, K = q.shape
    HV = g.shape[1]
    G = HV // H
    layout = chunk_layout(cu_seqlens, T, CHUNK)
    qf, kf = q.float(), k.float()
    rstd = None
    if use_qk_l2norm:
        (qf, rq), (kf, rk) = _l2norm_fwd(qf), _l2norm_fwd(kf)
        rstd = (qf, rq, kf, rk)
    qc, kc = to_chunks(qf, layout), to_chunks(kf, layout)  # [NC, H, C, K]
    # K K^T and Q K^T are shared by the G value heads of a q/k head.
    kk = _per_value_head(kc @ kc.transpose(-1, -2), G)
    qk = _per_value_head(qc @ kc.transpose(-1, -2), G)
    qc, kc = _per_value_head(qc, G), _per_value_head(kc, G)
    vc = to_chunks(v.float(), layout) if v is not None else None
    bc = to_chunks(beta.float()[..., None], layout)[..., 0]  # [NC, HV, C]
    gcum = to_chunks(g.clamp(min=GATE_FLOOR)[..., None], layout)[..., 0].cumsum(-1)
    C = CHUNK
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # Mask the exponent before exp: above the diagonal gcum_i - gcum_j > 0 can overflow.
    decay = (gcum[..., :, None] - gcum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    L = (bc[..., :, None] * decay * kk).tril(-1)
    eye = torch.eye(C, device=q.device)
    A = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    w = A @ ((bc * gcum.exp())[..., None] * kc)
    u = A @ (bc[..., None] * vc) if v is not None else None
    k_decayed = (gcum[..., -1:] - gcum).exp()[..., None] * kc
    prep = Prepared(layout, qc, kc, vc, bc, gcum, decay, kk, qk, A, w, u, k_decayed)
    return prep, rstd


def _walk(prep: Prepared, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state walk over chunk slots. Returns (h [NC, HV, K, V] state at each chunk's
    start, v_new [NC, HV, C, V], final state [N, HV, K, V])."""
    lay = prep.layout
    NC, HV = prep.gcum.shape[:2]
    K, V = prep.w.shape[-1], prep.u.shape[-1]
    gamma = prep.gcum[..., -1].exp()[..., None, None]  # [NC, HV, 1, 1]
    h_start = h0[lay.doc]  # [NC, HV, K, V]: the state a slot starts from if it opens a document
    after = prep.u.new_empty(NC, HV, K, V)
    v_new = torch.empty_like(prep.u)
    S = prep.u.new_zeros(HV, K, V)
    for c in range(NC):
        S = torch.where(lay.first[c], h_start[c], S)
        v_new[c] = prep.u[c] - prep.w[c] @ S
        S = gamma[c] * S + prep.k_decayed[c].transpose(-1, -2) @ v_new[c]
        after[c] = S
    before = torch.cat([after.new_zeros(1, HV, K, V), after[:-1]])
    h = torch.where(lay.first[:, None, None, None], h_start, before)
    final = torch.where(lay.doc_nonempty[:, None, None, None], after[lay.doc_last_slot], h0)
    return h, v_new, final


def gdn_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    """Chunked forward. Shapes as ``cake::gdn_fwd``; returns (o [T, HV, V] in v's dtype,
    final_state [N, HV, K, V] fp32)."""
    N = cu_seqlens.shape[0] - 1
    HV, K, V = v.shape[1], q.shape[2], v.shape[2]
    prep, _ = prepare(q, k, v, g, beta, cu_seqlens, use_qk_l2norm)
    h0 = initial_state.float() if initial_state is not None else q.new_zeros(N, HV, K, V, dtype=torch.float32)
    h, v_new, final = _walk(prep, h0)
    inter = (prep.gcum.exp()[..., None] * prep.q) @ h
    intra = (prep.qk * prep.decay) @ v_new
    o = from_chunks(scale * (inter + intra), prep.layout)
    return o.to(v.dtype).contiguous(), final.contiguous()


def gdn_fwd_final_state(q, k, v, g, beta, cu_seqlens, initial_state, use_qk_l2norm):
    """The final states alone (``cake::gdn_fwd_final_state``): [N, HV, K, V] fp32,
    bitwise ``gdn_fwd``'s (the same walk, without the output)."""
    N = cu_seqlens.shape[0] - 1
    HV, K, V = v.shape[1], q.shape[2], v.shape[2]
    prep, _ = prepare(q, k, v, g, beta, cu_seqlens, use_qk_l2norm)
    h0 = initial_state.float() if initial_state is not None else q.new_zeros(N, HV, K, V, dtype=torch.float32)
    return _walk(prep, h0)[2].contiguous()


class Tapes(NamedTuple):
    """What the backward's two walks leave per chunk slot and value head (fp32)."""

    h: torch.Tensor  # [NC, HV, K, V] the state at the chunk's start
    v_new: torch.Tensor  # [NC, HV, C, V]
    dS_end: torch.Tensor  # [NC, HV, K, V] the gradient of the state at the chunk's end
    dv_new: torch.Tensor  # [NC, HV, C, V] the gradient of v_new
    dh0: torch.Tensor  # [N, HV, K, V] the gradient of the initial state


def reverse_step_terms(prep: Prepared, do, scale):
    """The state-independent terms of the reverse walk's step per chunk, (dv_new_local,
    dS_from_o, gamma): dv_new = dv_new_local + k_decayed dS_end, dS_start = dS_from_o +
    gamma dS_end - w^T dv_new."""
    gcum = prep.gcum
    q_gated = scale * gcum.exp()[..., None] * prep.q  # the output's state term reads S through e^gcum q
    P = scale * prep.qk * prep.decay  # intra-chunk attention, lower triangle incl. diagonal
    doc_ = to_chunks(do.float(), prep.layout)  # [NC, HV, C, V]
    return P.transpose(-1, -2) @ doc_, q_gated.transpose(-1, -2) @ doc_, gcum[..., -1].exp()


def walk_tapes(prep: Prepared, do, dht, initial_state, scale) -> Tapes:
    """The sequential part of the backward: the state walk forward (h, v_new) and the
    state gradient's walk back (dS_end, dv_new, dh0)."""
    N = prep.layout.doc_first_slot.shape[0]
    HV, K, V = prep.gcum.shape[1], prep.w.shape[-1], prep.u.shape[-1]
    h0 = initial_state.float() if initial_state is not None else prep.u.new_zeros(N, HV, K, V)
    h, v_new, _ = _walk(prep, h0)
    return Tapes(h, v_new, *reverse_walk(prep, do, dht, scale))


def reverse_walk(prep: Prepared, do, dht, scale) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state gradient's walk back over the chunk slots: (dS_end [NC, HV, K, V],
    dv_new [NC, HV, C, V], dh0 [N, HV, K, V]). It reads q, k, the gates and do, never v
    or the states: dS's recursion has no state in it."""
    lay = prep.layout
    N = lay.doc_first_slot.shape[0]
    NC, HV, C = prep.gcum.shape
    K, V = prep.w.shape[-1], do.shape[-1]
    dht = dht.float() if dht is not None else prep.w.new_zeros(N, HV, K, V)
    dv_new_local, dS_from_o, gamma = reverse_step_terms(prep, do, scale)

    # dS is the gradient of the state at the end of a chunk.
    dS_end = prep.w.new_empty(NC, HV, K, V)
    dv_new = prep.w.new_empty(NC, HV, C, V)
    dht_slot = dht[lay.doc]
    dS = prep.w.new_zeros(HV, K, V)
    for c in range(NC - 1, -1, -1):
        dS = torch.where(lay.last[c], dht_slot[c], dS)
        dS_end[c] = dS
        dv_new[c] = dv_new_local[c] + prep.k_decayed[c] @ dS
        dS = dS_from_o[c] + gamma[c][:, None, None] * dS - prep.w[c].transpose(-1, -2) @ dv_new[c]
    # The gradient of a document's initial state is dS at the start of its first chunk.
    f = lay.doc_first_slot
    dS_start = dS_from_o[f] + gamma[f][..., None, None] * dS_end[f] - prep.w[f].transpose(-1, -2) @ dv_new[f]
    dh0 = torch.where(lay.doc_nonempty[:, None, None, None], dS_start, dht)
    return dS_end, dv_new, dh0


def gdn_bwd_initial_state(do, dht, q, k, g, beta, cu_seqlens, scale, use_qk_l2norm):
    """The initial states' gradient alone (``cake::gdn_bwd_initial_state``): dh0 [N, HV,
    K, V] fp32, bitwise ``gdn_bwd``'s."""
    prep, _ = prepare(q, k, None, g, beta, cu_seqlens, use_qk_l2norm)
    return reverse_walk(prep, do, dht, scale)[2].contiguous()


def local_gradients(prep: Prepared, rstd, tapes: Tapes, do, scale, G: int):
    """The chunk-local part of the backward, given the walks' tapes: fp32 (dq, dk) per
    q/k token row [T, H, K] (summed over the GVA group, through the in-op L2 norm) and
    (dv [T, HV, V], dg [T, HV], dbeta [T, HV])."""
    lay = prep.layout
    h, v_new, dS_end, dv_new = tapes.h, tapes.v_new, tapes.dS_end, tapes.dv_new
    gcum, decay = prep.gcum, prep.decay
    eg = gcum.exp()
    q_gated = scale * eg[..., None] * prep.q
    P = scale * prep.qk * decay
    doc_ = to_chunks(do.float(), lay)
    gamma = gcum[..., -1].exp()

    # Output: o = q_gated h + P v_new.
    dq_gated = doc_ @ h.transpose(-1, -2)
    dgcum = (dq_gated * q_gated).sum(-1)
    dq = scale * eg[..., None] * dq_gated
    dP = doc_ @ v_new.transpose(-1, -2)
    dPP = dP * P  # d/dgcum_i of P_ij is P_ij, d/dgcum_j is -P_ij
    dgcum = dgcum + dPP.sum(-1) - dPP.sum(-2)
    dP_scaled = scale * dP * decay
    dq = dq + dP_scaled @ prep.k
    dk = dP_scaled.transpose(-1, -2) @ prep.q
    # State update: S' = e^gl S + k_decayed^T v_new.
    dk_decayed = v_new @ dS_end.transpose(-1, -2)
    decay_to_end = (gcum[..., -1:] - gcum).exp()
    dk = dk + decay_to_end[..., None] * dk_decayed
    t = (dk_decayed * prep.k_decayed).sum(-1)
    dgcum = dgcum - t
    dgl = t.sum(-1) + (dS_end * h).sum((-1, -2)) * gamma
    # v_new = u - w h.
    du = dv_new
    dw = -dv_new @ h.transpose(-1, -2)
    # WY: w = A Xw, u = A Xu, A = (I + L)^-1.
    Xw = (prep.beta * eg)[..., None] * prep.k
    Xu = prep.beta[..., None] * prep.v
    A = prep.A
    dA = dw @ Xw.transpose(-1, -2) + du @ Xu.transpose(-1, -2)
    dXw = A.transpose(-1, -2) @ dw
    dXu = A.transpose(-1, -2) @ du
    dL = -(A.transpose(-1, -2) @ dA @ A.transpose(-1, -2)).tril(-1)
    dL_decay_kk = dL * decay * prep.kk  # L_ij = beta_i D_ij kk_ij
    dbeta = dL_decay_kk.sum(-1)
    dLL = dL_decay_kk * prep.beta[..., None]
    dgcum = dgcum + dLL.sum(-1) - dLL.sum(-2)
    dkk = dL * prep.beta[..., None] * decay
    dk = dk + (dkk + dkk.transpose(-1, -2)) @ prep.k
    dk = dk + (prep.beta * eg)[..., None] * dXw
    dbeta = dbeta + (dXw * eg[..., None] * prep.k).sum(-1) + (dXu * prep.v).sum(-1)
    dgcum = dgcum + (dXw * Xw).sum(-1)
    dv = prep.beta[..., None] * dXu
    dgcum = torch.cat([dgcum[..., :-1], dgcum[..., -1:] + dgl[..., None]], -1)
    dg = dgcum.flip(-1).cumsum(-1).flip(-1)  # gcum is a chunk-local cumsum of g

    dq = from_chunks(_per_qk_head(dq, G), lay)
    dk = from_chunks(_per_qk_head(dk, G), lay)
    if rstd is not None:
        qn, rq, kn, rk = rstd
        dq, dk = _l2norm_bwd(dq, qn, rq), _l2norm_bwd(dk, kn, rk)
    return dq, dk, from_chunks(dv, lay), from_chunks(dg[..., None], lay)[..., 0], from_chunks(dbeta[..., None], lay)[..., 0]


def gdn_bwd(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    """Chunked backward. Returns (dq, dk, dv, dg, dbeta, dh0) in the dtypes of
    (q, k, v, g, beta) and fp32 for dh0 [N, HV, K, V]."""
    prep, rstd = prepare(q, k, v, g, beta, cu_seqlens, use_qk_l2norm)
    tapes = walk_tapes(prep, do, dht, initial_state, scale)
    dq, dk, dv, dg, dbeta = local_gradients(prep, rstd, tapes, do, scale, v.shape[1] // q.shape[1])
    dh0 = tapes.dh0
    # Below the floor g does not reach the output (the clamp's gradient is 0 there; the
    # true one, e^g times bounded terms, is below fp32 resolution).
    dg = torch.where(g < GATE_FLOOR, 0.0, dg)
    return (
        dq.to(q.dtype).contiguous(),
        dk.to(k.dtype).contiguous(),
        dv.to(v.dtype).contiguous(),
        dg.contiguous(),
        dbeta.to(beta.dtype).contiguous(),
        dh0.contiguous(),
    )


def _segment_docs(seg_cu: torch.Tensor, R: int) -> torch.Tensor:
    """The document of each of R segment rows, from their offsets seg_cu [N + 1] (on the
    device: no host read)."""
    rows = torch.arange(R, device=seg_cu.device, dtype=seg_cu.dtype)
    return torch.searchsorted(seg_cu[1:].contiguous(), rows, right=True)


def state_chain(E, M, S_start, seg_cu, keep: bool = False):
    """``cake::gdn_state_chain``: per document, S <- M_s S + E_s over its segment rows in
    order, from S_start (fp32 [N, HV, K, V]; E [R, HV, K, V], M [R, HV, K, K]). A
    truncated cut's M_s is zeros, and then M_s S + E_s is E_s. With ``keep``, also each
    row's entering state [R, HV, K, V] (the backward's). One row a step, each a product
    batched over the heads."""
    docs = _segment_docs(seg_cu, E.shape[0])
    S, entering = S_start.float().clone(), []
    for j in range(E.shape[0]):
        d = docs[j:j + 1]
        before = S.index_select(0, d)
        entering.append(before)
        S = S.index_copy(0, d, torch.matmul(M[j:j + 1].float(), before) + E[j:j + 1].float())
    if keep:
        return S, (torch.cat(entering) if entering else S.new_zeros(0, *S.shape[1:]))
    return S


def state_chain_backward(grad, E, M, S_start, seg_cu):
    """The gradients of ``state_chain``'s end states ``grad`` [N, HV, K, V] as to E, M
    and S_start."""
    docs = _segment_docs(seg_cu, E.shape[0])
    _, entering = state_chain(E, M, S_start, seg_cu, keep=True)
    lam, dE, dM = grad.float().clone(), torch.zeros_like(E, dtype=torch.float32), torch.zeros_like(M, dtype=torch.float32)
    for j in reversed(range(E.shape[0])):
        d = docs[j:j + 1]
        l = lam.index_select(0, d)  # noqa: E741
        dE[j:j + 1] = l
        dM[j:j + 1] = torch.matmul(l, entering[j:j + 1].transpose(-1, -2))
        lam = lam.index_copy(0, d, torch.matmul(M[j:j + 1].float().transpose(-1, -2), l))
    return dE, dM, lam


def state_grad_chain(F, B, dS_end, seg_cu, keep: bool = False):
    """``cake::gdn_state_grad_chain``: per document, dS <- B_s dS + F_s over its segment
    rows from the last, from dS_end (F [R, HV, K, V], B [R, HV, K, K]; a truncated cut's
    B_s is zeros). With ``keep``, also each row's entering gradient."""
    docs = _segment_docs(seg_cu, F.shape[0])
    dS = dS_end.float().clone()
    entering = [None] * F.shape[0]
    for j in reversed(range(F.shape[0])):
        d = docs[j:j + 1]
        before = dS.index_select(0, d)
        entering[j] = before
        dS = dS.index_copy(0, d, torch.matmul(B[j:j + 1].float(), before) + F[j:j + 1].float())
    if keep:
        return dS, (torch.cat(entering) if entering else dS.new_zeros(0, *dS.shape[1:]))
    return dS


def state_grad_chain_backward(grad, F, B, dS_end, seg_cu):
    """The gradients of ``state_grad_chain``'s start gradients ``grad`` as to F, B and
    dS_end."""
    docs = _segment_docs(seg_cu, F.shape[0])
    _, entering = state_grad_chain(F, B, dS_end, seg_cu, keep=True)
    mu, dF, dB = grad.float().clone(), torch.zeros_like(F, dtype=torch.float32), torch.zeros_like(B, dtype=torch.float32)
    for j in range(F.shape[0]):
        d = docs[j:j + 1]
        m = mu.index_select(0, d)
        dF[j:j + 1] = m
        dB[j:j + 1] = torch.matmul(m, entering[j:j + 1].transpose(-1, -2))
        mu = mu.index_copy(0, d, torch.matmul(B[j:j + 1].float().transpose(-1, -2), m))
    return dF, dB, mu

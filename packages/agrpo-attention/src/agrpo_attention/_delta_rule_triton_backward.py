"""Backward Triton kernels of the chunked gated delta rule: exact gradients of `_delta_rule_triton_forward`.

Owns the launches of one call (`run_backward`), reading the forward's chunk states h, U, W, T and G (no
recompute of the recurrence):
1. `du_local_kernel`, parallel: dU = (Q K^T o D, lower)^T dO, the part of dU inside the chunk;
2. `state_backward_kernel`, once per tree level, deepest first, one program per (segment, head, value
   block), chunks in reverse: starts from the gradient of the segment's final state (the sum of its
   children's start-state gradients, written by the previous launch, plus any given), stores dS_next
   (gradient w.r.t. the state leaving each chunk), completes dU += (exp(G_last - G) K) dS_next, and
   dS <- exp(G_last) dS_next + (diag(exp(G)) Q)^T dO - W^T dU, ending at the gradient of the state the
   segment started from;
3. `wy_backward_kernel`, parallel: dV and dbeta (stored in their inputs' dtypes) and the W/T part of dK and
   dG through T = (I + A)^-1 (dA = -T^T dT T^T);
4. `dqk_backward_kernel`, parallel: dQ, the rest of dK, and dg = reverse cumsum of dG in the chunk (in g's
   dtype);
5. `qk_norm_backward_kernel`, parallel over (token block, key head): sums grouped value heads and takes dQ
   and dK through the L2 normalisation, in q's and k's dtypes.
dO may be bf16 (the output's dtype): tiles are widened to fp32 on load.
One transpose of a computed matrix is needed (dK += dS_A^T K): it goes through global scratch and a
barrier, never `tl.trans` of a dot result (miscompiled on Hopper by Triton 3.4-3.7.0, fla issue #640).
Does not know trees or autograd.

Legend: N = tokens, H = heads, K/V = head dims (BK/BV tiles), C = chunk, NT = table chunks, B = sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._delta_rule_triton_forward import CHUNK, STATE_BLOCK, TOKEN_BLOCK, launch_options, tile_sizes
from ._delta_rule_triton_tiles import (
    chunk_cols,
    chunk_gates,
    chunk_position,
    chunk_rows,
    chunk_vector,
    decay,
    load_state,
    reverse_cumulative,
    square_offsets,
    store_chunk_rows,
    store_chunk_vector,
    store_state,
)

GRADIENT_BLOCK = 32  # value columns per step of the dQ/dK loop (its four accumulators spill ~2 KB at 4 warps)


@triton.jit
def du_local_kernel(q_ptr, k_ptr, gcum_ptr, do_ptr, cu_ptr, table_ptr, du_ptr, H, K: tl.constexpr,
                    V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    PRECISION: tl.constexpr):  # fmt: skip
    pid, head, v0 = tl.program_id(0), tl.program_id(1), tl.program_id(2) * BV
    seq, start, n = chunk_position(table_ptr, cu_ptr, pid, C)
    if seq < 0:
        return
    r = tl.arange(0, C)
    g_cum, _ = chunk_gates(gcum_ptr, pid, head, H, C)
    k = chunk_rows(k_ptr, start, n, head, 0, H, K, C, BK)
    q_t = chunk_cols(q_ptr, start, n, head, 0, H, K, C, BK)
    # scores_t[i, j] = k_i . q_j exp(G_j - G_i) for j >= i: the intra-chunk map, transposed by construction
    scores_t = tl.dot(k, q_t, input_precision=PRECISION) * decay(-g_cum, -g_cum, r[None, :] >= r[:, None])
    do = chunk_rows(do_ptr, start, n, head, v0, H, V, C, BV)
    store_chunk_rows(du_ptr, tl.dot(scores_t, do, input_precision=PRECISION), start, n, head, v0, H, V, C, BV)


@triton.jit(do_not_specialize=["level_base"])
def state_backward_kernel(q_ptr, k_ptr, w_ptr, gcum_ptr, do_ptr, dfinal_ptr, cu_ptr, chunk_cu_ptr, child_cu_ptr,
                          children_ptr, level_ptr, du_ptr, dh_ptr, dh0_ptr, level_base, H, K: tl.constexpr,
                          V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          PRECISION: tl.constexpr, HAS_DFINAL: tl.constexpr):  # fmt: skip
    seq = tl.load(level_ptr + level_base + tl.program_id(0))
    head, v0 = tl.program_id(1), tl.program_id(2) * BV
    bos = tl.load(cu_ptr + seq)
    eos = tl.load(cu_ptr + seq + 1)
    first = tl.load(chunk_cu_ptr + seq)
    num_chunks = tl.cdiv(eos - bos, C)
    d_state = tl.zeros((BK, BV), dtype=tl.float32)
    if HAS_DFINAL:
        d_state += load_state(dfinal_ptr, seq, head, v0, H, K, V, BK, BV)
    child = tl.load(child_cu_ptr + seq)
    last_child = tl.load(child_cu_ptr + seq + 1)
    while child < last_child:  # each child's start-state gradient, in a fixed order (no atomics)
        d_state += load_state(dh0_ptr, tl.load(children_ptr + child), head, v0, H, K, V, BK, BV)
        child += 1
    c = num_chunks - 1
    while c >= 0:
        start = bos + c * C
        n = tl.minimum(eos - start, C)
        store_state(dh_ptr, d_state, first + c, head, v0, H, K, V, BK, BV)
        g_cum, g_last = chunk_gates(gcum_ptr, first + c, head, H, C)
        k_tail = chunk_rows(k_ptr, start, n, head, 0, H, K, C, BK) * tl.exp(g_last - g_cum)[:, None]
        du = chunk_rows(du_ptr, start, n, head, v0, H, V, C, BV)
        du += tl.dot(k_tail, d_state, input_precision=PRECISION)
        store_chunk_rows(du_ptr, du, start, n, head, v0, H, V, C, BV)  # local dU -> full dU, in place
        q_t = chunk_cols(q_ptr, start, n, head, 0, H, K, C, BK) * tl.exp(g_cum)[None, :]
        w_t = chunk_cols(w_ptr, start, n, head, 0, H, K, C, BK)
        do = chunk_rows(do_ptr, start, n, head, v0, H, V, C, BV)
        d_state = d_state * tl.exp(g_last) + tl.dot(q_t, do, input_precision=PRECISION)
        d_state -= tl.dot(w_t, du, input_precision=PRECISION)
        c -= 1
    store_state(dh0_ptr, d_state, seq, head, v0, H, K, V, BK, BV)


@triton.jit
def _wy_value_gradients(du_ptr, h_ptr, v_ptr, dv_ptr, tinv_t, beta, pid, start, n, head, H, K: tl.constexpr,
                        V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        PRECISION: tl.constexpr):  # fmt: skip
    """Over value blocks: stores dV = beta T^T dU; returns (dW, dT from U_bar, dbeta from V)."""
    d_w = tl.zeros((C, BK), dtype=tl.float32)
    d_t = tl.zeros((C, C), dtype=tl.float32)
    d_beta = tl.zeros((C,), dtype=tl.float32)
    for v0 in range(0, V, BV):
        du = chunk_rows(du_ptr, start, n, head, v0, H, V, C, BV)
        state = load_state(h_ptr, pid, head, v0, H, K, V, BK, BV)
        v = chunk_rows(v_ptr, start, n, head, v0, H, V, C, BV)
        d_w -= tl.dot(du, tl.trans(state), input_precision=PRECISION)  # U = U_bar - W S
        d_t += tl.dot(du, tl.trans(v * beta[:, None]), input_precision=PRECISION)
        d_y = tl.dot(tinv_t, du, input_precision=PRECISION)
        store_chunk_rows(dv_ptr, d_y * beta[:, None], start, n, head, v0, H, V, C, BV)
        d_beta += tl.sum(d_y * v, axis=1)
    return d_w, d_t, d_beta


@triton.jit
def wy_backward_kernel(k_ptr, v_ptr, beta_ptr, gcum_ptr, tinv_ptr, h_ptr, du_ptr, cu_ptr, table_ptr, dv_ptr,
                       dk_ptr, dbeta_ptr, dg_ptr, scratch_ptr, H, K: tl.constexpr, V: tl.constexpr,
                       C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    pid, head = tl.program_id(0), tl.program_id(1)
    seq, start, n = chunk_position(table_ptr, cu_ptr, pid, C)
    if seq < 0:
        return
    r = tl.arange(0, C)
    tinv_t = tl.load(tinv_ptr + square_offsets(pid, head, H, C, True))
    beta = chunk_vector(beta_ptr, start, n, head, H, C)
    g_cum, _ = chunk_gates(gcum_ptr, pid, head, H, C)
    d_w, d_t, d_beta = _wy_value_gradients(du_ptr, h_ptr, v_ptr, dv_ptr, tinv_t, beta, pid, start, n, head, H,
                                           K, V, C, BK, BV, PRECISION)  # fmt: skip
    k = chunk_rows(k_ptr, start, n, head, 0, H, K, C, BK)
    scale = beta * tl.exp(g_cum)
    x = k * scale[:, None]  # W = T X
    d_x = tl.dot(tinv_t, d_w, input_precision=PRECISION)
    d_t += tl.dot(d_w, tl.trans(x), input_precision=PRECISION)
    d_beta += tl.exp(g_cum) * tl.sum(d_x * k, axis=1)
    d_g = tl.sum(d_x * x, axis=1)
    d_k = d_x * scale[:, None]
    d_a = -tl.dot(tl.dot(tinv_t, d_t, input_precision=PRECISION), tinv_t, input_precision=PRECISION)
    gram = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    d_s = d_a * decay(g_cum, g_cum, r[:, None] > r[None, :])  # dA o D on the strict lower triangle
    d_beta += tl.sum(d_s * gram, axis=1)
    d_s = d_s * beta[:, None]  # gradient w.r.t. the Gram matrix k_i . k_j (strict lower part)
    owed = d_s * gram  # dA o A: what each A_ij owes to G_i (+) and G_j (-)
    d_g += tl.sum(owed, axis=1) - tl.sum(owed, axis=0)
    d_k += tl.dot(d_s, k, input_precision=PRECISION)
    tl.store(scratch_ptr + square_offsets(pid, head, H, C, False), d_s)
    tl.debug_barrier()
    d_s_t = tl.load(scratch_ptr + square_offsets(pid, head, H, C, True))
    d_k += tl.dot(d_s_t, k, input_precision=PRECISION)
    store_chunk_rows(dk_ptr, d_k, start, n, head, 0, H, K, C, BK)
    store_chunk_vector(dbeta_ptr, d_beta, start, n, head, H, C)
    tl.store(dg_ptr + (pid.to(tl.int64) * H + head) * C + r, d_g)


@triton.jit
def _state_products(do_ptr, u_ptr, h_ptr, dh_ptr, pid, start, n, head, H, K: tl.constexpr, V: tl.constexpr,
                    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Over value blocks: (dO S^T, U dS_next^T, dO U^T, U dO^T, rowsum(S o dS_next))."""
    d_q = tl.zeros((C, BK), dtype=tl.float32)
    d_k = tl.zeros((C, BK), dtype=tl.float32)
    d_m = tl.zeros((C, C), dtype=tl.float32)
    d_m_t = tl.zeros((C, C), dtype=tl.float32)
    state_dot = tl.zeros((BK,), dtype=tl.float32)
    for v0 in range(0, V, BV):
        do = chunk_rows(do_ptr, start, n, head, v0, H, V, C, BV)
        u = chunk_rows(u_ptr, start, n, head, v0, H, V, C, BV)
        state = load_state(h_ptr, pid, head, v0, H, K, V, BK, BV)
        d_state = load_state(dh_ptr, pid, head, v0, H, K, V, BK, BV)
        d_q += tl.dot(do, tl.trans(state), input_precision=PRECISION)
        d_k += tl.dot(u, tl.trans(d_state), input_precision=PRECISION)
        d_m += tl.dot(do, tl.trans(u), input_precision=PRECISION)
        d_m_t += tl.dot(u, tl.trans(do), input_precision=PRECISION)
        state_dot += tl.sum(state * d_state, axis=1)
    return d_q, d_k, d_m, d_m_t, tl.sum(state_dot, axis=0)


@triton.jit
def dqk_backward_kernel(q_ptr, k_ptr, u_ptr, gcum_ptr, h_ptr, dh_ptr, do_ptr, dk_wy_ptr, dg_wy_ptr, cu_ptr,
                        table_ptr, dq_ptr, dk_ptr, dg_ptr, H, K: tl.constexpr, V: tl.constexpr,
                        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    pid, head = tl.program_id(0), tl.program_id(1)
    seq, start, n = chunk_position(table_ptr, cu_ptr, pid, C)
    if seq < 0:
        return
    r = tl.arange(0, C)
    d_q, d_k_tail, d_m, d_m_t, state_dot = _state_products(do_ptr, u_ptr, h_ptr, dh_ptr, pid, start, n, head,
                                                           H, K, V, C, BK, BV, PRECISION)  # fmt: skip
    q = chunk_rows(q_ptr, start, n, head, 0, H, K, C, BK)
    k = chunk_rows(k_ptr, start, n, head, 0, H, K, C, BK)
    g_cum, g_last = chunk_gates(gcum_ptr, pid, head, H, C)
    gate = tl.exp(g_cum)
    tail = tl.exp(g_last - g_cum)
    d_s = d_m * decay(g_cum, g_cum, r[:, None] >= r[None, :])  # gradient of the scores q_i . k_j
    owed = d_s * tl.dot(q, tl.trans(k), input_precision=PRECISION)
    d_g = tl.sum(owed, axis=1) - tl.sum(owed, axis=0) + gate * tl.sum(q * d_q, axis=1)
    d_q = d_q * gate[:, None] + tl.dot(d_s, k, input_precision=PRECISION)
    d_s_t = d_m_t * decay(-g_cum, -g_cum, r[None, :] >= r[:, None])  # the same gradient, transposed
    d_k = tl.dot(d_s_t, q, input_precision=PRECISION) + d_k_tail * tail[:, None]
    d_k += chunk_rows(dk_wy_ptr, start, n, head, 0, H, K, C, BK)
    leaving = tail * tl.sum(k * d_k_tail, axis=1)  # what exp(G_last - G_i) owes to G_last (+) and G_i (-)
    d_g += tl.where(r == C - 1, tl.sum(leaving, axis=0) + tl.exp(g_last) * state_dot, 0.0) - leaving
    d_g += tl.load(dg_wy_ptr + (pid.to(tl.int64) * H + head) * C + r)
    store_chunk_rows(dq_ptr, d_q, start, n, head, 0, H, K, C, BK)
    store_chunk_rows(dk_ptr, d_k, start, n, head, 0, H, K, C, BK)
    store_chunk_vector(dg_ptr, reverse_cumulative(d_g, C), start, n, head, H, C)


@triton.jit(do_not_specialize=["N"])
def qk_norm_backward_kernel(dqn_ptr, dkn_ptr, qn_ptr, kn_ptr, rq_ptr, rk_ptr, dq_ptr, dk_ptr, N, H, scale,
                            REP: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """dq, dk (N, H / REP, K) of q_n = scale q r_q, k_n = k r_k (r = (x.x + 1e-6)^-1/2): with y = x r and dy
    the gradient summed over the group's value heads, dx = r (dy - y (y . dy))."""
    pid, key_head = tl.program_id(0), tl.program_id(1)
    t = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    ck = tl.arange(0, BK)
    mask = (t[:, None] < N) & (ck[None, :] < K)
    d_qn = tl.zeros((BT, BK), dtype=tl.float32)
    d_kn = tl.zeros((BT, BK), dtype=tl.float32)
    for r in tl.static_range(REP):
        offsets = (t[:, None] * H + key_head * REP + r) * K + ck[None, :]
        d_qn += tl.load(dqn_ptr + offsets, mask=mask, other=0.0)
        d_kn += tl.load(dkn_ptr + offsets, mask=mask, other=0.0)
    first = (t[:, None] * H + key_head * REP) * K + ck[None, :]
    y_q = tl.load(qn_ptr + first, mask=mask, other=0.0) / scale
    y_k = tl.load(kn_ptr + first, mask=mask, other=0.0)
    r_q = tl.load(rq_ptr + t * (H // REP) + key_head, mask=t < N, other=0.0)
    r_k = tl.load(rk_ptr + t * (H // REP) + key_head, mask=t < N, other=0.0)
    d_q = (scale * r_q)[:, None] * (d_qn - y_q * tl.sum(y_q * d_qn, axis=1)[:, None])
    d_k = r_k[:, None] * (d_kn - y_k * tl.sum(y_k * d_kn, axis=1)[:, None])
    out = (t[:, None] * (H // REP) + key_head) * K + ck[None, :]
    tl.store(dq_ptr + out, d_q, mask=mask)
    tl.store(dk_ptr + out, d_k, mask=mask)


def run_backward(saved, tree, d_out, d_final, dtypes, precision):
    """`saved` = (q_n, k_n, v, beta, r_q, r_k, h, U, W, T, G) of the forward, `tree` = (offsets, child offsets,
    children, level segments, level offsets (host), chunk offsets, chunk table), dO (N, H, V) in the output's
    dtype, d(final) (S, H, K, V) or None, `dtypes` of q, k, v, g, beta -> (dq, dk (N, Hk, K), dv, dg, dbeta,
    d(start state of every segment) (S, H, K, V))."""
    q, k, v, beta, r_q, r_k, h, u, w, tinv, gcum = saved
    offsets, child_cu, children, level_segments, level_offsets, chunk_cu, table = tree
    num_tokens, heads, k_dim = q.shape
    key_heads, v_dim, num_seqs, num_chunks = r_q.shape[1], v.shape[-1], offsets.shape[0] - 1, table.shape[0]
    bk, bv = tile_sizes(k_dim, v_dim)
    bs, bg = min(bv, STATE_BLOCK), min(bv, GRADIENT_BLOCK)
    sizes = dict(K=k_dim, V=v_dim, C=CHUNK, BK=bk, PRECISION=precision)
    du, dh, dh0 = torch.empty_like(v), torch.empty_like(h), q.new_empty(num_seqs, heads, k_dim, v_dim)
    dv = torch.empty_like(v, dtype=dtypes[2])
    dg, dbeta = torch.empty_like(beta, dtype=dtypes[3]), torch.empty_like(beta, dtype=dtypes[4])
    dq_n, dk_n, dk_wy = torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)
    dq, dk = (q.new_empty(num_tokens, key_heads, k_dim, dtype=d) for d in dtypes[:2])
    dg_wy, scratch = torch.empty_like(gcum), torch.empty_like(tinv)
    if num_chunks:
        du_local_kernel[(num_chunks, heads, triton.cdiv(v_dim, bv))](
            q, k, gcum, d_out, offsets, table, du, heads, BV=bv, **sizes, **launch_options("du_local")
        )
    bounds = level_offsets.tolist()
    for begin, end in reversed([(b, e) for b, e in zip(bounds[:-1], bounds[1:], strict=True) if e > b]):
        state_backward_kernel[(end - begin, heads, triton.cdiv(v_dim, bs))](
            q, k, w, gcum, d_out, dh0 if d_final is None else d_final, offsets, chunk_cu, child_cu, children,
            level_segments, du, dh, dh0, begin, heads, BV=bs, HAS_DFINAL=d_final is not None, **sizes,
            **launch_options("state_backward"),
        )  # fmt: skip
    if num_chunks:
        wy_backward_kernel[(num_chunks, heads)](
            k, v, beta, gcum, tinv, h, du, offsets, table, dv, dk_wy, dbeta, dg_wy, scratch, heads,
            BV=bs, **sizes, **launch_options("wy_backward"),
        )  # fmt: skip
        dqk_backward_kernel[(num_chunks, heads)](
            q, k, u, gcum, h, dh, d_out, dk_wy, dg_wy, offsets, table, dq_n, dk_n, dg, heads,
            BV=bg, **sizes, **launch_options("dqk_backward"),
        )  # fmt: skip
        qk_norm_backward_kernel[(triton.cdiv(num_tokens, TOKEN_BLOCK), key_heads)](
            dq_n, dk_n, q, k, r_q, r_k, dq, dk, num_tokens, heads, k_dim**-0.5, REP=heads // key_heads,
            K=k_dim, BT=TOKEN_BLOCK, BK=bk, **launch_options("qk_norm_backward"),
        )  # fmt: skip
    return dq, dk, dv, dg, dbeta, dh0

"""Forward Triton kernels of the chunked gated delta rule over a segment tree, read in place.

Owns the launches of one call (`run_forward`); segments are contiguous token ranges of the packed row, each
starting from its parent's final state (a root: from its given initial state, or zero), and every parallel
kernel runs once over the chunk table of all segments:
0. `qk_norm_forward_kernel`, parallel over (token block, value head): reads q/k/v/g/beta where the layer left
   them (strided views, bf16 or fp32), L2-normalises q and k in fp32 (q also scaled by K^-0.5; grouped
   value heads repeat their key head) and writes the fp32 token-major copies the kernels read, plus each
   token's inverse norms for the backward;
1. `wy_forward_kernel`, one program per (chunk, head), parallel: G = cumsum(g) within the chunk,
   A = strict-lower(beta_i exp(G_i - G_j) k_i.k_j), T = (I + A)^-1 (16-row diagonal blocks by forward
   substitution, then a 3-term series for the rest, in "tf32x3" dots: ~fp32 accuracy on tensor cores),
   W = T diag(beta exp(G)) K and U_bar = T diag(beta) V (the WY/UT form);
2. `state_forward_kernel`, once per tree level, one program per (segment of the level, head, value block),
   sequential over the segment's chunks: stores the fp32 state entering each chunk, U = U_bar - W S, and
   S <- exp(G_last) S + (exp(G_last - G) K)^T U, from the parent's final state (written by the previous
   level's launch) to the segment's own;
3. `output_forward_kernel`, parallel: O = diag(exp(G)) Q S + (Q K^T o exp(G_i - G_j), j <= i) U, stored in
   the output's dtype (v's).
`PRECISION` is the dot precision of everything but the inverse ("tf32" for half inputs, "tf32x3" for fp32
ones). Saved for the backward: normalised q/k, v, beta, the inverse norms, the chunk states, U, W, T and G.
Also owns `LAUNCH`, the launch table of these and the backward's kernels. Does not know autograd or torch
ops; imports triton at import time (imported only when a kernel runs).

Compiled for sm_90 with Triton 3.6 (`LAUNCH`, two stages, K = V = 128, tf32, bf16 activations), every dot
of both modules is on wgmma; spills: `wy_forward` 208 bytes per thread, `state_backward` 280, `wy_backward`
436 at 8 warps (756 at 4) with 224 KB of shared memory (one program per SM), `dqk_backward` 52 at 8 warps
(2.2 KB at 4), the others none (`tools/bench/train_step/delta_rule_compile.py`).

Legend: N = tokens, H = heads, K/V = head dims (BK/BV their tiles), C = chunk (64), NT = table chunks,
B = sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._delta_rule_triton_tiles import (
    chunk_cols,
    chunk_gates,
    chunk_position,
    chunk_rows,
    chunk_vector,
    cumulative,
    decay,
    load_state,
    load_state_if,
    square_offsets,
    store_chunk_rows,
    store_state,
)

CHUNK = 64
STATE_BLOCK = 32  # value columns per recurrence program: 4 programs per 128-wide head keep the SMs busy
TOKEN_BLOCK = 32  # tokens per program of the q/k normalisation kernels
LAUNCH: dict[str, tuple[int, int]] = {
    "qk_norm_forward": (4, 2), "wy_forward": (4, 2), "state_forward": (4, 2), "output_forward": (4, 2),
    "du_local": (4, 2), "state_backward": (4, 2), "wy_backward": (8, 2), "dqk_backward": (8, 2),
    "qk_norm_backward": (4, 2),
}  # fmt: skip
"""(num_warps, num_stages) of every forward and backward kernel, read at each launch. Four warps (one Hopper
warpgroup) except the two heaviest backward kernels, whose 4-warp builds spill 0.8-2.2 KB per thread: on the
H200 (2026-12-03, K = V = 128) 8 warps took `dqk_backward` from 1.38 to 0.81 ms per 16k tokens and
`wy_backward` from 1.03 to 1.00, with parity unchanged, while 8 warps slowed `wy_forward` (0.93 -> 1.69) and
`state_forward` (0.62 -> 0.88). fla-core keeps kernels of this kind at <= 4 warps on Hopper after miscompiles
at 8; the full-size parity check of `tools/bench/train_step/delta_rule_kernels.py` runs this table (its
`--launch` presets measure the alternatives). Two stages bound the shared memory of the value-block loops."""


@triton.jit(do_not_specialize=["N"])
def qk_norm_forward_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, qn_ptr, kn_ptr, v32_ptr, g32_ptr, beta32_ptr,
                           rq_ptr, rk_ptr, N, H, scale, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t,
                           sb_h, REP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """Tokens pid*BT.. of value head `head`: q_n = scale q / |q|, k_n = k / |k| (|x| = sqrt(x.x + 1e-6), fp32,
    the key head of the group), v, g and beta widened to fp32, token-major; inverse norms (N, H / REP)."""
    pid, head = tl.program_id(0), tl.program_id(1)
    key_head = head // REP
    t = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    ck, cv = tl.arange(0, BK), tl.arange(0, BV)
    rows = t < N
    mask_k, mask_v = rows[:, None] & (ck[None, :] < K), rows[:, None] & (cv[None, :] < V)
    q = tl.load(q_ptr + t[:, None] * sq_t + key_head * sq_h + ck[None, :], mask=mask_k, other=0.0).to(
        tl.float32
    )
    k = tl.load(k_ptr + t[:, None] * sk_t + key_head * sk_h + ck[None, :], mask=mask_k, other=0.0).to(
        tl.float32
    )
    r_q = tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)
    r_k = tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)
    out_k = (t[:, None] * H + head) * K + ck[None, :]
    tl.store(qn_ptr + out_k, q * (r_q * scale)[:, None], mask=mask_k)
    tl.store(kn_ptr + out_k, k * r_k[:, None], mask=mask_k)
    first = rows & (head % REP == 0)
    tl.store(rq_ptr + t * (H // REP) + key_head, r_q, mask=first)
    tl.store(rk_ptr + t * (H // REP) + key_head, r_k, mask=first)
    v = tl.load(v_ptr + t[:, None] * sv_t + head * sv_h + cv[None, :], mask=mask_v, other=0.0)
    tl.store(v32_ptr + (t[:, None] * H + head) * V + cv[None, :], v.to(tl.float32), mask=mask_v)
    g = tl.load(g_ptr + t * sg_t + head * sg_h, mask=rows, other=0.0)
    beta = tl.load(beta_ptr + t * sb_t + head * sb_h, mask=rows, other=0.0)
    tl.store(g32_ptr + t * H + head, g.to(tl.float32), mask=rows)
    tl.store(beta32_ptr + t * H + head, beta.to(tl.float32), mask=rows)


@triton.jit
def _inverse_unit_lower(a, C: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^-1 for strictly lower (C, C) A, C = 64, in fp32-accurate dots ("tf32x3": three tf32 products,
    ~2^-21 relative, on tensor cores; "ieee" FMA dots would spill and take minutes to compile): the four
    16-row diagonal blocks by forward substitution (15 steps, one row of each block per step), then the
    block-lower remainder N = D^-1 E, nilpotent of order 4, through (I + N)^-1 = I - N + N^2 - N^3."""
    r = tl.arange(0, C)
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    a_diag = tl.where((r[:, None] // 16) == (r[None, :] // 16), a, 0.0)
    inverse = eye
    for p in range(1, 16):
        rows = (r % 16) == p  # rows m < p of each block are final, and only they meet a_diag's row p
        step = tl.dot(tl.where(rows[:, None], a_diag, 0.0), inverse, input_precision=PRECISION)
        inverse = tl.where(rows[:, None], eye - step, inverse)
    n = tl.dot(inverse, a - a_diag, input_precision=PRECISION)
    term = tl.dot(n, inverse, input_precision=PRECISION)
    result = inverse - term
    term = tl.dot(n, term, input_precision=PRECISION)
    result += term
    return result - tl.dot(n, term, input_precision=PRECISION)


@triton.jit
def wy_forward_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, cu_ptr, table_ptr, gcum_ptr, tinv_ptr, w_ptr, u_ptr, H,
                      K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      PRECISION: tl.constexpr, INVERSE_PRECISION: tl.constexpr):  # fmt: skip
    pid, head = tl.program_id(0), tl.program_id(1)
    seq, start, n = chunk_position(table_ptr, cu_ptr, pid, C)
    if seq < 0:
        return
    r = tl.arange(0, C)
    beta = chunk_vector(beta_ptr, start, n, head, H, C)
    g_cum = cumulative(chunk_vector(g_ptr, start, n, head, H, C), C)
    tl.store(gcum_ptr + (pid.to(tl.int64) * H + head) * C + r, g_cum)
    k = chunk_rows(k_ptr, start, n, head, 0, H, K, C, BK)
    gram = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    a = gram * decay(g_cum, g_cum, r[:, None] > r[None, :]) * beta[:, None]
    tinv = _inverse_unit_lower(a, C, INVERSE_PRECISION)
    tl.store(tinv_ptr + square_offsets(pid, head, H, C, False), tinv)
    k = chunk_rows(k_ptr, start, n, head, 0, H, K, C, BK)  # reloaded: not held in registers across T
    w = tl.dot(tinv, k * (beta * tl.exp(g_cum))[:, None], input_precision=PRECISION)
    store_chunk_rows(w_ptr, w, start, n, head, 0, H, K, C, BK)
    for v0 in range(0, V, BV):
        v = chunk_rows(v_ptr, start, n, head, v0, H, V, C, BV)
        u_bar = tl.dot(tinv, v * beta[:, None], input_precision=PRECISION)
        store_chunk_rows(u_ptr, u_bar, start, n, head, v0, H, V, C, BV)


@triton.jit(do_not_specialize=["level_base"])
def state_forward_kernel(k_ptr, w_ptr, u_ptr, gcum_ptr, h0_ptr, cu_ptr, chunk_cu_ptr, parent_ptr, level_ptr,
                         h_ptr, final_ptr, level_base, H, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
                         HAS_INITIAL: tl.constexpr):  # fmt: skip
    seq = tl.load(level_ptr + level_base + tl.program_id(0))
    head, v0 = tl.program_id(1), tl.program_id(2) * BV
    bos = tl.load(cu_ptr + seq)
    eos = tl.load(cu_ptr + seq + 1)
    first = tl.load(chunk_cu_ptr + seq)
    parent = tl.load(parent_ptr + seq)
    state = load_state_if(final_ptr, parent >= 0, parent, head, v0, H, K, V, BK, BV)  # the previous level's
    if HAS_INITIAL:
        state += load_state_if(h0_ptr, parent < 0, seq, head, v0, H, K, V, BK, BV)
    c = first * 0
    while c < tl.cdiv(eos - bos, C):  # a while loop: the interpreter cannot range() over a loaded bound
        start = bos + c * C
        n = tl.minimum(eos - start, C)
        store_state(h_ptr, state, first + c, head, v0, H, K, V, BK, BV)
        w = chunk_rows(w_ptr, start, n, head, 0, H, K, C, BK)
        u = chunk_rows(u_ptr, start, n, head, v0, H, V, C, BV) - tl.dot(w, state, input_precision=PRECISION)
        store_chunk_rows(u_ptr, u, start, n, head, v0, H, V, C, BV)  # U_bar -> U, same tile, same program
        g_cum, g_last = chunk_gates(gcum_ptr, first + c, head, H, C)
        k_t = chunk_cols(k_ptr, start, n, head, 0, H, K, C, BK) * tl.exp(g_last - g_cum)[None, :]
        state = state * tl.exp(g_last) + tl.dot(k_t, u, input_precision=PRECISION)
        c += 1
    store_state(final_ptr, state, seq, head, v0, H, K, V, BK, BV)


@triton.jit
def output_forward_kernel(q_ptr, k_ptr, u_ptr, gcum_ptr, h_ptr, cu_ptr, table_ptr, o_ptr, H, K: tl.constexpr,
                          V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          PRECISION: tl.constexpr):  # fmt: skip
    pid, head, v0 = tl.program_id(0), tl.program_id(1), tl.program_id(2) * BV
    seq, start, n = chunk_position(table_ptr, cu_ptr, pid, C)
    if seq < 0:
        return
    r = tl.arange(0, C)
    g_cum, _ = chunk_gates(gcum_ptr, pid, head, H, C)
    q = chunk_rows(q_ptr, start, n, head, 0, H, K, C, BK)
    k_t = chunk_cols(k_ptr, start, n, head, 0, H, K, C, BK)
    scores = tl.dot(q, k_t, input_precision=PRECISION) * decay(g_cum, g_cum, r[:, None] >= r[None, :])
    state = load_state(h_ptr, pid, head, v0, H, K, V, BK, BV)
    u = chunk_rows(u_ptr, start, n, head, v0, H, V, C, BV)
    o = tl.dot(q * tl.exp(g_cum)[:, None], state, input_precision=PRECISION)
    o += tl.dot(scores, u, input_precision=PRECISION)
    store_chunk_rows(o_ptr, o, start, n, head, v0, H, V, C, BV)


def tile_sizes(k_dim: int, v_dim: int) -> tuple[int, int]:
    """(BK, BV): the whole key dim in one tile, values in blocks of <= 64 (tiles >= 16 for tensor cores)."""
    return max(16, triton.next_power_of_2(k_dim)), min(64, max(16, triton.next_power_of_2(v_dim)))


def launch_options(kernel: str) -> dict[str, int]:
    """`kernel`'s `LAUNCH` entry as launch keywords (read at each launch, so a benchmark may change it)."""
    warps, stages = LAUNCH[kernel]
    return dict(num_warps=warps, num_stages=stages)


def normalise_inputs(q, k, v, g, beta):
    """q/k (N, Hk, K), v (N, Hv, V), g/beta (N, Hv), any float dtype, last dim contiguous -> fp32 token-major
    q_n (scaled by K^-0.5), k_n (N, Hv, K), v (N, Hv, V), g, beta (N, Hv), and the inverse norms of q and k
    (N, Hk)."""
    num_tokens, key_heads, k_dim = q.shape
    heads, v_dim = v.shape[1], v.shape[2]
    f32 = dict(dtype=torch.float32, device=q.device)
    q_n, k_n = (torch.empty(num_tokens, heads, k_dim, **f32) for _ in range(2))
    v32 = torch.empty(num_tokens, heads, v_dim, **f32)
    g32, beta32 = (torch.empty(num_tokens, heads, **f32) for _ in range(2))
    r_q, r_k = (torch.empty(num_tokens, key_heads, **f32) for _ in range(2))
    if num_tokens:
        bk, bv = (max(16, triton.next_power_of_2(d)) for d in (k_dim, v_dim))
        qk_norm_forward_kernel[(triton.cdiv(num_tokens, TOKEN_BLOCK), heads)](
            q, k, v, g, beta, q_n, k_n, v32, g32, beta32, r_q, r_k, num_tokens, heads, k_dim**-0.5, q.stride(0),
            q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
            beta.stride(0), beta.stride(1), REP=heads // key_heads, K=k_dim, V=v_dim, BT=TOKEN_BLOCK, BK=bk, BV=bv,
            **launch_options("qk_norm_forward"),
        )  # fmt: skip
    return q_n, k_n, v32, g32, beta32, r_q, r_k


def run_forward(q, k, v, g, beta, initial_state, tree, out_dtype, precision: str):
    """fp32 token-major (N, H, K) q_n/k_n, (N, H, V) v, (N, H) g/beta; `initial_state` (S, H, K, V) of the
    roots or None (zeros); `tree` = (offsets, parent, level segments (int32 device), level offsets (host
    int64), chunk offsets, chunk table) -> (o in `out_dtype`, final states (S, H, K, V), chunk states h
    (NT, H, K, V), U, W, T (NT, H, C, C), G (NT, H, C)). `precision`: "tf32" (half inputs) or "tf32x3" (fp32
    inputs); the inverse takes "tf32x3" either way."""
    offsets, parent, level_segments, level_offsets, chunk_cu, table = tree
    num_tokens, heads, k_dim = q.shape
    v_dim, num_seqs, num_chunks = v.shape[-1], offsets.shape[0] - 1, table.shape[0]
    bk, bv = tile_sizes(k_dim, v_dim)
    bs = min(bv, STATE_BLOCK)
    gcum = q.new_empty(num_chunks, heads, CHUNK)
    tinv = q.new_empty(num_chunks, heads, CHUNK, CHUNK)
    w, u, o = torch.empty_like(k), torch.empty_like(v), torch.empty_like(v, dtype=out_dtype)
    h = q.new_empty(num_chunks, heads, k_dim, v_dim)
    final = q.new_empty(num_seqs, heads, k_dim, v_dim)
    sizes = dict(K=k_dim, V=v_dim, C=CHUNK, BK=bk, PRECISION=precision)
    if num_chunks:
        wy_forward_kernel[(num_chunks, heads)](
            k, v, g, beta, offsets, table, gcum, tinv, w, u, heads, BV=bv, INVERSE_PRECISION="tf32x3", **sizes,
            **launch_options("wy_forward"),
        )  # fmt: skip
    h0 = final if initial_state is None else initial_state
    bounds = level_offsets.tolist()
    for begin, end in ((b, e) for b, e in zip(bounds[:-1], bounds[1:], strict=True) if e > b):
        state_forward_kernel[(end - begin, heads, triton.cdiv(v_dim, bs))](
            k, w, u, gcum, h0, offsets, chunk_cu, parent, level_segments, h, final, begin, heads, BV=bs,
            HAS_INITIAL=initial_state is not None, **sizes, **launch_options("state_forward"),
        )  # fmt: skip
    if num_chunks:
        output_forward_kernel[(num_chunks, heads, triton.cdiv(v_dim, bv))](
            q, k, u, gcum, h, offsets, table, o, heads, BV=bv, **sizes, **launch_options("output_forward")
        )
    return o, final, h, u, w, tinv, gcum

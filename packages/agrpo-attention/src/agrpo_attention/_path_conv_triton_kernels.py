"""Triton kernels of the tree path convolution (see `_path_conv_triton.py` for what each computes).

Owns the forward, the backward and the fork-token backward kernels, and the two tile helpers they share:
the pre-activation of a set of tokens (rows) for a block of channels, read through the predecessor table,
and its gradient dP = dOut act'(pre). Every accumulation is fp32; loads widen bf16 and stores round to the
buffer's dtype. Rows are int64 token indices with a validity mask, so the same helpers serve a contiguous
tile (forward, backward) and a gathered list (fork successors). Imports triton at import time (imported
only when a kernel runs). Does not know plans or autograd.

Legend: N = tokens, C = channels, K = taps (constexpr), BT/BE = rows per tile, BC = channels per tile.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pre_activation(x_ptr, pred_ptr, w_ptr, b_ptr, rows, valid, c, cols, C, K: tl.constexpr,
                    HAS_BIAS: tl.constexpr):  # fmt: skip
    """(R, BC) b + sum_j w[:, K-1-j] x[p_j(row)] for `rows` (R,) int64 where `valid`, 0 elsewhere; p_0 = row,
    p_j from the (N, K-1) predecessor table, -1 reading zero."""
    mask = valid[:, None] & cols[None, :]
    tap = tl.load(w_ptr + c * K + (K - 1), mask=cols, other=0.0).to(tl.float32)
    acc = tl.load(x_ptr + rows[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32) * tap[None, :]
    for j in tl.static_range(1, K):
        source = tl.load(pred_ptr + rows * (K - 1) + (j - 1), mask=valid, other=-1).to(tl.int64)
        x = tl.load(x_ptr + source[:, None] * C + c[None, :], mask=mask & (source >= 0)[:, None], other=0.0)
        tap = tl.load(w_ptr + c * K + (K - 1 - j), mask=cols, other=0.0).to(tl.float32)
        acc += x.to(tl.float32) * tap[None, :]
    if HAS_BIAS:
        acc += tl.where(mask, tl.load(b_ptr + c, mask=cols, other=0.0).to(tl.float32)[None, :], 0.0)
    return acc


@triton.jit
def _pre_gradient(x_ptr, pred_ptr, w_ptr, b_ptr, dout_ptr, rows, valid, c, cols, C, K: tl.constexpr,
                  HAS_BIAS: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    """(R, BC) dP = dOut act'(pre) of `rows` where `valid`, 0 elsewhere (SiLU' = s (1 + pre (1 - s)))."""
    mask = valid[:, None] & cols[None, :]
    d_out = tl.load(dout_ptr + rows[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if SILU:
        pre = _pre_activation(x_ptr, pred_ptr, w_ptr, b_ptr, rows, valid, c, cols, C, K, HAS_BIAS)
        sig = tl.sigmoid(pre)
        d_out = d_out * sig * (1.0 + pre * (1.0 - sig))
    return d_out


@triton.jit(do_not_specialize=["N"])
def path_conv_forward_kernel(x_ptr, pred_ptr, w_ptr, b_ptr, out_ptr, N, C, K: tl.constexpr, BT: tl.constexpr,
                             BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    rows = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    valid, cols = rows < N, c < C
    pre = _pre_activation(x_ptr, pred_ptr, w_ptr, b_ptr, rows, valid, c, cols, C, K, HAS_BIAS)
    out = pre * tl.sigmoid(pre) if SILU else pre
    tl.store(out_ptr + rows[:, None] * C + c[None, :], out, mask=valid[:, None] & cols[None, :])


@triton.jit(do_not_specialize=["N"])
def path_conv_backward_kernel(x_ptr, pred_ptr, w_ptr, b_ptr, dout_ptr, dx_ptr, dw_ptr, db_ptr, N, C,
                              K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                              BLOCKS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    """dx of BLOCKS tiles of BT tokens through the successors s + j whose predecessor j is s; partial dw
    (P, K, C) and db (P, C) of this program's tokens (KP: K rounded up to a power of two). Tiles and taps
    are loops, not unrolled, so that only one tap's loads are live at a time."""
    pid = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cols = c < C
    taps = tl.arange(0, KP)
    d_w = tl.zeros((KP, BC), dtype=tl.float32)
    d_b = tl.zeros((BC,), dtype=tl.float32)
    for block in range(BLOCKS):
        rows = ((pid * BLOCKS + block) * BT + tl.arange(0, BT)).to(tl.int64)
        valid = rows < N
        mask = valid[:, None] & cols[None, :]
        d_pre = _pre_gradient(x_ptr, pred_ptr, w_ptr, b_ptr, dout_ptr, rows, valid, c, cols, C, K, HAS_BIAS,
                              SILU)  # fmt: skip
        d_b += tl.sum(d_pre, axis=0)
        own = tl.load(x_ptr + rows[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
        d_w += tl.where(taps[:, None] == K - 1, tl.sum(d_pre * own, axis=0)[None, :], 0.0)
        for i in range(1, K):
            source = tl.load(pred_ptr + rows * (K - 1) + (i - 1), mask=valid, other=-1).to(tl.int64)
            before = tl.load(x_ptr + source[:, None] * C + c[None, :], mask=mask & (source >= 0)[:, None],
                             other=0.0).to(tl.float32)  # fmt: skip
            d_w += tl.where(taps[:, None] == K - 1 - i, tl.sum(d_pre * before, axis=0)[None, :], 0.0)
        tap = tl.load(w_ptr + c * K + (K - 1), mask=cols, other=0.0).to(tl.float32)
        d_x = d_pre * tap[None, :]
        for j in range(1, K):  # on a chain every s + j follows s; at a fork only in the child laid out next
            after = rows + j
            source = tl.load(pred_ptr + after * (K - 1) + (j - 1), mask=valid & (after < N), other=-1)
            follows = valid & (after < N) & (source.to(tl.int64) == rows)
            d_pre = _pre_gradient(x_ptr, pred_ptr, w_ptr, b_ptr, dout_ptr, after, follows, c, cols, C, K,
                                  HAS_BIAS, SILU)  # fmt: skip
            tap = tl.load(w_ptr + c * K + (K - 1 - j), mask=cols, other=0.0).to(tl.float32)
            d_x += d_pre * tap[None, :]
        tl.store(dx_ptr + rows[:, None] * C + c[None, :], d_x, mask=mask)
    tl.store(dw_ptr + (pid * K + taps[:, None]).to(tl.int64) * C + c[None, :], d_w,
             mask=(taps[:, None] < K) & cols[None, :])  # fmt: skip
    tl.store(db_ptr + pid.to(tl.int64) * C + c, d_b, mask=cols)


@triton.jit(do_not_specialize=["N"])
def path_conv_forks_kernel(x_ptr, pred_ptr, w_ptr, b_ptr, dout_ptr, fork_ptr, fork_cu_ptr, succ_ptr, dx_ptr, N,
                           C, K: tl.constexpr, BE: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
                           SILU: tl.constexpr):  # fmt: skip
    """dx of one fork token s: sum over its successor list (t, j) (itself as (s, 0)) of w[:, K-1-j] dP_t."""
    pid = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cols = c < C
    token = tl.load(fork_ptr + pid).to(tl.int64)
    entry = tl.load(fork_cu_ptr + pid)
    last = tl.load(fork_cu_ptr + pid + 1)
    d_x = tl.zeros((BC,), dtype=tl.float32)
    while entry < last:
        index = entry + tl.arange(0, BE)
        listed = index < last
        after = tl.load(succ_ptr + 2 * index, mask=listed, other=0).to(tl.int64)
        step = tl.load(succ_ptr + 2 * index + 1, mask=listed, other=0)
        d_pre = _pre_gradient(x_ptr, pred_ptr, w_ptr, b_ptr, dout_ptr, after, listed, c, cols, C, K, HAS_BIAS,
                              SILU)  # fmt: skip
        tap = tl.load(w_ptr + c[None, :] * K + (K - 1 - step)[:, None], mask=listed[:, None] & cols[None, :],
                      other=0.0).to(tl.float32)  # fmt: skip
        d_x += tl.sum(d_pre * tap, axis=0)
        entry += BE
    tl.store(dx_ptr + token * C + c, d_x, mask=cols)

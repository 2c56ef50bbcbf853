"""The tiles the Triton delta-rule kernels read and write, and the chunk-local decay masks they share.

Owns how a kernel sees one chunk of one head: rows of a token-major (N, H, width) tensor as fp32 (bf16
storage is widened on load), zero past the sequence's end (a chunk never reads the next sequence's
tokens), either as (C, W) or loaded directly as its transpose (W, C); stores that round to the buffer's
dtype; a (K, V) state tile of a per-chunk or per-segment state buffer, optionally loaded only when a flag
holds; the gate's cumulative sum and
its reverse within a chunk; and exp(G_i - G_j) under a mask, with the masked entries' exponent set to
-inf so that no overflow ever meets a zero. Nothing here transposes the result of a `tl.dot`: Triton
3.4-3.7.0 miscompiles that pattern on Hopper (fla issue #640), so every transpose the kernels need is
either a load with swapped strides or a round trip through global scratch. Imports triton at import time;
only the kernel modules import it, and only when a kernel runs. Does not know the recurrence.

Legend: N = tokens, H = heads, C = chunk size, W = tile width (a power of two >= 16), K/V = head dims.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_rows(ptr, start, n_valid, head, col0, H, WIDTH: tl.constexpr, C: tl.constexpr, W: tl.constexpr):
    """(C, W): rows start..start+C, columns col0..col0+W of head `head` of a (N, H, WIDTH) tensor."""
    r = tl.arange(0, C)
    c = col0 + tl.arange(0, W)
    offsets = (start + r[:, None]).to(tl.int64) * (H * WIDTH) + head * WIDTH + c[None, :]
    return tl.load(ptr + offsets, mask=(r[:, None] < n_valid) & (c[None, :] < WIDTH), other=0.0).to(
        tl.float32
    )


@triton.jit
def chunk_cols(ptr, start, n_valid, head, col0, H, WIDTH: tl.constexpr, C: tl.constexpr, W: tl.constexpr):
    """(W, C): the transpose of `chunk_rows`, loaded with swapped strides."""
    r = tl.arange(0, C)
    c = col0 + tl.arange(0, W)
    offsets = (start + r[None, :]).to(tl.int64) * (H * WIDTH) + head * WIDTH + c[:, None]
    return tl.load(ptr + offsets, mask=(r[None, :] < n_valid) & (c[:, None] < WIDTH), other=0.0).to(
        tl.float32
    )


@triton.jit
def store_chunk_rows(ptr, value, start, n_valid, head, col0, H, WIDTH: tl.constexpr, C: tl.constexpr,
                     W: tl.constexpr):  # fmt: skip
    """Store a (C, W) tile where `chunk_rows` reads it, valid rows and columns only, in the buffer's dtype."""
    r = tl.arange(0, C)
    c = col0 + tl.arange(0, W)
    offsets = (start + r[:, None]).to(tl.int64) * (H * WIDTH) + head * WIDTH + c[None, :]
    tl.store(ptr + offsets, value, mask=(r[:, None] < n_valid) & (c[None, :] < WIDTH))


@triton.jit
def chunk_vector(ptr, start, n_valid, head, H, C: tl.constexpr):
    """(C,): a per-token, per-head scalar (gate, beta) of a (N, H) tensor, zero past the sequence end."""
    r = tl.arange(0, C)
    return tl.load(ptr + (start + r).to(tl.int64) * H + head, mask=r < n_valid, other=0.0).to(tl.float32)


@triton.jit
def store_chunk_vector(ptr, value, start, n_valid, head, H, C: tl.constexpr):
    r = tl.arange(0, C)
    tl.store(ptr + (start + r).to(tl.int64) * H + head, value, mask=r < n_valid)


@triton.jit
def chunk_position(table_ptr, cu_ptr, pid, C: tl.constexpr):
    """(sequence or -1 past the last chunk, first token, tokens in the chunk) of chunk `pid` of the table."""
    seq = tl.load(table_ptr + 2 * pid)
    start = tl.load(cu_ptr + tl.maximum(seq, 0)) + tl.load(table_ptr + 2 * pid + 1) * C
    return seq, start, tl.minimum(tl.load(cu_ptr + tl.maximum(seq, 0) + 1) - start, C)


@triton.jit
def chunk_gates(gcum_ptr, chunk, head, H, C: tl.constexpr):
    """(C,) cumulative gate of a chunk (padded rows repeat the last valid value), and its last entry."""
    base = (chunk.to(tl.int64) * H + head) * C
    return tl.load(gcum_ptr + base + tl.arange(0, C)), tl.load(gcum_ptr + base + C - 1)


@triton.jit
def state_offsets(index, head, col0, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """(BK, BV) offsets and mask of rows 0..K, columns col0.. of state [index, head] of a (X, H, K, V) buffer."""
    rk = tl.arange(0, BK)
    cv = col0 + tl.arange(0, BV)
    base = (index.to(tl.int64) * H + head) * (K * V)
    return base + rk[:, None] * V + cv[None, :], (rk[:, None] < K) & (cv[None, :] < V)


@triton.jit
def load_state(
    ptr, index, head, col0, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr
):
    offsets, mask = state_offsets(index, head, col0, H, K, V, BK, BV)
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def load_state_if(ptr, valid, index, head, col0, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr):  # fmt: skip
    """`load_state` where the scalar `valid` holds, zeros elsewhere (index is clamped to 0 then)."""
    offsets, mask = state_offsets(tl.maximum(index, 0), head, col0, H, K, V, BK, BV)
    return tl.load(ptr + offsets, mask=mask & valid, other=0.0)


@triton.jit
def store_state(ptr, value, index, head, col0, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr):  # fmt: skip
    offsets, mask = state_offsets(index, head, col0, H, K, V, BK, BV)
    tl.store(ptr + offsets, value, mask=mask)


@triton.jit
def square_offsets(index, head, H, C: tl.constexpr, TRANSPOSED: tl.constexpr):
    """(C, C) offsets of matrix [index, head] of a (X, H, C, C) buffer, or of its transpose."""
    r = tl.arange(0, C)
    base = (index.to(tl.int64) * H + head) * (C * C)
    if TRANSPOSED:
        return base + r[None, :] * C + r[:, None]
    return base + r[:, None] * C + r[None, :]


@triton.jit
def cumulative(x, C: tl.constexpr):
    """(C,) inclusive prefix sum, as a masked (C, C) reduction: no scan primitive, same code in the interpreter."""
    r = tl.arange(0, C)
    return tl.sum(tl.where(r[:, None] >= r[None, :], x[None, :], 0.0), axis=1)


@triton.jit
def reverse_cumulative(x, C: tl.constexpr):
    """(C,) suffix sum: out_j = sum_{i >= j} x_i (the adjoint of `cumulative`)."""
    r = tl.arange(0, C)
    return tl.sum(tl.where(r[:, None] >= r[None, :], x[:, None], 0.0), axis=0)


@triton.jit
def decay(g_rows, g_cols, mask):
    """(C, C) exp(g_rows[i] - g_cols[j]) where `mask`, else 0 (the exponent is -inf there, never overflowing)."""
    return tl.exp(tl.where(mask, g_rows[:, None] - g_cols[None, :], float("-inf")))

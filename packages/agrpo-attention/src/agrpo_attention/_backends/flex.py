"""The FlexAttention backend: one fused kernel over the packed row, masked by the tree.

Owns the block mask: key j is visible to query i iff `j <= i < subtree_end[j]`, i.e. j's segment is
an ancestor of (or is) i's segment and j is not after i. The mask's block lists are computed straight
from the tree with a few tensor ops (`create_block_mask(_compile=True)` took 41 s to compile on the
H200 machine, per row shape). No K/V is copied; blocks the mask leaves empty are skipped, so a shared
prompt is read once by every completion below it. On CUDA the kernel
is compiled through Triton once (dynamic shapes), on CPU it runs FlexAttention's unfused eager path,
forward only (torch has no CPU backward; training through it is refused, naming `reference`).
Supports logit softcapping through a score_mod. Sliding windows: one block mask per distinct window, its mask
adding `depth[j] > depth[i] - W` (depth = position on the path), its block lists computed exactly from the
tree (per query segment and ancestor segment, a band of keys per query block), so a windowed layer skips every
block outside its window and costs what it attends. Attention sinks enter through the log-sum-exp: with the
keys' softmax output O and log-sum-exp L, the sink's share of the mass is sigmoid(s - L), so the output is
O * sigmoid(L - s); gradients reach the sinks and, through L, the scores. Does not know transformers.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .._exceptions import BackendUnavailableError
from .._tree_layout import TreeLayout, host_to_device, token_depths

_BLOCK = 128


def _needs_backward(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


@functools.cache
def _softcap_score_mod(softcap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def _lse_request(wanted: bool) -> dict:
    """flex_attention's keywords asking for the log-sum-exp (`return_aux` where torch has it, else `return_lse`)."""
    if not wanted:
        return {}
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def _block_lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q blocks, KV blocks) bool -> per query block: count and (listed first) indices of True kv blocks."""
    counts = blocks.sum(dim=1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int32), dim=1, descending=True, stable=True).to(torch.int32)
    # The Triton kernel reads these row-major: argsort of a transposed input keeps its column-major
    # strides, which the CPU path tolerates and the GPU kernel silently misreads.
    return counts[None, None].contiguous(), order[None, None].contiguous()


def _window_block_pairs(layout: TreeLayout, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(KV blocks, Q blocks) bool arrays (any pair visible, every pair visible) of `layout` under a window.

    For each query segment t and each segment a on its path, a query at depth d sees a's keys at depths
    (d - window, d]; over one query block of t (depths d0..d1) those are a's keys at depths
    max(first of a, d0 - window + 1) .. min(last of a, d1), a contiguous band of positions (host numpy)."""
    q_off = layout.host_offsets[0].numpy()
    lq, lk = np.diff(layout.host_offsets[:2].numpy(), axis=1)
    first_depth, parent = lk - lq, layout.segment_parent_host
    seg_t, seg_a, pairs_t, pairs_a = np.arange(lq.shape[0]), np.arange(lq.shape[0]), [], []
    while seg_a.size:  # every (segment, ancestor-or-self) pair, one tree level at a time
        pairs_t.append(seg_t)
        pairs_a.append(seg_a)
        up = parent[seg_a] >= 0
        seg_t, seg_a = seg_t[up], parent[seg_a[up]]
    t, a = np.concatenate(pairs_t), np.concatenate(pairs_a)
    t, a = t[lq[t] > 0], a[lq[t] > 0]
    first_qb, last_qb = q_off[t] // _BLOCK, (q_off[t + 1] - 1) // _BLOCK
    per_pair = last_qb - first_qb + 1
    t, a = np.repeat(t, per_pair), np.repeat(a, per_pair)
    qb = (
        np.repeat(first_qb, per_pair)
        + np.arange(per_pair.sum())
        - np.repeat(np.cumsum(per_pair) - per_pair, per_pair)
    )
    p0, p1 = np.maximum(qb * _BLOCK, q_off[t]), np.minimum(qb * _BLOCK + _BLOCK, q_off[t + 1]) - 1
    d0, d1 = first_depth[t] + p0 - q_off[t], first_depth[t] + p1 - q_off[t]
    a_first, a_last = first_depth[a], first_depth[a] + lq[a] - 1
    lo, hi = np.maximum(a_first, d0 - window + 1), np.minimum(a_last, d1)  # keys some query of the block sees
    num_blocks = -(-layout.num_tokens // _BLOCK)
    seen = lo <= hi
    any_diff = np.zeros((num_blocks, num_blocks + 1), dtype=np.int32)  # (q block, kv block) difference array
    np.add.at(any_diff, (qb[seen], (q_off[a] + lo - a_first)[seen] // _BLOCK), 1)
    np.add.at(any_diff, (qb[seen], (q_off[a] + hi - a_first)[seen] // _BLOCK + 1), -1)
    # Every query of a block wholly inside t sees a's keys at depths max(a_first, d1 - window + 1)..min(a_last, d0).
    all_lo, all_hi = np.maximum(a_first, d1 - window + 1), np.minimum(a_last, d0)
    first_kb = -(-(q_off[a] + all_lo - a_first) // _BLOCK)  # kv blocks lying wholly inside that band
    end_kb = (q_off[a] + all_hi - a_first + 1) // _BLOCK
    whole = (p1 - p0 + 1 == _BLOCK) & (all_lo <= all_hi) & (first_kb < end_kb)
    full_diff = np.zeros_like(any_diff)
    np.add.at(full_diff, (qb[whole], first_kb[whole]), 1)
    np.add.at(full_diff, (qb[whole], end_kb[whole]), -1)
    any_visible = any_diff.cumsum(axis=1)[:, :num_blocks] > 0
    full = full_diff.cumsum(axis=1)[:, :num_blocks] > 0
    return any_visible.T, full.T


def tree_block_mask(layout: TreeLayout, window: int | None = None):
    """The BlockMask of `layout`'s ancestor relation, built directly from the tree (no mask compile).

    Key j is visible to queries [j, subtree_end[j]), so kv block b reaches query blocks j // 128 ..
    (subtree_end[j] - 1) // 128 for each j in b (a difference array gives their union); a block pair is
    full when every query follows every key and precedes every key's subtree end."""
    from torch.nn.attention.flex_attention import BlockMask

    n, device = layout.num_tokens, layout.subtree_end.device
    num_blocks = -(-n // _BLOCK)
    ends = torch.full((num_blocks * _BLOCK + _BLOCK,), -1, dtype=torch.int64, device=device)
    ends[:n] = layout.subtree_end
    positions = torch.arange(n, device=device)
    reach = torch.zeros(num_blocks, num_blocks + 1, dtype=torch.int32, device=device)
    ones = torch.ones(n, dtype=torch.int32, device=device)
    reach.index_put_((positions // _BLOCK, positions // _BLOCK), ones, accumulate=True)
    reach.index_put_((positions // _BLOCK, (layout.subtree_end - 1) // _BLOCK + 1), -ones, accumulate=True)
    any_visible = reach.cumsum(dim=1)[:, :num_blocks] > 0  # (kv block, q block)
    blocks = torch.arange(num_blocks, device=device)
    q_last = blocks * _BLOCK + _BLOCK - 1
    min_end = ends[: num_blocks * _BLOCK].view(num_blocks, _BLOCK).min(dim=1).values
    full = (blocks[None, :] > blocks[:, None]) & (q_last[None, :] < min_end[:, None]) & (q_last[None, :] < n)
    if window is not None:  # the window's own block lists; the ancestor test stays in the mask below
        any_np, full_np = _window_block_pairs(layout, window)
        any_visible, full = (
            host_to_device(torch.from_numpy(x), device, non_blocking=True) for x in (any_np, full_np)
        )
        depth = host_to_device(torch.from_numpy(token_depths(layout)), device, non_blocking=True)
    partial_num, partial_index = _block_lists((any_visible & ~full).t())
    full_num, full_index = _block_lists(full.t())

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < ends[kv_idx])

    def window_mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < ends[kv_idx]) & (depth[kv_idx] > depth[q_idx] - window)

    return BlockMask.from_kv_blocks(
        partial_num,
        partial_index,
        full_num,
        full_index,
        _BLOCK,
        mask_mod if window is None else window_mask_mod,
        seq_lengths=(n, n),
    )


def tree_block_masks(layout: TreeLayout, windows=()) -> dict[int | None, object]:
    """Block masks by window (None: no window); a window no shorter than every path reuses the plain mask."""
    masks: dict[int | None, object] = {None: tree_block_mask(layout)}
    for window in windows:
        masks[window] = masks[None] if window >= layout.max_k else tree_block_mask(layout, window)
    return masks


class FlexBackend:
    """torch.nn.attention.flex_attention with the tree's block mask."""

    name = "flex"
    supports_softcap = True
    supports_window = True
    supports_sinks = True
    input_dtypes = None
    forward_only_on = ("cpu",)  # FlexAttention's eager CPU path has no backward
    under_compile = "trace"  # flex_attention is a higher-order op; the block mask's tensors are graph inputs

    def unavailable_reason(self, device: torch.device) -> str | None:
        try:
            import torch.nn.attention.flex_attention
        except ImportError:
            return f"torch {torch.__version__} has no FlexAttention; install torch>=2.5"
        return None

    def prepare(self, layout: TreeLayout, *, windows=(), sinks=False) -> dict[int | None, object]:
        return tree_block_masks(layout, windows)

    def attend(
        self, query, key, value, layout: TreeLayout, state, *, scaling, softcap, window=None, sinks=None
    ):
        if query.device.type in self.forward_only_on and _needs_backward(query, key, value):
            raise BackendUnavailableError(
                f"backend='flex' has no backward on {query.device.type} (FlexAttention runs forward only "
                "there): enable_tree_attention(model, backend='reference') to train on CPU, or run this "
                "forward under torch.no_grad()"
            )
        if torch.compiler.is_compiling():  # inside a compiled layer: its graph takes the op in directly
            from torch.nn.attention.flex_attention import flex_attention as flex
        elif query.device.type == "cuda":
            flex = _compiled_flex_attention()
        else:
            from torch.nn.attention.flex_attention import flex_attention as flex
        if window not in state:  # a window the model's attention modules did not declare (eager only)
            if torch.compiler.is_compiling():
                raise BackendUnavailableError(
                    f"a sliding window of {window} reached tree attention without a prepared block mask; "
                    "report this model: its attention modules do not expose their window"
                )
            state[window] = tree_block_masks(layout, (window,))[window]
        out = flex(
            query,
            key,
            value,
            score_mod=_softcap_score_mod(softcap) if softcap else None,
            block_mask=state[window],
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
            **_lse_request(sinks is not None),
        )
        if sinks is not None:
            out, aux = out
            lse = getattr(aux, "lse", aux)
            keys_share = torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None])  # (1, Hq, N) fp32
            out = (out * keys_share[..., None]).to(out.dtype)
        return out.transpose(1, 2)

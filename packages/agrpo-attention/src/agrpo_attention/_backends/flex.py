"""The FlexAttention backend: one fused kernel over the packed row, masked by the tree.

Owns the block mask: key j is visible to query i iff `j <= i < subtree_end[j]`, i.e. j's segment is
an ancestor of (or is) i's segment and j is not after i. The mask's block lists are computed straight
from the tree with a few tensor ops (`create_block_mask(_compile=True)` took 41 s to compile on the
H200 machine, per row shape). No K/V is copied; blocks the mask leaves empty are skipped, so a shared
prompt is read once by every completion below it. On CUDA the kernel
is compiled through Triton once (dynamic shapes), on CPU it runs FlexAttention's unfused eager path,
forward only (torch has no CPU backward; training through it is refused, naming `reference`).
Supports logit softcapping through a score_mod. Does not know transformers.
"""

from __future__ import annotations

import functools

import torch

from .._exceptions import BackendUnavailableError
from .._tree_layout import TreeLayout

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


def _block_lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q blocks, KV blocks) bool -> per query block: count and (listed first) indices of True kv blocks."""
    counts = blocks.sum(dim=1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int32), dim=1, descending=True, stable=True).to(torch.int32)
    # The Triton kernel reads these row-major: argsort of a transposed input keeps its column-major
    # strides, which the CPU path tolerates and the GPU kernel silently misreads.
    return counts[None, None].contiguous(), order[None, None].contiguous()


def tree_block_mask(layout: TreeLayout):
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
    partial_num, partial_index = _block_lists((any_visible & ~full).t())
    full_num, full_index = _block_lists(full.t())

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < ends[kv_idx])

    return BlockMask.from_kv_blocks(
        partial_num, partial_index, full_num, full_index, _BLOCK, mask_mod, seq_lengths=(n, n)
    )


class FlexBackend:
    """torch.nn.attention.flex_attention with the tree's block mask."""

    name = "flex"
    supports_softcap = True
    input_dtypes = None
    forward_only_on = ("cpu",)  # FlexAttention's eager CPU path has no backward
    under_compile = "trace"  # flex_attention is a higher-order op; the block mask's tensors are graph inputs

    def unavailable_reason(self, device: torch.device) -> str | None:
        try:
            import torch.nn.attention.flex_attention
        except ImportError:
            return f"torch {torch.__version__} has no FlexAttention; install torch>=2.5"
        return None

    def prepare(self, layout: TreeLayout) -> object:
        return tree_block_mask(layout)

    def attend(self, query, key, value, layout: TreeLayout, state, *, scaling, softcap):
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
        out = flex(
            query,
            key,
            value,
            score_mod=_softcap_score_mod(softcap) if softcap else None,
            block_mask=state,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2)

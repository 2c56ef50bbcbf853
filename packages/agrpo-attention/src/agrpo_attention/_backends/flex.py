"""The FlexAttention backend: one fused kernel over the packed row, masked by the tree.

Owns the block mask: key j is visible to query i iff `j <= i < subtree_end[j]`, i.e. j's segment is
an ancestor of (or is) i's segment and j is not after i. No K/V is copied; blocks the mask leaves
empty are skipped, so a shared prompt is read once by every completion below it. On CUDA the kernel
is compiled through Triton once (dynamic shapes), on CPU it runs FlexAttention's unfused eager path
(tests only). Supports logit softcapping through a score_mod. Does not know transformers.
"""

from __future__ import annotations

import functools

import torch

from .._tree_layout import TreeLayout

_BLOCK = 128


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


@functools.cache
def _softcap_score_mod(softcap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def tree_block_mask(layout: TreeLayout):
    """The BlockMask of `layout`'s ancestor relation."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = layout.num_tokens
    device = layout.subtree_end.device
    padded = -(-n // _BLOCK) * _BLOCK + _BLOCK
    ends = torch.full((padded,), -1, dtype=torch.int64, device=device)
    ends[:n] = layout.subtree_end

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < ends[kv_idx])

    return create_block_mask(mask_mod, None, None, n, n, device=device, _compile=device.type == "cuda")


class FlexBackend:
    """torch.nn.attention.flex_attention with the tree's block mask."""

    name = "flex"
    supports_softcap = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        try:
            import torch.nn.attention.flex_attention
        except ImportError:
            return f"torch {torch.__version__} has no FlexAttention; install torch>=2.5"
        return None

    def prepare(self, layout: TreeLayout) -> object:
        return tree_block_mask(layout)

    def attend(self, query, key, value, layout: TreeLayout, state, *, scaling, softcap):
        if query.device.type == "cuda":
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

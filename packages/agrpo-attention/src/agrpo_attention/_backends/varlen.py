"""The torch varlen backend: gathered path K/V through `torch.nn.attention.varlen.varlen_attn`.

Owns the call into torch's own variable-length flash attention (FA2 kernels shipped with CUDA torch,
no download). Its keyword set moved between torch releases (`is_causal=` early, `window_size=(-1, 0)`
later; `enable_gqa=` only in some), so the call adapts to the installed signature once. No softcap.
Does not know the gather (see `path_gather.py`).
"""

from __future__ import annotations

import functools
import inspect

import torch

from .._tree_layout import TreeLayout
from .path_gather import GatheredPathBackend


@functools.cache
def _varlen_keywords() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _causal_keywords(num_q_heads: int, num_kv_heads: int) -> dict:
    keywords = _varlen_keywords()
    extra: dict = {"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True}
    if "enable_gqa" in keywords and num_q_heads != num_kv_heads:
        extra["enable_gqa"] = True
    return extra


class VarlenBackend(GatheredPathBackend):
    """torch.nn.attention.varlen.varlen_attn over gathered paths (CUDA only)."""

    name = "varlen"
    supports_softcap = False

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return (
                f"varlen_attn runs on CUDA only, the model is on {device}; use backend='reference' or 'flex'"
            )
        try:
            import torch.nn.attention.varlen
        except ImportError:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen; install torch>=2.10"
        return None

    def _kernel(self, q, k, v, layout: TreeLayout, *, scaling, softcap):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(
            q,
            k,
            v,
            layout.q_offsets,
            layout.kv_offsets,
            layout.max_q,
            layout.max_k,
            scale=scaling,
            **_causal_keywords(q.shape[1], k.shape[1]),
        )

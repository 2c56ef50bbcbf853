"""The aiter backend: gathered path K/V through AMD aiter's varlen flash attention (ROCm).

Owns finding aiter (`import aiter` on a ROCm build of torch). Supports softcap (`logits_soft_cap`).
Untested on this project's machines (no AMD GPU). Does not know the gather (see `path_gather.py`).
"""

from __future__ import annotations

import importlib.util

import torch

from .._tree_layout import TreeLayout
from .path_gather import GatheredPathBackend


class AiterBackend(GatheredPathBackend):
    """aiter.flash_attn_varlen_func over gathered paths (ROCm GPUs)."""

    name = "aiter"
    under_compile = "eager"  # untested under torch.compile (no kernel on this project's machines)
    supports_softcap = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda" or torch.version.hip is None:
            return f"aiter needs an AMD GPU with ROCm torch, the model is on {device}"
        if importlib.util.find_spec("aiter") is None:
            return "aiter is not installed: pip install amd-aiter (ROCm)"
        return None

    def _kernel(self, q, k, v, layout: TreeLayout, *, scaling, softcap, window=None):
        import aiter

        out = aiter.flash_attn_varlen_func(
            q,
            k,
            v,
            layout.q_offsets,
            layout.kv_offsets,
            layout.max_q,
            layout.max_k,
            dropout_p=0.0,
            softmax_scale=scaling,
            logits_soft_cap=softcap or 0.0,
            causal=True,
        )
        return out[0] if isinstance(out, tuple) else out

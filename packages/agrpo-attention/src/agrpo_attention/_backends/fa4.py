"""The FA4 backend: gathered path K/V through FlashAttention-4's CuTe varlen kernel (Blackwell).

Owns finding FA4 (`flash_attn.cute`, package `flash-attn-4` plus its CUTLASS DSL libraries). Supports
softcap. Untested on this project's machines: the DSL libraries are too large to carry to the H200
machine (see docs/benchmarks.md). Does not know the gather (see `path_gather.py`).
"""

from __future__ import annotations

import importlib.util

import torch

from .._tree_layout import TreeLayout
from .path_gather import GatheredPathBackend, flash_varlen


class FA4Backend(GatheredPathBackend):
    """flash_attn.cute.flash_attn_varlen_func over gathered paths (CUDA, compute capability >= 10)."""

    name = "fa4"
    under_compile = "eager"  # untested under torch.compile (no kernel on this project's machines)
    supports_softcap = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda" or torch.version.cuda is None:
            return f"FA4 needs an NVIDIA GPU, the model is on {device}"
        if torch.cuda.get_device_capability(device)[0] < 10:
            return "FA4 targets Blackwell (compute capability >= 10); on Hopper use 'fa3', 'flex' or 'varlen'"
        if (
            importlib.util.find_spec("flash_attn") is None
            or importlib.util.find_spec("flash_attn.cute") is None
        ):
            return "FA4 is not installed: pip install flash-attn-4"
        return None

    def _kernel(self, q, k, v, layout: TreeLayout, *, scaling, softcap, window=None):
        from flash_attn.cute import flash_attn_varlen_func

        return flash_varlen(flash_attn_varlen_func, q, k, v, layout, scaling=scaling, softcap=softcap)

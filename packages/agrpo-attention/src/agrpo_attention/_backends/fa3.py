"""The FA3 backend: gathered path K/V through FlashAttention-3's varlen kernel (Hopper).

Owns finding FA3: an installed `flash_attn_interface` (the flash-attention `hopper/` build) first,
else the `kernels` package's hub build `kernels-community/flash-attn3` when `kernels` is installed
(it downloads on first use). Supports softcap. Untested on this project's machines (no FA3 wheel
exists for them; see docs/benchmarks.md): it follows the FA3 varlen signature, where `causal=True`
with Lq < Lk is aligned bottom-right. Does not know the gather (see `path_gather.py`).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from .._tree_layout import TreeLayout
from .path_gather import GatheredPathBackend, flash_varlen

_HUB_REPO = "kernels-community/flash-attn3"


@functools.cache
def _fa3_varlen():
    if importlib.util.find_spec("flash_attn_interface") is not None:
        from flash_attn_interface import flash_attn_varlen_func

        return flash_attn_varlen_func
    from kernels import get_kernel

    return get_kernel(_HUB_REPO).flash_attn_varlen_func


class FA3Backend(GatheredPathBackend):
    """flash_attn_varlen_func of FlashAttention-3 over gathered paths (CUDA, compute capability 9.x)."""

    name = "fa3"
    under_compile = "eager"  # untested under torch.compile (no kernel on this project's machines)
    supports_softcap = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda" or torch.version.cuda is None:
            return f"FA3 needs an NVIDIA GPU, the model is on {device}"
        if torch.cuda.get_device_capability(device)[0] != 9:
            return "FA3 runs on Hopper (compute capability 9.x) only; use 'fa4', 'flex' or 'varlen'"
        if not any(importlib.util.find_spec(m) for m in ("flash_attn_interface", "kernels")):
            return "FA3 is not installed: install flash-attn's hopper build or the `kernels` package"
        return None

    def _kernel(self, q, k, v, layout: TreeLayout, *, scaling, softcap, window=None):
        return flash_varlen(_fa3_varlen(), q, k, v, layout, scaling=scaling, softcap=softcap)

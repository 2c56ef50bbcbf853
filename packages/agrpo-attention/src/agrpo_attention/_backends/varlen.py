"""The torch varlen backend: gathered path K/V through `torch.nn.attention.varlen.varlen_attn`.

Owns the call into torch's own variable-length flash attention (FA2 kernels shipped with CUDA torch,
no download). Its keyword set moved between torch releases (`is_causal=` early, `window_size=(-1, 0)`
later; `enable_gqa=` only in some), so the call adapts to the installed signature, read once by `prepare`
(eagerly, at plan time): inside a compiled decoder layer dynamo then reads a stored set instead of
tracing `inspect.signature`. varlen_attn is a torch custom op (`torch_attn::_varlen_attn`, its sizes and
maxima SymInts), so it traces into a compiled layer as one opaque call. Sliding windows through its
`window_size` (W - 1 keys back, none ahead: a path's index is the token's depth, so this is exactly the last W
tokens of the path). No softcap, no sinks. Does not know the gather (see `path_gather.py`).
"""

from __future__ import annotations

import inspect

import torch

from .._exceptions import BackendUnavailableError
from .._tree_layout import TreeLayout
from .path_gather import GatheredPathBackend

_SIGNATURE: list[frozenset[str]] = []
"""varlen_attn's keyword names, read on first use (a plain list, which dynamo reads as a constant)."""


def _varlen_keywords() -> frozenset[str]:
    if not _SIGNATURE:
        from torch.nn.attention.varlen import varlen_attn

        _SIGNATURE.append(frozenset(inspect.signature(varlen_attn).parameters))
    return _SIGNATURE[0]


def _causal_keywords(num_q_heads: int, num_kv_heads: int, window: int | None = None) -> dict:
    keywords = _varlen_keywords()
    if "window_size" in keywords:
        extra: dict = {"window_size": (window - 1 if window else -1, 0)}
    elif window:
        raise BackendUnavailableError(
            f"torch {torch.__version__}'s varlen_attn takes no window_size: use backend='flex' or torch>=2.11"
        )
    else:
        extra = {"is_causal": True}
    if "enable_gqa" in keywords and num_q_heads != num_kv_heads:
        extra["enable_gqa"] = True
    return extra


class VarlenBackend(GatheredPathBackend):
    """torch.nn.attention.varlen.varlen_attn over gathered paths (CUDA only)."""

    name = "varlen"
    supports_softcap = False
    supports_window = True

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

    def prepare(self, layout: TreeLayout, *, windows=(), sinks=False) -> object:
        _varlen_keywords()  # read the signature here, eagerly, not inside a compiled layer
        return None

    def _kernel(self, q, k, v, layout: TreeLayout, *, scaling, softcap, window=None):
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
            **_causal_keywords(q.shape[1], k.shape[1], window),
        )

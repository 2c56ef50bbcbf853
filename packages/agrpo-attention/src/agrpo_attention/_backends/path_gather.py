"""`GatheredPathBackend`: the shared half of every gather-then-varlen backend (torch varlen, FA3, FA4, aiter).

Owns the gather: each segment's root-to-segment path K/V is copied out with `kv_index` into one
(P, Hkv, D) buffer, so a single variable-length causal call (cu_seqlens_q = q_offsets, cu_seqlens_k =
kv_offsets, aligned bottom-right, which is the flash-attention convention) computes every segment.
Cost: P ~ the raw (unshared) token count of K/V rows copied per layer, and the same scatter-add in
backward; skipped when the row shares nothing. Does not know any particular kernel: subclasses
supply `_kernel`. Sliding windows: torch's varlen takes them; FA3, FA4 and aiter's kernels take a window too,
but no kernel of theirs runs on this project's machines, so they claim none (`supports_window` False) and
"auto" passes them over for windowed models rather than run an untested path.

Legend: N = packed tokens, P = total path length, Hq/Hkv = heads, D = head dim.
"""

from __future__ import annotations

import torch

from .._exceptions import UnsupportedModelError
from .._tree_layout import TreeLayout


def refuse_unsupported(backend, window: int | None, sinks: torch.Tensor | None) -> None:
    """Raise when a backend is handed a window or sinks it does not implement (`enable_tree_attention` refuses
    such models first; this guards plans built without a model)."""
    if (window and not backend.supports_window) or (sinks is not None and not backend.supports_sinks):
        feature = (
            f"a sliding window ({window})" if window and not backend.supports_window else "attention sinks"
        )
        raise UnsupportedModelError(
            f"backend={backend.name!r} does not implement {feature}; use backend='flex' (CUDA) or 'reference'"
        )


def gather_paths(
    key: torch.Tensor, value: torch.Tensor, layout: TreeLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """key/value (1, Hkv, N, D) -> path K/V (P, Hkv, D) each."""
    k_nhd, v_nhd = key[0].transpose(0, 1), value[0].transpose(0, 1)
    if layout.is_flat:
        return k_nhd.contiguous(), v_nhd.contiguous()
    return k_nhd.index_select(0, layout.kv_index), v_nhd.index_select(0, layout.kv_index)


def flash_varlen(kernel, q, k, v, layout: TreeLayout, *, scaling, softcap) -> torch.Tensor:
    """Call a flash-attention-style `flash_attn_varlen_func` (FA3 and FA4 share the keyword signature)."""
    out = kernel(
        q,
        k,
        v,
        cu_seqlens_q=layout.q_offsets,
        cu_seqlens_k=layout.kv_offsets,
        max_seqlen_q=layout.max_q,
        max_seqlen_k=layout.max_k,
        softmax_scale=scaling,
        causal=True,
        softcap=softcap or 0.0,
    )
    return out[0] if isinstance(out, tuple) else out  # some builds also return the log-sum-exp


class GatheredPathBackend:
    """Gathers path K/V, then calls one varlen kernel; subclasses name it and implement `_kernel`."""

    name = "gathered"
    supports_softcap = False
    supports_window = False
    """Whether `_kernel` takes a sliding window (path index = depth, so a flash window (W - 1, 0) is exact)."""
    supports_sinks = False
    input_dtypes: tuple[torch.dtype, ...] | None = (torch.float16, torch.bfloat16)
    """Flash varlen kernels (FA2/3/4, aiter) run half precision only."""
    forward_only_on: tuple[str, ...] = ()
    under_compile = "trace"
    """torch's varlen_attn is a custom op with its own backward; FA3/FA4/aiter override this."""

    def unavailable_reason(self, device: torch.device) -> str | None:
        raise NotImplementedError

    def prepare(self, layout: TreeLayout, *, windows=(), sinks=False) -> object:
        return None

    def attend(
        self, query, key, value, layout: TreeLayout, state, *, scaling, softcap, window=None, sinks=None
    ):
        refuse_unsupported(self, window, sinks)
        q = query[0].transpose(0, 1).contiguous()  # (N, Hq, D)
        k, v = gather_paths(key, value, layout)
        out = self._kernel(q, k, v, layout, scaling=scaling, softcap=softcap, window=window)
        return out.unsqueeze(0)  # (1, N, Hq, D)

    def _kernel(self, q, k, v, layout: TreeLayout, *, scaling, softcap, window=None) -> torch.Tensor:
        """q (N, Hq, D), k/v (P, Hkv, D) -> (N, Hq, D), causal bottom-right per segment, within the last `window`
        keys of each path when given."""
        raise NotImplementedError

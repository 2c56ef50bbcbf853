"""The tree attention custom op: how a backend that dynamo cannot trace runs inside a compiled decoder layer.

Owns `agrpo::tree_attention` and its backward `agrpo::tree_attention_backward`, two `torch.library`
custom ops that take a row's layout as tensors (`TreeLayout.host_offsets` carries the host-side offsets,
so nothing syncs with the device) and the backend by name. To torch.compile they are opaque calls with a
known output shape, so the compiled graph neither unrolls the backend's per-segment Python loop nor
depends on the row's segment count: rows of any shape reuse one graph. Used for backends whose
`under_compile` is "custom_op" (the reference); they supply `attend_backward`, since autograd does not
record inside a custom op's kernel. A sliding window travels as an int (0: none) and sinks as an optional
tensor whose gradient the backward op returns. Eager forwards never come here. Does not know transformers.

Legend: Hq/Hkv = query/key-value heads, N = packed tokens, D = head dim, S = segments, P = path length.
"""

from __future__ import annotations

import torch

from ._backends import BACKENDS
from ._tree_layout import TreeLayout, layout_from_tensors


@torch.library.custom_op("agrpo::tree_attention", mutates_args=())
def _tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_index: torch.Tensor,
    kv_offsets: torch.Tensor,
    subtree_end: torch.Tensor,
    host_offsets: torch.Tensor,
    backend: str,
    scaling: float,
    softcap: float,
    window: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    layout = layout_from_tensors(q_offsets, kv_index, kv_offsets, subtree_end, host_offsets)
    chosen = BACKENDS[backend]
    state = chosen.prepare(layout, windows=(window,) if window else (), sinks=sinks is not None)
    out = chosen.attend(
        query,
        key,
        value,
        layout,
        state,
        scaling=scaling,
        softcap=softcap or None,
        window=window or None,
        sinks=sinks,
    )
    return out.contiguous()  # the fake below promises a contiguous (1, N, Hq, D)


@_tree_attention.register_fake
def _(query, key, value, *rest):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


@torch.library.custom_op("agrpo::tree_attention_backward", mutates_args=())
def _tree_attention_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_index: torch.Tensor,
    kv_offsets: torch.Tensor,
    subtree_end: torch.Tensor,
    host_offsets: torch.Tensor,
    backend: str,
    scaling: float,
    softcap: float,
    window: int,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    layout = layout_from_tensors(q_offsets, kv_index, kv_offsets, subtree_end, host_offsets)
    chosen = BACKENDS[backend]
    state = chosen.prepare(layout, windows=(window,) if window else (), sinks=sinks is not None)
    *grads, d_sinks = chosen.attend_backward(
        grad, query, key, value, layout, state, scaling=scaling, softcap=softcap or None, window=window or None,
        sinks=sinks,
    )  # fmt: skip
    copies = tuple(torch.empty_like(x).copy_(g) for x, g in zip((query, key, value), grads, strict=True))
    return *copies, query.new_empty(0) if d_sinks is None else d_sinks.contiguous()  # as the fake


@_tree_attention_backward.register_fake
def _(grad, query, key, value, *rest):
    sinks = rest[-1]
    d_sinks = query.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), d_sinks


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, *layout, backend, scaling, softcap, window, sinks = inputs
    ctx.save_for_backward(query, key, value, *layout, sinks)
    ctx.backend, ctx.scaling, ctx.softcap, ctx.window = backend, scaling, softcap, window


def _backward(ctx, grad):
    query, key, value, *layout, sinks = ctx.saved_tensors
    *grads, d_sinks = _tree_attention_backward(
        grad.contiguous(),
        query,
        key,
        value,
        *layout,
        ctx.backend,
        ctx.scaling,
        ctx.softcap,
        ctx.window,
        sinks,
    )
    return *grads, *(None for _ in range(9)), None if sinks is None else d_sinks


_tree_attention.register_autograd(_backward, setup_context=_setup_context)


def tree_attention_op(
    backend_name: str,
    query,
    key,
    value,
    layout: TreeLayout,
    *,
    scaling: float,
    softcap: float | None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query (1, Hq, N, D), key/value (1, Hkv, N, D), sinks (Hq,) -> (1, N, Hq, D) through the custom op."""
    return _tree_attention(
        query, key, value, layout.q_offsets, layout.kv_index, layout.kv_offsets, layout.subtree_end,
        layout.host_offsets, backend_name, float(scaling), float(softcap or 0.0), int(window or 0), sinks,
    )  # fmt: skip

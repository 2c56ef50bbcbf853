"""`AttentionBackend`: the protocol every tree-attention kernel implements.

Owns the contract between the transformers-facing attention function and the kernels: shapes in and
out, the two-phase life of a backend (`prepare` once per forward, `attend` once per layer), and how
it runs inside a compiled decoder layer (`under_compile`). Does not know any kernel (see `_backends/`),
nor transformers.

Legend: Hq/Hkv = query/key-value heads, N = packed tokens, D = head dim.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ._tree_layout import TreeLayout


class AttentionBackend(Protocol):
    """One way to compute tree attention; registered by name in `_backends.BACKENDS`."""

    name: str
    """Name users pass to `enable_tree_attention(model, backend=...)`."""
    supports_softcap: bool
    """Whether `attend` honours `softcap` (models with `attn_logit_softcapping` need it)."""
    supports_window: bool
    """Whether `attend` honours `window`, a sliding window of the last W tokens of each query's path."""
    supports_sinks: bool
    """Whether `attend` honours `sinks`, learned per-head logits that join each softmax without a value."""
    input_dtypes: tuple[torch.dtype, ...] | None
    """The q/k/v dtypes `attend` runs (flash kernels: fp16 and bf16); None = any floating dtype."""
    forward_only_on: tuple[str, ...]
    """Device types where `attend` has no backward (usable for inference there, not for training)."""
    under_compile: str
    """How `attend` runs inside a torch.compile'd decoder layer: "trace" (dynamo traces it into the graph,
    row sizes as dynamic shapes), "custom_op" (an opaque agrpo custom op; the backend then also has
    `attend_backward`), or "eager" (a graph break around it: not traceable, or untested under compile)."""

    def unavailable_reason(self, device: torch.device) -> str | None:
        """None if the backend runs on `device` here, else why not and how to fix it."""
        ...

    def prepare(self, layout: TreeLayout, *, windows: tuple[int, ...] = (), sinks: bool = False) -> object:
        """Per-forward state shared by every layer (a block mask per window, say); None if nothing is needed.
        `windows`: the model's sliding windows; `sinks`: whether its layers pass sinks."""
        ...

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layout: TreeLayout,
        state: object,
        *,
        scaling: float,
        softcap: float | None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query (1, Hq, N, D), key/value (1, Hkv, N, D), sinks (Hq,) -> output (1, N, Hq, D)."""
        ...

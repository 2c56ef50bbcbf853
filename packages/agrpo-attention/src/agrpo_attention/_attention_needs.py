"""`AttentionNeeds`: what a model's attention layers ask of a tree-attention backend, read once per model.

Why: a backend that cannot run a layer's sliding window, attention sinks or logit softcapping must be refused
(or skipped by "auto") when the model is enabled, naming the layer, not discovered mid-forward or, worse,
silently ignored. Owns reading those features off a transformers model (`attention_needs`) and the reason a
backend falls short (`AttentionNeeds.unmet_by`). Does not know kernels: backends declare `supports_softcap`,
`supports_window` and `supports_sinks`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionNeeds:
    """The attention features of one model; the default needs nothing beyond causal attention."""

    softcap: bool = False
    """Some layer caps its attention logits (Gemma 2: `attn_logit_softcapping`)."""
    windows: tuple[int, ...] = ()
    """The distinct sliding windows of the model's windowed layers (Gemma 2/3, gpt-oss, Mistral), ascending."""
    sinks: bool = False
    """Some layer has learned attention sinks (gpt-oss: `self_attn.sinks`, one logit per query head)."""
    windowed_layer: str | None = None
    """Name of the first windowed attention module, for messages."""
    sink_layer: str | None = None
    """Name of the first attention module with sinks, for messages."""

    def unmet_by(self, backend) -> str | None:
        """Why `backend` cannot run this model's attention, or None when it can."""
        if self.softcap and not backend.supports_softcap:
            return "this model caps its attention logits (config.attn_logit_softcapping)"
        if self.windows and not backend.supports_window:
            return f"layer {self.windowed_layer} uses a sliding window of {self.windows[0]} tokens"
        if self.sinks and not backend.supports_sinks:
            return f"layer {self.sink_layer} has learned attention sinks (s_aux)"
        return None


NO_NEEDS = AttentionNeeds()
"""A model (or a standalone plan) that needs nothing beyond causal attention."""


def _attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules that call the attention interface: transformers' attention classes all carry `q_proj`-style
    projections and are named `...Attention` (Gated DeltaNet modules are not)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if type(module).__name__.endswith("Attention") and hasattr(module, "config")
    ]


def attention_needs(model: torch.nn.Module) -> AttentionNeeds:
    """The windows, sinks and softcapping `model`'s attention layers use (`model`: a text model or decoder). A module's own `sliding_window` attribute
    decides where the class keeps one (None on its global layers); classes without that attribute (Mistral,
    Mixtral) pass the config's `sliding_window` from every layer."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    windows: set[int] = set()
    windowed_layer = sink_layer = None
    for name, module in _attention_modules(model):
        if hasattr(module, "sliding_window"):
            window = module.sliding_window
        else:
            window = getattr(config, "sliding_window", None)
        if window:
            windows.add(int(window))
            windowed_layer = windowed_layer or name
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            sink_layer = sink_layer or name
    return AttentionNeeds(
        softcap=bool(getattr(config, "attn_logit_softcapping", None)),
        windows=tuple(sorted(windows)),
        sinks=sink_layer is not None,
        windowed_layer=windowed_layer,
        sink_layer=sink_layer,
    )

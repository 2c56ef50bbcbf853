"""`enable_tree_attention`: switch a stock transformers decoder to tree attention, explicitly, per model.

Owns the checks that refuse what tree attention cannot run (layer types other than full, sliding-window and
Gated DeltaNet in the Qwen3.5 or Qwen3-Next layout, other recurrent mixers, chunked or non-causal attention and
attention dropout (`_attention_keywords`), a sliding window, sinks or softcapping on a backend without them
(`_attention_needs`), models that do not route attention through transformers' `AttentionInterface`), the switch of
`attn_implementation` to "agrpo_tree", the per-instance patch of each Gated DeltaNet module's forward
(its tree path runs only when a tree plan is passed; without one the stock forward runs), and the
settings recorded on the model for `build_tree_plan`. Nothing is patched at import. Does not know
kernels' internals nor the loss.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from ._attention_backend import AttentionBackend
from ._attention_keywords import model_attention_refusals
from ._attention_needs import AttentionNeeds, attention_needs
from ._backends import resolve_backend
from ._exceptions import UnsupportedModelError
from ._tree_attention import ATTENTION_NAME, register_tree_attention
from ._tree_deltanet import (
    TRACED_KERNELS,
    check_deltanet_module,
    resolve_delta_rule_kernel,
    tree_deltanet_forward,
)

_SETTINGS_ATTRIBUTE = "_agrpo_tree_settings"
_SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
_UNSUPPORTED_MIXERS = ("Mamba", "ShortConv", "LinearAttention", "Lightning", "Rwkv", "RWKV", "Retention")


@dataclass(kw_only=True, slots=True, frozen=True)
class TreeSettings:
    """What `enable_tree_attention` chose for one model."""

    backend: AttentionBackend
    """Attention backend of every attention layer."""
    device: torch.device
    """Device of the model's parameters when enabled."""
    conv_kernel_size: int | None
    """Gated DeltaNet convolution taps; None when the model has no such layer."""
    deltanet_kernel: str | None
    """"torch", "triton" or "fla"; None when the model has no Gated DeltaNet layer."""
    needs: AttentionNeeds
    """The sliding windows, sinks and softcapping of the model's attention layers (block masks are prepared
    per window)."""


def tree_settings(model: torch.nn.Module) -> TreeSettings:
    """The settings `enable_tree_attention` recorded on `model`, looking through a data-parallel wrapper
    (DDP keeps the model as `.module`; PEFT forwards attribute lookups to its base model by itself)."""
    settings = getattr(model, _SETTINGS_ATTRIBUTE, None)
    inner = getattr(model, "module", None)
    if settings is None and isinstance(inner, torch.nn.Module):
        settings = getattr(inner, _SETTINGS_ATTRIBUTE, None)
    if settings is None:
        raise ValueError(
            f"{type(model).__name__} is not tree-enabled: call enable_tree_attention(model) first"
        )
    return settings


def deltanet_traceable(model: torch.nn.Module) -> bool:
    """True when tree-enabled `model` has Gated DeltaNet layers whose tree forward a torch.compile'd decoder layer
    traces whole, for rows of any shape (deltanet_kernel "triton": custom ops only); False with "torch" or "fla"
    (a host loop over the row's tree levels), without such layers, or before `enable_tree_attention`."""
    settings = getattr(model, _SETTINGS_ATTRIBUTE, None) or getattr(
        getattr(model, "module", None), _SETTINGS_ATTRIBUTE, None
    )
    return settings is not None and settings.deltanet_kernel in TRACED_KERNELS


def _text_config(model: torch.nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The module tree attention runs in: the model itself, or a multimodal model's language model (Gemma 3's
    `Gemma3ForConditionalGeneration`: its vision tower keeps its own attention and never sees a tree row)."""
    if _text_config(model) is model.config or not hasattr(model, "get_decoder"):
        return model
    return model.get_decoder()


def _text_attention_implementation(model: torch.nn.Module):
    """What `set_attn_implementation` takes to switch the language model only: "agrpo_tree" for a text model, a
    `{sub-config name: "agrpo_tree"}` mapping for a multimodal one."""
    config, text = model.config, _text_config(model)
    if text is config:
        return ATTENTION_NAME
    names = [name for name in getattr(config, "sub_configs", {}) if getattr(config, name, None) is text]
    if not names:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s text config is not one of its sub-configs; load its language model alone"
        )
    return {names[0]: ATTENTION_NAME}


def _deltanet_modules(model: torch.nn.Module, config) -> list[tuple[str, torch.nn.Module]]:
    layer_types = list(getattr(config, "layer_types", None) or [])
    for index, layer_type in enumerate(layer_types):
        if layer_type not in _SUPPORTED_LAYER_TYPES:
            raise UnsupportedModelError(
                f"layer {index} is {layer_type!r}; tree attention supports {list(_SUPPORTED_LAYER_TYPES)} layers only"
            )
    found = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith("GatedDeltaNet"):
            check_deltanet_module(module, name)
            found.append((name, module))
        elif any(tag in kind for tag in _UNSUPPORTED_MIXERS):
            raise UnsupportedModelError(
                f"{name} is a {kind}: tree attention supports attention and Gated DeltaNet layers only"
            )
    if layer_types.count("linear_attention") != len(found):
        raise UnsupportedModelError(
            f"config lists {layer_types.count('linear_attention')} linear_attention layers but the model has "
            f"{len(found)} Gated DeltaNet modules; only Gated DeltaNet linear attention (Qwen3.5 or Qwen3-Next "
            "layout) is supported"
        )
    return found


def _parameter_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating-point parameter (its embedding): what attention sees
    without autocast. None when no parameter is floating point (nothing to decide by)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _tree_or_stock_forward(self, hidden_states, *args, tree_plan=None, **kwargs):
    """Forward of a patched Gated DeltaNet module: the tree path with a plan, the class's own without."""
    if tree_plan is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    if kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
        raise ValueError("tree Gated DeltaNet runs without a cache: call the model with use_cache=False")
    return tree_deltanet_forward(self, hidden_states, tree_plan.deltanet, tree_plan.deltanet_kernel)


def _patch_deltanet(module: torch.nn.Module) -> None:
    # A bound method (not a closure) so that copy.deepcopy(model) rebinds it to the copy's own module.
    module.forward = types.MethodType(_tree_or_stock_forward, module)


def enable_tree_attention(
    model: torch.nn.Module, backend: str = "auto", *, deltanet_kernel: str = "auto"
) -> str:
    """Switch `model` (a transformers causal LM, already on its device) to tree attention; returns the backend
    name chosen. `backend`: "auto", "reference", "flex", "varlen", "cascade", "adaptive", "fa3", "fa4" or "aiter";
    "auto" picks by device and by the parameters' dtype (float32 weights never get a half-precision-only
    kernel). `deltanet_kernel` (hybrids only): "auto" ("fla" where fla-core's kernels train, else "triton" on
    CUDA with triton, else "torch"), "torch" (the PyTorch rule, forced), "triton" or "fla"."""
    config = _text_config(model)
    deltanets = _deltanet_modules(model, config)
    decoder = _text_decoder(model)
    if refusals := model_attention_refusals(decoder):
        raise UnsupportedModelError("; ".join(refusals))
    device = next(model.parameters()).device
    needs = attention_needs(decoder)
    chosen = resolve_backend(backend, device, needs=needs, dtype=_parameter_dtype(model))
    kernel = resolve_delta_rule_kernel(deltanet_kernel, device) if deltanets else None
    if not type(model)._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
            "so its attention cannot be replaced"
        )
    register_tree_attention()
    model.set_attn_implementation(_text_attention_implementation(model))
    for _, module in deltanets:
        _patch_deltanet(module)
    conv_taps = int(deltanets[0][1].conv1d.weight.shape[-1]) if deltanets else None
    settings = TreeSettings(
        backend=chosen, device=device, conv_kernel_size=conv_taps, deltanet_kernel=kernel, needs=needs
    )
    setattr(model, _SETTINGS_ATTRIBUTE, settings)
    return chosen.name

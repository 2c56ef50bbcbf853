"""What a PEFT LoRA model sends: its merged full weights, or the adapter alone, as `WireEntry` lists.

Owns recognising LoRA layers, the merge `W + scaling * (B @ A)` (transposed for embeddings and for
`fan_in_fan_out` layers; summed over active adapters) computed per layer from gathered full tensors, and
the checkpoint names on each side: merged weights drop `base_model.model.` and `.base_layer`, adapter
weights keep PEFT's saved form (`base_model.model.<module>.lora_A.weight`, adapter name removed).
`modules_to_save` copies replace their original module in merged weights. Does not know how the
entries are gathered (`_param_stream.py`) or sent.

DoRA and other LoRA variants are refused with the setting to change: their merge is not `B @ A`.
"""

from __future__ import annotations

from functools import partial

import torch

from ._exceptions import SyncSetupError
from ._param_stream import WireEntry, clean_name, frozen_non_text
from ._wire_format import TensorMeta

ADAPTER_SEGMENTS = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"}
)
PEFT_PREFIX = "base_model.model."


def is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "scaling")


def has_lora(model: torch.nn.Module) -> bool:
    """True when the model contains PEFT LoRA layers."""
    return any(is_lora_layer(m) for m in model.modules())


def _adapters(layer: torch.nn.Module, layer_name: str) -> list[str]:
    names = [a for a in layer.active_adapters if a in layer.lora_A or a in layer.lora_embedding_A]
    for adapter in names:
        if getattr(layer, "use_dora", {}).get(adapter):
            raise SyncSetupError(
                f"{layer_name} uses DoRA, which agrpo-sync cannot merge; set use_dora=False in the LoraConfig"
            )
    return names


def _merge(fulls: list[torch.Tensor], *, scalings: list[float], kinds: list[str], fan_in_fan_out: bool):
    weight = fulls[0]
    merged = weight.float()
    for index, (scaling, kind) in enumerate(zip(scalings, kinds, strict=True)):
        a, b = fulls[1 + 2 * index].float(), fulls[2 + 2 * index].float()
        delta = (b @ a) * scaling
        if kind == "embedding" or fan_in_fan_out:
            delta = delta.T
        merged = merged + delta
    return merged.to(weight.dtype)


def _merged_entry(layer: torch.nn.Module, layer_name: str, weight: torch.Tensor, dtype) -> WireEntry:
    sources, scalings, kinds = [weight], [], []
    for adapter in _adapters(layer, layer_name):
        if adapter in layer.lora_A:
            sources += [layer.lora_A[adapter].weight, layer.lora_B[adapter].weight]
            kinds.append("linear")
        else:
            sources += [layer.lora_embedding_A[adapter], layer.lora_embedding_B[adapter]]
            kinds.append("embedding")
        scalings.append(float(layer.scaling[adapter]))
    combine = partial(
        _merge, scalings=scalings, kinds=kinds, fan_in_fan_out=bool(getattr(layer, "fan_in_fan_out", False))
    )
    name = _merged_name(f"{layer_name}.base_layer.weight")
    return WireEntry(
        meta=TensorMeta(name, dtype or weight.dtype, tuple(weight.shape)),
        sources=tuple(sources),
        combine=combine,
    )


def _merged_name(name: str) -> str:
    """`base_model.model.x.q_proj.base_layer.weight` -> `x.q_proj.weight`; modules_to_save copies take
    their original's name."""
    segments = clean_name(name).removeprefix(PEFT_PREFIX).split(".")
    out, skip_next = [], False
    for segment in segments:
        if skip_next:
            skip_next = False
        elif segment == "modules_to_save":
            skip_next = True  # the adapter name after it
        elif segment != "base_layer":
            out.append(segment)
    return ".".join(out)


def merged_entries(
    model: torch.nn.Module, dtype: torch.dtype | None, non_text: tuple[str, ...]
) -> list[WireEntry]:
    """Full weights with every active LoRA adapter merged in, under the base model's checkpoint names."""
    modules = dict(model.named_modules())
    named = list(model.named_parameters())
    skipped = frozen_non_text(named, non_text)
    entries = []
    for name, param in named:
        segments = set(name.split("."))
        if name in skipped or segments & ADAPTER_SEGMENTS or "original_module" in segments:
            continue
        owner, _, leaf = name.rpartition(".")
        layer_name = owner.removesuffix(".base_layer")
        layer = modules.get(layer_name)
        if owner.endswith(".base_layer") and leaf == "weight" and layer is not None and is_lora_layer(layer):
            entries.append(_merged_entry(layer, layer_name, param, dtype))
        else:
            meta = TensorMeta(_merged_name(name), dtype or param.dtype, tuple(param.shape))
            entries.append(WireEntry(meta=meta, sources=(param,)))
    return entries


def _adapter_name(name: str) -> str:
    """`base_model.model.x.q_proj.lora_A.default.weight` -> `base_model.model.x.q_proj.lora_A.weight`."""
    segments = clean_name(name).split(".")
    out, skip_next = [], False
    for segment in segments:
        if skip_next:
            skip_next = False
            continue
        out.append(segment)
        skip_next = segment in ADAPTER_SEGMENTS
    # lora_embedding_A/B are parameters themselves: their adapter name is the last segment, now dropped.
    joined = ".".join(out)
    return joined if joined.startswith(PEFT_PREFIX) else PEFT_PREFIX + joined


def adapter_entries(model: torch.nn.Module, dtype: torch.dtype | None) -> list[WireEntry]:
    """The trainable LoRA matrices alone, in PEFT's saved names (what `adapter_model.safetensors` holds)."""
    entries = []
    for name, param in model.named_parameters():
        segments = set(name.split("."))
        if not param.requires_grad or not segments & ADAPTER_SEGMENTS:
            continue
        if "lora_magnitude_vector" in segments:
            raise SyncSetupError(
                "DoRA adapters cannot be served by vLLM; set use_dora=False or lora_sync='merged'"
            )
        meta = TensorMeta(_adapter_name(name), dtype or param.dtype, tuple(param.shape))
        entries.append(WireEntry(meta=meta, sources=(param,)))
    return entries

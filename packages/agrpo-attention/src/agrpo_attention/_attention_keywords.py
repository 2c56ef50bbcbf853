"""So that nothing a model hands its attention function is silently dropped: each keyword is run or refused.

Owns the classification of every keyword name transformers 5.24's model code passes to an `AttentionInterface`
function (and of the forward kwargs that ride along): HANDLED (tree attention implements it), INERT (it cannot
change the result of one packed causal forward) and REFUSED (it changes attention in a way tree attention does
not implement; each with its fix). `check_attention_keywords` applies it to the leftover keywords of one call;
`model_attention_refusals` finds, before any forward, what never reaches the call as a keyword (chunked or
bidirectional masks, attention dropout in the config, non-causal modules). A test enumerates the callers.
Does not know kernels nor the tree plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ._exceptions import UnsupportedModelError


def _is_set(value: Any) -> bool:
    """True unless the value asks for nothing: None, False, 0 (tensors are set whatever they hold)."""
    if value is None:
        return False
    if isinstance(value, bool | int | float):
        return value != 0
    return True


def _is_false(value: Any) -> bool:
    """True for an explicit "not causal" (None and True leave attention causal)."""
    return value is not None and not _is_set(value)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a keyword is refused, naming the fix, and which values of it are refused."""

    reason: str
    refuses: Callable[[Any], bool] = _is_set


HANDLED: frozenset[str] = frozenset(
    {
        # The interface's own parameters (Parakeet passes query/key/value by name).
        "query",
        "key",
        "value",
        # Implemented by tree attention: dropout only as 0 (refused when nonzero at forward).
        "scaling",
        "dropout",
        "softcap",
        "sliding_window",
        "s_aux",
        # Ours: the tree plan travels from the model's forward kwargs to every attention call.
        "tree_plan",
    }
)
"""Keywords tree attention implements."""

INERT: frozenset[str] = frozenset(
    {
        # What the model returns or records: the attention output is the same (weights come back None,
        # as from SDPA and flash).
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        # Positions: rotary embeddings are applied to q/k before the call, and the tree plan (not position
        # resets, as flash infers packed sequences from position_ids) says who attends to whom.
        "position_ids",
        "position_embeddings",
        # KV-cache bookkeeping: key/value already hold what the cache contributes.
        "use_cache",
        "cache",
        "past_key_values",
        "cache_position",
        # Read by the loss, the MoE blocks or Mamba-style mixers, never by an attention function.
        "num_items_in_batch",
        "seq_idx",
        "moe_routes",
        # Kernel choice (reduction order, tiling), not the math: ModernBERT's deterministic flash, flex options.
        "deterministic",
        "kernel_options",
    }
)
"""Keywords that cannot change the attention result of one packed causal forward."""

_VARLEN = Refusal(
    "variable-length packing (cu_seq_lens_*/max_length_*, e.g. from DataCollatorWithFlattening) splits the "
    "row into sequences that tree attention would ignore: pack rows with agrpo-packing and let the tree plan "
    "(build_tree_plan) say who attends to whom"
)
_PAGED = Refusal(
    "paged attention of continuous-batching generation is not what tree attention runs: generate with vLLM "
    "or the stock attention, and run tree attention for training forwards only"
)

REFUSED: Mapping[str, Refusal] = MappingProxyType(
    {
        "attention_mask": Refusal(
            "a mask the model builds itself (Doge's dynamic mask, Parakeet's relative-position bias, an "
            "encoder's padding mask) would be ignored: under agrpo_tree transformers builds no mask and the "
            "tree plan alone decides visibility; use a decoder whose masks are causal (sliding window or not)"
        ),
        "is_causal": Refusal(
            "non-causal (bidirectional) attention, as in vision and audio encoders, is not tree attention: "
            "run the text-only causal LM (AutoModelForCausalLM.from_config(config.get_text_config()))",
            refuses=_is_false,
        ),
        "position_bias": Refusal(
            "an additive relative-position score bias (T5, Pix2Struct, LayoutLMv3, Inkling) is not "
            "implemented by tree attention: use a model with rotary positions"
        ),
        "sinks": Refusal(
            "per-token attention sinks (Inkling 2) are not implemented; tree attention implements per-head "
            "learned sinks passed as s_aux (gpt-oss): use such a model"
        ),
        "indices": Refusal(
            "sparse attention over indexer-selected keys (DeepSeek V3.2 / GLM DSA, Mistral Large 4) is not "
            "implemented by tree attention: use a dense-attention model"
        ),
        "block_indices": Refusal(
            "block-sparse attention over indexer-selected blocks (MiniMax-M3) is not implemented by tree "
            "attention: use a dense-attention model"
        ),
        "cu_seq_lens_q": _VARLEN,
        "cu_seq_lens_k": _VARLEN,
        "max_length_q": _VARLEN,
        "max_length_k": _VARLEN,
        "block_table": _PAGED,
        "read_index": _PAGED,
        "write_index": _PAGED,
    }
)
"""Keywords that change attention in a way tree attention does not implement, with the fix."""

CLASSIFIED: frozenset[str] = HANDLED | INERT | frozenset(REFUSED)
"""Every keyword name this module knows."""


def check_attention_keywords(module_name: str, kwargs: dict) -> None:
    """Refuse the keywords of one attention call (those tree attention did not take) that would change its
    result: a REFUSED keyword with a refused value, any keyword this module does not know, and a HANDLED one
    other than tree_plan (left over, so the forward did not take it and would drop it). None always passes."""
    for name, value in kwargs.items():
        if value is None or name in INERT or name == "tree_plan":
            continue
        if name in HANDLED:
            if _is_set(value):
                raise UnsupportedModelError(
                    f"{module_name} passes {name}={_describe(value)}, which tree attention implements but "
                    f"its attention function did not take: a bug in agrpo-attention (take {name} by name), "
                    "report it"
                )
            continue
        refusal = REFUSED.get(name)
        if refusal is None:
            raise UnsupportedModelError(
                f"{module_name} passes the attention keyword {name}={_describe(value)}, which tree attention "
                "does not know and will not drop silently: report it to agrpo-attention (with the model "
                "family) so that it is implemented or refused by name"
            )
        if refusal.refuses(value):
            raise UnsupportedModelError(f"{module_name} passes {name}={_describe(value)}: {refusal.reason}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_LAYER_TYPE_REFUSALS: Mapping[str, str] = MappingProxyType(
    {
        "chunked_attention": (
            "chunked attention (Llama 4's attention_chunk_size={chunk}: tokens see only their own chunk) "
            "is not implemented by tree attention: load the config with attention_chunk_size=None (those "
            "layers become full attention, which changes the model) or use another model"
        ),
        "window_attention": (
            "non-overlapping window attention (ViT-style window_attention layers) is not implemented by tree "
            "attention: use a causal decoder"
        ),
        "indexed_attention": (
            "indexer-selected sparse attention (DSA: DeepSeek V3.2, GLM MoE DSA) is not implemented by tree "
            "attention: use a dense-attention model"
        ),
        "compressed_sparse_attention": (
            "compressed sparse attention (DeepSeek V4) is not implemented by tree attention: use a "
            "dense-attention model"
        ),
        "heavily_compressed_attention": (
            "heavily compressed attention (DeepSeek V4) is not implemented by tree attention: use a "
            "dense-attention model"
        ),
        "minimax_m3_sparse": (
            "lightning-index sparse attention (MiniMax-M3) is not implemented by tree attention: use a "
            "dense-attention model"
        ),
        "reference_sliding_attention": (
            "reference sliding attention (UnlimitedOcr: full prefill, ring-buffered window over generated "
            "tokens) is not implemented by tree attention: use a causal decoder"
        ),
    }
)
"""Layer types whose attention pattern lives in a mask or kernel tree attention cannot build, with the fix."""

_DROPOUT_FIELDS = ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop", "attn_dropout")
"""Config fields that set attention-probability dropout across transformers' families."""


def _configs(model: torch.nn.Module) -> list:
    """The model's config and its text config (the same object for a text-only model)."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]


def _config_refusals(config) -> list[str]:
    reasons = []
    for field in _DROPOUT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            reasons.append(
                f"config.{field}={value}: attention dropout is not implemented by tree attention; set "
                f"config.{field}=0 before enable_tree_attention"
            )
    layer_types = list(getattr(config, "layer_types", None) or [])
    chunk = getattr(config, "attention_chunk_size", None)
    for layer_type, reason in _LAYER_TYPE_REFUSALS.items():
        if layer_type in layer_types:
            count = layer_types.count(layer_type)
            first = layer_types.index(layer_type)
            reasons.append(
                f"{count} of {len(layer_types)} layers (the first: {first}) are {layer_type!r}: "
                + reason.format(chunk=chunk)
            )
    if chunk and not layer_types:
        reasons.append(
            f"config.attention_chunk_size={chunk}: "
            + _LAYER_TYPE_REFUSALS["chunked_attention"].format(chunk=chunk)
        )
    if getattr(config, "use_bidirectional_attention", False):
        reasons.append(
            "config.use_bidirectional_attention=True (Gemma-style bidirectional text attention) is not "
            "causal and tree attention is: set config.use_bidirectional_attention=False (a causal LM) or use "
            "another model"
        )
    if getattr(config, "is_encoder_decoder", False):
        reasons.append(
            "an encoder-decoder model (bidirectional encoder, cross-attention) is not a causal decoder, "
            "which tree attention requires: use a decoder-only causal LM"
        )
    if getattr(config, "alibi", False):
        reasons.append(
            "ALiBi position biases (config.alibi=True) are not implemented by tree attention: use a model "
            "with rotary positions"
        )
    return reasons


def _module_refusals(model: torch.nn.Module) -> list[str]:
    non_causal = [
        name for name, module in model.named_modules() if getattr(module, "is_causal", None) is False
    ]
    if not non_causal:
        return []
    shown = ", ".join(non_causal[:3]) + (f" and {len(non_causal) - 3} more" if len(non_causal) > 3 else "")
    return [
        f"{len(non_causal)} attention modules are non-causal (is_causal=False: {shown}), and tree "
        "attention is causal: run the text-only causal LM "
        "(AutoModelForCausalLM.from_config(config.get_text_config())) without the vision or audio encoder"
    ]


def model_attention_refusals(model: torch.nn.Module) -> list[str]:
    """Reasons, each naming its fix, why tree attention cannot run `model` as it is; [] when it can. Found
    before any forward: what reaches attention through masks and module attributes rather than keywords."""
    reasons = [reason for config in _configs(model) for reason in _config_refusals(config)]
    reasons += _module_refusals(model)
    return list(dict.fromkeys(reasons))

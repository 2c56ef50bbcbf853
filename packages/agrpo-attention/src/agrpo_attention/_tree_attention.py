"""The attention function transformers calls in every attention layer of a tree-enabled model.

Owns `tree_attention_forward` (the `AttentionInterface` signature: module, query, key, value,
attention_mask, scaling, dropout, plus keyword extras: `softcap`, `sliding_window`, `s_aux` (gpt-oss's
attention sinks) and our `tree_plan`, which travels from the model's forward kwargs) and its registration
under the name "agrpo_tree". Every other keyword is checked against `_attention_keywords`: one that would
change attention is refused by name, never dropped. Under autocast, query, key and value are cast to the autocast dtype first, as autocast does
for SDPA: fp32 master weights leave Qwen3's normed q/k in fp32 beside a bf16 v, which flash kernels refuse. transformers builds no mask for a name it has no mask function for, so the row is run
as one sequence of N tokens and the tree lives entirely in the plan. Does not know kernels (the
plan's backend does) nor how the plan was built.
"""

from __future__ import annotations

import torch

from ._attention_keywords import check_attention_keywords
from ._exceptions import TreePlanMissingError, UnsupportedModelError

ATTENTION_NAME = "agrpo_tree"


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    tree_plan=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (1, Hq, N, D), key/value (1, Hkv, N, D), s_aux (Hq,) -> ((1, N, Hq, D), no attention weights)."""
    if tree_plan is None:
        raise TreePlanMissingError(
            "this model runs tree attention and needs a tree plan: call token_logprobs(model, packed_row), "
            "or pass tree_plan=build_tree_plan(packed_row, model) to the model's forward"
        )
    if query.shape[0] != 1:
        raise ValueError(
            f"tree attention runs one packed row (batch size 1), got batch size {query.shape[0]}"
        )
    if dropout:
        raise UnsupportedModelError(
            f"attention dropout {dropout} is not implemented by tree attention; set config.attention_dropout=0"
        )
    check_attention_keywords(type(module).__name__, {**kwargs, "attention_mask": attention_mask})
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # as SDPA under autocast: one low-precision dtype for q, k, v
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    out = tree_plan.attend(
        query, key, value, scaling=scaling, softcap=softcap, window=sliding_window, sinks=s_aux
    )
    return out, None


def register_tree_attention() -> None:
    """Make "agrpo_tree" a valid `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)

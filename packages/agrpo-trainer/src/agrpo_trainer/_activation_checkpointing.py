"""Activation checkpointing of one decoder layer: the three modes and the selective policy.

Owns what a checkpointed layer keeps for backward. `full` keeps only the layer's inputs and recomputes
the whole layer in backward (least memory; about a third more compute). `none` keeps everything (no
recompute; the most memory). `selective` keeps the outputs of the attention kernel and of the attention
projections (q/k/v/o: every matmul whose weight is not the MLP's) and recomputes the rest: the norms,
RoPE, casts, the activation and the MLP's matmuls, whose outputs are the widest tensors of a layer. On
Qwen3-1.7B (hidden 2048, MLP 6144) under bf16 autocast a layer then keeps about 24 KB per token (its fp32
input, the bf16 q/k/v/o projections and attention output) against roughly 100 KB without checkpointing
(an estimate; `_checkpointing_choice`'s probe measures it), and recomputes about half of its forward
matmul FLOPs (the MLP's gate and up; the down projection's output is not needed by backward) and no
attention, where `full` recomputes all of both. The policy is torch's selective
activation checkpointing (`create_selective_checkpoint_contexts`), decided per op from the op and the
weight's shape (the MLP's `nn.Linear` shapes, read from the layer once), so it runs the same eagerly and
inside a compiled layer, where the partitioner honours it (torchtitan's `SelectiveAC` decides the same
way, by op and matmul shape). Always non-reentrant. Does not know compile or weight casts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

CHECKPOINT_MODES = ("full", "selective", "none")
"""From least memory to least compute."""

_ATTENTION_OP_NAMES = (
    "agrpo::tree_attention",
    "agrpo::cascade_attention",
    "torch_attn::_varlen_attn",
    "aten::_flash_attention_forward",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_efficient_attention_forward",
    "flex_attention",
)
_MATMUL_WEIGHT_ARG = {"aten::mm": 1, "aten::addmm": 2}
"""matmul op -> position of its (in, out) weight among the arguments (`F.linear` lowers to these)."""
_MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")
"""Children of a decoder layer that hold its MLP, across transformers' model families."""


def mlp_weight_shapes(layer: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """(in, out) of every `nn.Linear` of `layer`'s MLP, the matmuls `selective` recomputes; empty when the
    layer has no child of a known MLP name (then `selective` recomputes only norms and elementwise ops)."""
    shapes = set()
    for name, child in layer.named_children():
        if name in _MLP_NAMES:
            for module in child.modules():
                if isinstance(module, torch.nn.Linear):
                    shapes.add((module.in_features, module.out_features))
    return tuple(sorted(shapes))


def _op_name(op) -> str:
    name = getattr(op, "name", None)
    return name() if callable(name) else str(getattr(op, "__name__", op))


def keeps_output(op, args: tuple, mlp_shapes: tuple[tuple[int, int], ...]) -> bool:
    """The selective policy: True when `op`'s output is kept for backward, False when it is recomputed."""
    name = _op_name(op)
    if any(name.startswith(attention) for attention in _ATTENTION_OP_NAMES):
        return True
    if name in _MATMUL_WEIGHT_ARG:
        return tuple(args[_MATMUL_WEIGHT_ARG[name]].shape) not in mlp_shapes
    return False


@functools.cache
def selective_context_fn(mlp_shapes: tuple[tuple[int, int], ...]) -> Callable[[], tuple]:
    """The `context_fn` of `checkpoint` for layers whose MLP matmuls have these shapes; one function object
    per shape set, so every layer of a model hands dynamo the same one (a compiled layer keeps the policy
    it was traced with, and layers of one model share their graphs)."""

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if keeps_output(op, args, mlp_shapes):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn():
        return create_selective_checkpoint_contexts(policy)

    return context_fn


def run_checkpointed(mode: str, function: Callable, *args, context_fn: Callable | None = None, **kwargs):
    """`function(*args, **kwargs)` with its activations kept as `mode` says (see the module docstring);
    `selective` needs the layer's `context_fn` (`selective_context_fn`)."""
    if mode == "none":
        return function(*args, **kwargs)
    if mode == "full":
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    if mode == "selective":
        assert context_fn is not None, "selective checkpointing needs the layer's context_fn"
        return checkpoint(function, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    raise ValueError(f"checkpointing mode {mode!r}; expected one of {list(CHECKPOINT_MODES)}")

"""Random transformers models of the benchmark's shapes: Qwen3-0.6B/1.7B/4B/8B dense, a Qwen3.5-style hybrid, tiny twins.

Owns the configurations. The dense shapes are Qwen3-1.7B's and Qwen3-0.6B's published ones (28 layers,
hidden 2048 / 1024, MLP 6144 / 3072, 16 query / 8 KV heads of 128, vocab 151936, tied embeddings) and
Qwen3-4B's (36 layers, hidden 2560, MLP 9728, 32 query / 8 KV heads of 128, tied) and Qwen3-8B's (36 layers,
hidden 4096, MLP 12288, 32 / 8 heads of 128, untied). The hybrid is a 2B-class shape
assumed in the Qwen3.5 style (3 Gated DeltaNet layers to 1 gated full-attention layer, hidden 2048,
MLP 6144, 8 query / 2 KV heads of 256, 16 key and 16 value linear heads of 128, vocab 248320); it is
not a published checkpoint's config. Small and tiny shapes serve parity checks and CPU smoke
tests. `num_layers` may cut depth to fit device time (reported).
Does not know packing or timing.
"""

from __future__ import annotations

import torch

SHAPES: dict[str, dict] = {
    "qwen3-1.7b": dict(kind="dense", hidden=2048, mlp=6144, layers=28, heads=16, kv_heads=8, head_dim=128,
                       vocab=151936),
    "qwen3-4b": dict(kind="dense", hidden=2560, mlp=9728, layers=36, heads=32, kv_heads=8, head_dim=128,
                     vocab=151936),
    "qwen3-8b": dict(kind="dense", hidden=4096, mlp=12288, layers=36, heads=32, kv_heads=8, head_dim=128,
                     vocab=151936, tied=False),
    "qwen3-0.6b": dict(kind="dense", hidden=1024, mlp=3072, layers=28, heads=16, kv_heads=8, head_dim=128,
                       vocab=151936),
    "qwen3.5-hybrid-2b": dict(kind="hybrid", hidden=2048, mlp=6144, layers=24, heads=8, kv_heads=2, head_dim=256,
                              linear_heads=16, linear_dim=128, vocab=248320),
    "small-dense": dict(kind="dense", hidden=256, mlp=512, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=512),
    "small-hybrid": dict(kind="hybrid", hidden=256, mlp=512, layers=4, heads=4, kv_heads=2, head_dim=64,
                         linear_heads=4, linear_dim=64, vocab=512),
    "tiny-dense": dict(kind="dense", hidden=64, mlp=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=512),
    "tiny-hybrid": dict(kind="hybrid", hidden=64, mlp=128, layers=4, heads=2, kv_heads=1, head_dim=32,
                        linear_heads=2, linear_dim=16, vocab=512),
}  # fmt: skip


def _config(shape: dict, num_layers: int):
    from transformers import Qwen3_5TextConfig, Qwen3Config

    common = dict(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["mlp"],
        num_hidden_layers=num_layers, num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], tie_word_embeddings=shape.get("tied", True), max_position_embeddings=131072,
    )  # fmt: skip
    if shape["kind"] == "dense":
        return Qwen3Config(**common)
    layer_types = [
        "full_attention" if i % 4 == 3 or i == num_layers - 1 else "linear_attention"
        for i in range(num_layers)
    ]
    return Qwen3_5TextConfig(
        **common,
        layer_types=layer_types,
        linear_num_key_heads=shape["linear_heads"],
        linear_num_value_heads=shape["linear_heads"],
        linear_key_head_dim=shape["linear_dim"],
        linear_value_head_dim=shape["linear_dim"],
        linear_conv_kernel_dim=4,
    )


def build_random_model(name: str, num_layers: int | None, device: str, dtype: torch.dtype):
    """A randomly initialised causal LM of shape `name`, built directly on `device` in `dtype`, training mode."""
    from transformers import AutoModelForCausalLM

    shape = SHAPES[name]
    config = _config(shape, num_layers or shape["layers"])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train()


def stock_checkpointing(model, on: bool) -> None:
    """transformers' own activation checkpointing on or off (non-reentrant), by the name this transformers has:
    `activation_checkpointing_*` since the rename (the old names warn), `gradient_checkpointing_*` before it
    (the H200 machine's 5.17)."""
    new = hasattr(model, "activation_checkpointing_enable")
    if not on:
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()
    elif new:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

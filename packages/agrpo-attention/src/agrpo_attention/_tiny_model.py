"""Tiny random causal LMs of the families tree attention runs, built offline in well under a second.

Owns `TinyModelSpec` and the builders: a Qwen3-style dense decoder, a Gated DeltaNet hybrid in the
Qwen3.5 style (transformers' `qwen3_5` text model: 3 linear-attention layers to 1 full-attention layer,
as the real checkpoints interleave them), the same interleave in the Qwen3-Next layout (`qwen3_next`: fused
Gated DeltaNet projections, gated attention, MoE with a shared expert in every layer) and a Qwen3-MoE (for the
router loss); `save_tiny_model` writes one with its tokenizer so vLLM and transformers load it from disk. Does
not know vLLM, training or packing. vLLM's CPU attention needs head_dim in {32, 64, 80, 96, 112, 128, ...}; the
defaults use 32. vLLM's CPU Gated DeltaNet runs bf16 with 128-wide heads only, so `qwen3_next` (the hybrid the
CPU server serves) has Gated DeltaNet heads of 128 whatever `head_dim` says.
For routing replay, whose gate formulas differ by family: OLMoE, Mixtral and `qwen3_next_moe` (Qwen3-Next's MoE
block with its gated shared expert on full-attention layers only, layer 0 dense through `mlp_only_layers`).
For sliding windows and attention sinks: `gpt_oss` (alternating sliding / full layers, learned sinks drawn from
N(0, 1) so that a forward that drops them is visibly off, 4 experts), `gemma2` (alternating, attention and final
logit softcapping, a query scale that is not 1/sqrt(head_dim)), `gemma3` (sliding layers with a global one, a
RoPE base per layer type), `gemma3_vlm` (the `gemma3` text tower under a tiny frozen-in-training SigLIP vision
tower: `Gemma3ForConditionalGeneration`, which is what transformers' `AutoModelForCausalLM` builds for a Gemma 3
config) and `mistral` (every layer windowed). Their window is `TinyModelSpec.sliding_window`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ._tiny_tokenizer import build_tokenizer


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyModelSpec:
    """Shape of a tiny random model; defaults are the smallest that vLLM's CPU backend serves."""

    kind: str = "qwen3"
    """`qwen3` (dense), `hybrid` (Gated DeltaNet + attention, transformers' `qwen3_5` text model),
    `qwen3_next` (the same interleave in Qwen3-Next's layout: fused projections, gated attention, 4 experts, 2
    per token, and a shared expert) or `moe` (Qwen3-MoE: 4 experts, 2 per token, for the router loss). For routing replay: `olmoe` (OLMoE,
    top-k weights not renormalised), `mixtral` (Mixtral) and `qwen3_next_moe` (Qwen3-Next's MoE block and gated
    shared expert on full-attention layers, layer 0 dense); 4 experts, 2 per token. Windowed: `gpt_oss` (sinks,
    4 experts, 2 per token; serve it untied: vLLM's GptOss has no tied head and leaves it unloaded), `gemma2`
    (softcapping), `gemma3`, `gemma3_vlm` (Gemma 3 with a vision tower) and `mistral`."""
    vocab_size: int = 512
    """Equals the tokenizer's size, 300..4096."""
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    """For `hybrid` and `qwen3_next`, every fourth layer is full attention (and the last layer always is)."""
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 32
    """vLLM CPU attention needs 32, 64, 80, 96, 112, 128, ..."""
    max_position_embeddings: int = 4096
    template: str = "tools"
    """Chat template: `tools` or `history_rewrite`."""
    tie_word_embeddings: bool = True
    """False gives the LM head its own weights: vLLM's CPU backend never refreshes a tied head on reload,
    so models that train against a CPU server (the demo, the learning test) are untied."""
    seed: int = 0
    sliding_window: int = 16
    """Window of the windowed kinds' sliding layers (keys a query sees, itself included); shorter than
    prompt + completion in tests, so the window changes the output."""


def _qwen3_config(spec: TinyModelSpec, special_ids: dict[str, int]):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        **special_ids,
    )


def _hybrid_layer_types(num_layers: int) -> list[str]:
    return [
        "full_attention" if (i % 4 == 3 or i == num_layers - 1) else "linear_attention"
        for i in range(num_layers)
    ]


def _hybrid_config(spec: TinyModelSpec, special_ids: dict[str, int]):
    from transformers import Qwen3_5TextConfig

    layer_types = _hybrid_layer_types(spec.num_layers)
    return Qwen3_5TextConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        layer_types=layer_types,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        linear_num_key_heads=spec.num_heads,
        linear_num_value_heads=2 * spec.num_heads,
        linear_key_head_dim=spec.head_dim // 2,
        linear_value_head_dim=spec.head_dim // 2,
        linear_conv_kernel_dim=4,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        **special_ids,
    )


QWEN3_NEXT_DELTANET_HEAD_DIM = 128
"""The Gated DeltaNet head size of `qwen3_next`: the only one vLLM's CPU delta rule runs."""


def _qwen3_next_config(spec: TinyModelSpec, special_ids: dict[str, int]):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        layer_types=_hybrid_layer_types(spec.num_layers),
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        linear_num_key_heads=1,
        linear_num_value_heads=2,  # two value heads per key head: the fused layout's grouping is exercised
        linear_key_head_dim=QWEN3_NEXT_DELTANET_HEAD_DIM,
        linear_value_head_dim=QWEN3_NEXT_DELTANET_HEAD_DIM,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=spec.intermediate_size // 2,
        shared_expert_intermediate_size=spec.intermediate_size // 2,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        **special_ids,
    )


def _moe_config(spec: TinyModelSpec, special_ids: dict[str, int]):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.intermediate_size // 2,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        **special_ids,
    )


def _shape(spec: TinyModelSpec, special_ids: dict[str, int]) -> dict:
    """Fields every tiny config shares (names as transformers' configs spell them)."""
    return dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        **special_ids,
    )


def _moe_shape(spec: TinyModelSpec, special_ids: dict[str, int]) -> dict:
    """Fields every tiny MoE config shares: two experts per token."""
    return _shape(spec, special_ids) | {"num_experts_per_tok": 2}


def _olmoe_config(spec: TinyModelSpec, special_ids: dict[str, int]):
    from transformers import OlmoeConfig

    return OlmoeConfig(num_experts=4, **_moe_shape(spec, special_ids))


def _mixtral_config(spec: TinyModelSpec, special_ids: dict[str, int]):
    from transformers import MixtralConfig

    return MixtralConfig(num_local_experts=4, head_dim=spec.head_dim, **_moe_shape(spec, special_ids))


def _qwen3_next_moe_config(spec: TinyModelSpec, special_ids: dict[str, int]):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        num_experts=4,
        head_dim=spec.head_dim,
        moe_intermediate_size=spec.intermediate_size // 2,
        shared_expert_intermediate_size=spec.intermediate_size // 2,
        layer_types=["full_attention"] * spec.num_layers,
        mlp_only_layers=[0],
        **_moe_shape(spec, special_ids),
    )


def _alternating_layer_types(num_layers: int) -> list[str]:
    """Sliding, full, sliding, full, ...: gpt-oss's and Gemma 2's interleave (vLLM's GptOss windows the even layers
    whatever `layer_types` says)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def _gemma3_layer_types(num_layers: int) -> list[str]:
    """Gemma 3's interleave, scaled down: every third layer global (and the second of two layers), the rest
    sliding; [sliding, sliding, full, sliding] for 4 layers, [sliding, full] for 2."""
    return [
        "full_attention" if (i % 3 == 2 or (num_layers == 2 and i == 1)) else "sliding_attention"
        for i in range(num_layers)
    ]


GPT_OSS_SINK_STD = 1.0
"""Spread of `gpt_oss`'s learned sinks; transformers draws them from N(0, 0.02), where they barely matter."""


def _gpt_oss_config(spec: TinyModelSpec, special_ids: dict[str, int]):
    from transformers import GptOssConfig

    return GptOssConfig(
        num_local_experts=4,
        head_dim=spec.head_dim,
        sliding_window=spec.sliding_window,
        layer_types=_alternating_layer_types(spec.num_layers),
        **_moe_shape(spec, special_ids),
    )


GEMMA2_INIT = 0.2
"""`gemma2`'s weight spread, 10x transformers' 0.02: at 0.02 a tiny model's attention logits stay under 0.1 and its
output logits under 1, where no cap bites; at 0.2 they reach about 8 and 11."""
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 10.0, "final_logit_softcapping": 30.0}
"""Gemma 2's final cap; the attention cap is 10 (the real 50 moves the tiny model's log-probs by only 0.015):
dropping either moves them by about 0.4 nats."""


def _windowed_shape(spec: TinyModelSpec, special_ids: dict[str, int]) -> dict:
    """Fields the windowed kinds' configs share (Gemma 2/3, Mistral)."""
    return _shape(spec, special_ids) | {"head_dim": spec.head_dim, "sliding_window": spec.sliding_window}


def _gemma2_config(spec: TinyModelSpec, special_ids: dict[str, int]):
    from transformers import Gemma2Config

    return Gemma2Config(
        layer_types=_alternating_layer_types(spec.num_layers),
        query_pre_attn_scalar=2 * spec.head_dim,  # scaling (2 head_dim)^-1/2, not head_dim^-1/2
        **GEMMA2_SOFTCAPS,
        initializer_range=GEMMA2_INIT,
        **_windowed_shape(spec, special_ids),
    )


GEMMA3_ROPE_THETA = {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}
"""Gemma 3's RoPE bases: local (sliding layers) and global."""


def _gemma3_text_config(spec: TinyModelSpec, special_ids: dict[str, int]):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        layer_types=_gemma3_layer_types(spec.num_layers),
        rope_parameters={
            layer_type: {"rope_type": "default", "rope_theta": theta}
            for layer_type, theta in GEMMA3_ROPE_THETA.items()
        },
        query_pre_attn_scalar=spec.head_dim,
        **_windowed_shape(spec, special_ids),
    )


def _gemma3_vlm_config(spec: TinyModelSpec, special_ids: dict[str, int]):
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=spec.hidden_size // spec.head_dim,
        image_size=32,
        patch_size=8,  # 4 x 4 patches, pooled to 2 x 2 image tokens
        vision_use_head=False,
    )
    # The tiny tokenizer has no image tokens: the image ids lie past its vocabulary (transformers maps an
    # out-of-vocabulary image id to 0 before embedding), so text-only use never meets them.
    return Gemma3Config(
        text_config=_gemma3_text_config(spec, special_ids),
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=spec.vocab_size,
        boi_token_index=spec.vocab_size + 1,
        eoi_token_index=spec.vocab_size + 2,
        tie_word_embeddings=spec.tie_word_embeddings,
        **special_ids,
    )


def _mistral_config(spec: TinyModelSpec, special_ids: dict[str, int]):
    from transformers import MistralConfig

    return MistralConfig(**_windowed_shape(spec, special_ids))


_BUILDERS = {
    "qwen3": _qwen3_config,
    "hybrid": _hybrid_config,
    "moe": _moe_config,
    "olmoe": _olmoe_config,
    "mixtral": _mixtral_config,
    "qwen3_next": _qwen3_next_config,
    "qwen3_next_moe": _qwen3_next_moe_config,
    "gpt_oss": _gpt_oss_config,
    "gemma2": _gemma2_config,
    "gemma3": _gemma3_text_config,
    "gemma3_vlm": _gemma3_vlm_config,
    "mistral": _mistral_config,
}
"""Model kinds and their config builders."""


def build_model(spec: TinyModelSpec, tokenizer):
    """A randomly initialised causal LM of `spec`'s shape, in float32, seeded."""
    import torch
    from transformers import AutoModelForCausalLM

    special_ids = {
        "bos_token_id": None,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
    }
    if spec.kind not in _BUILDERS:
        raise ValueError(f"kind={spec.kind!r}; expected one of {sorted(_BUILDERS)}")
    config = _BUILDERS[spec.kind](spec, special_ids)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spec.kind == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, GPT_OSS_SINK_STD)
    model.generation_config.eos_token_id = [special_ids["eos_token_id"], tokenizer.pad_token_id]
    return model.eval()


def save_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write model weights (safetensors), config and tokenizer to `out_dir`, loadable by vLLM and HF."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, spec.template, spec.seed)
    build_model(spec, tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

"""Tiny random models and tokenizers, built offline in seconds, for tests, demos and benchmarks.

Owns: a byte-level BPE tokenizer trained on a procedural corpus (its size equals the model's vocab, so
a random model never samples an id that decodes to nothing), two chat templates (a tool-calling
ChatML template, and a variant that rewrites earlier assistant turns the way thinking-stripping
templates do, so re-tokenisation drift can be tested), a Qwen3-style dense decoder and a Gated
DeltaNet hybrid in the Qwen3.5 style (transformers' `qwen3_5` text model: 3 linear-attention layers
to 1 full-attention layer, as the real checkpoints interleave them).

Does not know: vLLM, training, packing. Nothing here touches the network.

vLLM's CPU attention needs head_dim in {32, 64, 80, 96, 112, 128, ...}; the defaults use 32.
Build time: about 1 s for the tokenizer and well under 1 s for each model on 2 cores.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

# ChatML with tools. Tool calls are JSON objects between <tool_call> tags, one per call, in the order
# the model emitted them; tool results come back as user turns wrapped in <tool_response>.
_TOOLS_HEADER = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call a function with <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call><|im_end|>\n'
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
)

_TOOL_CALLS = (
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '<tool_call>\n{"name": "{{ fn.name }}", "arguments": '
    "{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
)

# `{content}` is replaced by the expression that renders an assistant message's text.
_MESSAGES = (
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'user' or message.role == 'system' %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{content}" + _TOOL_CALLS + "<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOL_TEMPLATE = _TOOLS_HEADER + _MESSAGES.replace("{content}", "{{ message.content or '' }}")

# Strips `<think>...</think>` from every assistant message except the final message of the list, as
# thinking-stripping templates do: the next turn's prompt no longer extends the tokens sampled so far.
HISTORY_REWRITE_TEMPLATE = _TOOLS_HEADER + _MESSAGES.replace(
    "{content}",
    "{% set text = message.content or '' %}"
    "{% if not loop.last and '</think>' in text %}{% set text = text.split('</think>')[-1].lstrip() %}"
    "{% endif %}{{ text }}",
)

TEMPLATES = {"tools": TOOL_TEMPLATE, "history_rewrite": HISTORY_REWRITE_TEMPLATE}

# How transformers' `tokenizer.parse_response` reads an assistant turn of these templates back into a
# message: optional <think> reasoning, JSON tool calls between <tool_call> tags, and the text before.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"},
    },
}

_WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find answer question tool result reason "
    "think step add sum compute value true false error weather city search"
).split()


def _corpus(num_lines: int, seed: int) -> list[str]:
    """Procedural text in the shapes the tests produce: prose, arithmetic, JSON tool calls, ChatML."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14)))
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        shape = i % 4
        if shape == 0:
            lines.append(f"{words.capitalize()}.")
        elif shape == 1:
            lines.append(f"What is {a} + {b}? {words} The answer is {a + b}.")
        elif shape == 2:
            lines.append(f'{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}} -> {a + b}')
        else:
            lines.append(f"<|im_start|>user\n{words}<|im_end|>\n<|im_start|>assistant\n{a * b}<|im_end|>")
    return lines


def build_tokenizer(vocab_size: int = 512, template: str = "tools", seed: int = 0):
    """A `PreTrainedTokenizerFast` with exactly `vocab_size` tokens and the named chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if template not in TEMPLATES:
        raise ValueError(f"template={template!r}; expected one of {sorted(TEMPLATES)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"trained {tok.get_vocab_size()} tokens for vocab_size={vocab_size}; "
            "use a vocab_size between 300 and 4096 so the procedural corpus fills it exactly"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=TEMPLATES[template],
        response_template=RESPONSE_TEMPLATE,
        model_max_length=4096,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyModelSpec:
    """Shape of a tiny random model; defaults are the smallest that vLLM's CPU backend serves."""

    kind: str = "qwen3"
    """`qwen3` (dense), `hybrid` (Gated DeltaNet + attention, transformers' `qwen3_5` text model) or `moe`
    (Qwen3-MoE: 4 experts, 2 per token, for the router loss)."""
    vocab_size: int = 512
    """Equals the tokenizer's size, 300..4096."""
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    """For `hybrid`, every fourth layer is full attention (and the last layer always is)."""
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


def _hybrid_config(spec: TinyModelSpec, special_ids: dict[str, int]):
    from transformers import Qwen3_5TextConfig

    layer_types = [
        "full_attention" if (i % 4 == 3 or i == spec.num_layers - 1) else "linear_attention"
        for i in range(spec.num_layers)
    ]
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


def build_model(spec: TinyModelSpec, tokenizer):
    """A randomly initialised causal LM of `spec`'s shape, in float32, seeded."""
    import torch
    from transformers import AutoModelForCausalLM

    special_ids = {
        "bos_token_id": None,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
    }
    builders = {"qwen3": _qwen3_config, "hybrid": _hybrid_config, "moe": _moe_config}
    if spec.kind not in builders:
        raise ValueError(f"kind={spec.kind!r}; expected one of {sorted(builders)}")
    config = builders[spec.kind](spec, special_ids)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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


def main() -> None:
    parser = argparse.ArgumentParser(description="Build a tiny random model + tokenizer offline.")
    parser.add_argument("out_dir")
    parser.add_argument("--kind", default="qwen3", choices=["qwen3", "hybrid"])
    parser.add_argument("--template", default="tools", choices=sorted(TEMPLATES))
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    spec = TinyModelSpec(
        kind=args.kind,
        template=args.template,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        seed=args.seed,
    )
    print(save_tiny_model(args.out_dir, spec))


if __name__ == "__main__":
    main()

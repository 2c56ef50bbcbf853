"""The tiny tokenizer of `agrpo_attention.testing`: byte-level BPE trained offline on a procedural corpus.

Owns the special tokens, two chat templates (a tool-calling ChatML template, and a variant that
rewrites earlier assistant turns the way thinking-stripping templates do, so re-tokenisation drift can
be tested), the `response_template` that lets transformers' `parse_response` read an assistant turn
back, and `build_tokenizer`. Its size equals the tiny model's vocabulary, so a random model never
samples an id that decodes to nothing. Does not know models (`_tiny_model.py`), vLLM or training.
Nothing here touches the network; building takes about 1 s on 2 cores.
"""

from __future__ import annotations

import random

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

import copy

import pytest

from agrpo_rollout._assistant_message import parse_assistant_turn, parser_kind

# The Qwen3 response template of transformers' serving fallbacks, which the tiny ChatML+<tool_call>
# tokenizer also follows (the lead may attach it to tools/tiny_models.py's tokenizer).
QWEN3_RESPONSE_TEMPLATE = {
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
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>|<\|eot_id\|>)", "content": "text"},
    },
}

CALLS = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n<tool_call>\n{"name": "mul", "arguments": "{\\"x\\": 1}"}\n</tool_call><|im_end|>'


@pytest.fixture
def template_tokenizer(tool_tokenizer):
    tokenizer = copy.deepcopy(tool_tokenizer)
    tokenizer.response_template = QWEN3_RESPONSE_TEMPLATE
    return tokenizer


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("kind", ["tagged", "template"])
def test_tool_calls_parse_in_order(tool_tokenizer, template_tokenizer, kind):
    tokenizer = template_tokenizer if kind == "template" else tool_tokenizer
    assert parser_kind(tokenizer) == kind
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False
    )
    message = parse_assistant_turn(tokenizer, _ids(tokenizer, "Let me add." + CALLS), prompt, kind)
    assert message.parse_error is None
    assert message.content == "Let me add."
    assert [c["function"] for c in message.tool_calls] == [
        {"name": "add", "arguments": {"a": 2, "b": 3}},
        {"name": "mul", "arguments": {"x": 1}},
    ]
    assert message.as_chat_message()["tool_calls"] == message.tool_calls


@pytest.mark.parametrize("kind", ["tagged", "template"])
def test_malformed_calls_become_plain_text(tool_tokenizer, template_tokenizer, kind):
    tokenizer = template_tokenizer if kind == "template" else tool_tokenizer
    message = parse_assistant_turn(
        tokenizer, _ids(tokenizer, "oops <tool_call> {not json<|im_end|>"), [], kind
    )
    assert message.parse_error and not message.tool_calls
    assert message.content == "oops <tool_call> {not json"


def test_plain_text_strips_the_end_marker(tool_tokenizer):
    message = parse_assistant_turn(
        tool_tokenizer, _ids(tool_tokenizer, "The answer is 5.<|im_end|>"), [], "plain"
    )
    assert message.as_chat_message() == {"role": "assistant", "content": "The answer is 5."}

import copy

import pytest

from agrpo_rollout._assistant_message import parse_assistant_turn, parser_kind

CALLS = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n<tool_call>\n{"name": "mul", "arguments": "{\\"x\\": 1}"}\n</tool_call><|im_end|>'


@pytest.fixture
def template_tokenizer(tool_tokenizer):
    """The tiny tokenizer carries a `response_template` (agrpo_attention.testing), read by `parse_response`."""
    assert tool_tokenizer.response_template is not None
    return tool_tokenizer


@pytest.fixture
def tagged_tokenizer(tool_tokenizer):
    """The same tokenizer without a response template: calls are read from the <tool_call> tags."""
    tokenizer = copy.deepcopy(tool_tokenizer)
    tokenizer.response_template = None
    return tokenizer


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("kind", ["tagged", "template"])
def test_tool_calls_parse_in_order(tagged_tokenizer, template_tokenizer, kind):
    tokenizer = template_tokenizer if kind == "template" else tagged_tokenizer
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
def test_malformed_calls_become_plain_text(tagged_tokenizer, template_tokenizer, kind):
    tokenizer = template_tokenizer if kind == "template" else tagged_tokenizer
    message = parse_assistant_turn(
        tokenizer, _ids(tokenizer, "oops <tool_call> {not json<|im_end|>"), [], kind
    )
    assert message.parse_error and not message.tool_calls
    assert message.content == "oops <tool_call> {not json"


@pytest.mark.parametrize("kind", ["tagged", "template"])
@pytest.mark.parametrize("body", ["5", '"add"', "[1, 2]", '{"function": 7}', '{"name": 3}'])
def test_well_formed_json_that_is_no_call_becomes_plain_text(
    tagged_tokenizer, template_tokenizer, kind, body
):
    """An untrained policy emits any JSON between the tags (seen: `5`); it is a parse failure, not a crash."""
    tokenizer = template_tokenizer if kind == "template" else tagged_tokenizer
    text = f"x<tool_call>\n{body}\n</tool_call><|im_end|>"
    message = parse_assistant_turn(tokenizer, _ids(tokenizer, text), [], kind)
    assert message.parse_error and not message.tool_calls


def test_plain_text_strips_the_end_marker(tool_tokenizer):
    message = parse_assistant_turn(
        tool_tokenizer, _ids(tool_tokenizer, "The answer is 5.<|im_end|>"), [], "plain"
    )
    assert message.as_chat_message() == {"role": "assistant", "content": "The answer is 5."}

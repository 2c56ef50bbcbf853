"""`AssistantMessage`: the assistant message of one sampled turn, tool calls parsed out.

Owns turning output tokens into `{"role": "assistant", "content": ..., "tool_calls": [...]}`, by the
tokenizer's own conventions. Two parsers, chosen per tokenizer:
- `template`: transformers' `tokenizer.parse_response` when the tokenizer carries a
  `response_template` (transformers >= 5.13), given the tail of the prompt as `prefix` because
  templates pre-write part of the assistant turn;
- `tagged`: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks (the Hermes/Qwen
  convention) when the chat template mentions `<tool_call>` but no response template exists.
Otherwise the message is plain text. A response the parser cannot read (a random model emits
half-formed calls) becomes plain text and is counted as a parse failure, never an exception.
Does not know tools: running calls is `_toolbox.py`'s job.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_TAGGED_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PREFIX_TOKENS = 64


@dataclass(slots=True)
class AssistantMessage:
    """One parsed assistant turn."""

    content: str
    """The text shown to the user, end-of-turn markers and tool-call blocks removed."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """`{"type": "function", "function": {"name": str, "arguments": dict}}` in the order emitted."""
    parse_error: str | None = None
    """Why tool-call parsing failed, when it did (the turn then counts as plain text)."""

    def as_chat_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def _end_markers(tokenizer: Any) -> list[str]:
    names = [tokenizer.eos_token, tokenizer.pad_token, "<|im_end|>", "<|endoftext|>", "<|eot_id|>"]
    return [n for n in names if n]


def _strip_end(text: str, markers: list[str]) -> str:
    text = text.rstrip()
    changed = True
    while changed:
        changed = False
        for marker in markers:
            if text.endswith(marker):
                text, changed = text[: -len(marker)].rstrip(), True
    return text


def _normalise_call(call: Any) -> dict[str, Any]:
    """Accept `{"name", "arguments"}` or `{"type", "function": {...}}`; arguments become a dict."""
    if not isinstance(call, dict):
        raise ValueError(f"tool call is {type(call).__name__}, not an object")
    function = call.get("function", call)
    if not isinstance(function, dict):  # e.g. `<tool_call>5</tool_call>` from an untrained policy
        raise ValueError(
            f"tool call function is {type(function).__name__}, not an object: {function!r}"[:200]
        )
    name, arguments = function.get("name"), function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise ValueError(f"tool call needs a string name and object arguments, got {function!r}")
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def parser_kind(tokenizer: Any) -> str:
    """`template`, `tagged` or `plain`: how this tokenizer's turns are parsed."""
    if getattr(tokenizer, "response_template", None) is not None:
        return "template"
    if "<tool_call>" in (getattr(tokenizer, "chat_template", None) or ""):
        return "tagged"
    return "plain"


def parse_assistant_turn(tokenizer: Any, output_ids: Any, prompt_ids: Any, kind: str) -> AssistantMessage:
    """Parse one turn's output tokens with the parser `kind` returned by `parser_kind`."""
    text = tokenizer.decode(list(output_ids), skip_special_tokens=False)
    markers = _end_markers(tokenizer)
    if kind == "template":
        prefix = tokenizer.decode(list(prompt_ids[-_PREFIX_TOKENS:]), skip_special_tokens=False)
        try:
            parsed = tokenizer.parse_response(text, prefix=prefix)
            calls = [_normalise_call(c) for c in parsed.get("tool_calls") or []]
        except (ValueError, KeyError, TypeError) as exc:  # malformed model output, not a bug here
            return AssistantMessage(content=_strip_end(text, markers), parse_error=str(exc)[:200])
        return AssistantMessage(content=_strip_end(parsed.get("content") or "", markers), tool_calls=calls)
    if kind == "tagged" and "<tool_call>" in text:
        head = text.split("<tool_call>", 1)[0]
        try:
            calls = [_normalise_call(json.loads(body)) for body in _TAGGED_CALL.findall(text)]
            if not calls:
                raise ValueError("<tool_call> without a closing </tool_call>")
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            return AssistantMessage(content=_strip_end(text, markers), parse_error=str(exc)[:200])
        return AssistantMessage(content=_strip_end(head, markers), tool_calls=calls)
    return AssistantMessage(content=_strip_end(text, markers))

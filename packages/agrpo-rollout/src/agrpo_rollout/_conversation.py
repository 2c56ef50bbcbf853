"""Small steps of one conversation that the default `generate_one` is made of.

Owns rendering a message list to token ids with the chat template, appending an environment's
`reset()` text to the last user message, and the bookkeeping of a multi-turn conversation
(`Conversation`). Does not know HTTP or tools' execution.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._assistant_message import AssistantMessage
from ._routed_experts import routed_tokens
from ._sequence import common_prefix_length
from ._turn import TurnRecord


def render_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], tool_schemas: list[dict], template_kwargs: dict
) -> list[int]:
    """Token ids of the whole conversation plus the generation prompt."""
    ids = tokenizer.apply_chat_template(
        messages,
        tools=tool_schemas or None,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **template_kwargs,
    )
    return list(ids)


def with_reset_text(prompt: Any, returned: Any) -> Any:
    """The prompt with what `reset()` returned appended to its last user message (a copy)."""
    if returned is None:
        return prompt
    text = returned if isinstance(returned, str) else "\n".join(str(part) for part in returned)
    if isinstance(prompt, str):
        return f"{prompt}\n\n{text}" if prompt else text
    messages = copy.deepcopy(list(prompt))
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content") or ""
            message["content"] = f"{content}\n\n{text}" if content else text
            return messages
    messages.append({"role": "user", "content": text})
    return messages


@dataclass(slots=True)
class Conversation:
    """The state of one multi-turn rollout while it runs."""

    messages: list[dict[str, Any]]
    budget: int
    """Tokens the rollout may still generate."""
    completion: list[dict[str, Any]] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    tool_calls: int = 0
    tool_failures: int = 0
    tool_rounds: int = 0

    routed_prefix: int = 0
    """Leading tokens of the last turn's prompt + output that this rollout's turns hold MoE routes for: up to
    the first token no request forwarded (a turn's last sampled token, tokens a test loop dictated)."""

    def routes_from(self, prompt_ids: list[int]) -> int:
        """Where the next turn's MoE routes should start (`routed_experts_prompt_start`): the leading prompt
        tokens the rollout already holds routes for and shares with the last turn. 0 without routes."""
        if not self.turns or self.turns[-1].routed_experts is None:
            return 0
        last = self.turns[-1]
        held = np.concatenate([last.prompt_ids, last.output_ids])
        return min(common_prefix_length(held, np.asarray(prompt_ids, dtype=np.int64)), self.routed_prefix)

    def add_turn(self, turn: TurnRecord, message: AssistantMessage, routes_from: int = 0) -> None:
        """Record a turn whose request asked for routes from `routes_from` on."""
        if turn.routed_experts is not None:
            unrouted = np.flatnonzero(~routed_tokens(turn.routed_experts[routes_from:]))
            self.routed_prefix = routes_from + int(
                unrouted[0] if unrouted.size else turn.routed_experts.shape[0] - routes_from
            )
        self.turns.append(turn)
        self.completion_ids.extend(turn.output_ids.tolist())
        self.budget -= turn.num_output_tokens
        chat_message = message.as_chat_message()
        self.messages.append(chat_message)
        self.completion.append(chat_message)

    def add_tool_messages(self, messages: list[dict[str, Any]], failures: int) -> None:
        self.messages.extend(messages)
        self.completion.extend(messages)
        self.tool_calls += len(messages)
        self.tool_failures += failures
        self.tool_rounds += 1

"""`Rollout`: one finished conversation, as `generate_one` returns it.

Owns the record only. Does not know how it was generated, scored or turned into sequences.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from ._turn import TurnRecord


def new_rollout_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(slots=True)
class Rollout:
    """One conversation: what the model said, the sampling requests behind it and its tool use."""

    completion: list[dict[str, Any]] | str
    """Messages generated after the prompt (conversational prompts) or the generated text (text prompts);
    reward functions receive it as `completions`."""
    completion_ids: list[int]
    """Every generated token of every turn, in order; reward functions receive it as `completion_ids`."""
    turns: list[TurnRecord]
    """The sampling requests, in order; training sequences are built from them."""
    tool_call_count: int = 0
    """Tool calls executed during the rollout."""
    tool_failure_count: int = 0
    """Tool calls that raised or named an unknown tool."""
    reward: float | None = None
    """A reward computed during generation (e.g. by an external grader); added to the other sources."""
    rollout_id: str = field(default_factory=new_rollout_id)
    """Identifies the conversation in training rows, for debugging."""
    clipped: bool = False
    """True when the last turn was cut by the length budget instead of ending with EOS."""
    tool_loop_exhausted: bool = False
    """True when the model still called tools at `max_tool_calling_iterations`."""

    @property
    def num_generated_tokens(self) -> int:
        return len(self.completion_ids)

"""Faulty parts for the trainer's fault tests (`test_faults.py`), importable by the spawned rollout process
(pytest's `pythonpath` lists this folder): reward functions that return None, NaN or inf for some
rollouts or raise, tools that raise, hang or do not exist, an environment whose `reset()` raises, and a
loop whose rollouts call those tools.

A random tiny model never writes a well-formed tool call, so `FaultyToolLoop` samples a few real tokens
per first turn and appends the calls a tool-using model would make (context only, never trained), as
`rollout_doubles.ToolCallingLoop` does: one to a tool that raises, one to a tool that does not exist and
one to a tool that never returns (cut by `tool_timeout_s`).
"""

from __future__ import annotations

import asyncio
import math

from agrpo_rollout import AsyncRolloutLoop
from agrpo_rollout.testing import scripted_turn
from agrpo_trainer import AsyncGRPOTrainer


def text_length(completions, **columns) -> list[float]:
    """Characters of each completion's final message: spread inside a group, so groups are kept."""
    return [float(len(str(c[-1]["content"]))) for c in completions]


def patchy_reward(completions, **columns) -> list[float | None]:
    """A second source that cannot score every rollout: None, NaN and inf for rollouts 1, 2 and 3 of a group
    (each is left out of that rollout's reward; inf is also counted in `rollout/rewards_nonfinite_total`)."""
    values: list[float | None] = [1.0, None, math.nan, math.inf]
    return [values[i % 4] for i in range(len(completions))]


def exploding_reward(completions, **columns) -> list[float]:
    """A reward function with a bug on some input."""
    raise KeyError("solution")


def wrong_length_reward(completions, **columns) -> list[float]:
    """A reward function that scores the first completion only."""
    return [0.0]


def explode(reason: str) -> str:
    """A tool that fails.

    Args:
        reason: What went wrong.
    """
    raise RuntimeError(f"the tool failed: {reason}")


async def stall(seconds: int) -> str:
    """A tool that never answers in time.

    Args:
        seconds: How long to wait.
    """
    await asyncio.sleep(3600)
    return "late"


class BrokenSandbox:
    """An environment whose `reset()` fails (a sandbox that does not start)."""

    def reset(self, **row):
        raise ConnectionRefusedError("sandbox at 10.0.0.7:8080 refused the connection")

    def run(self, code: str) -> str:
        """Run code in the sandbox.

        Args:
            code: The code.
        """
        return ""


class FaultyToolLoop(AsyncRolloutLoop):
    """First turn: up to 3 real tokens that read as plain text, then three scripted calls (`explode`, an
    unknown `no_such_tool`, `stall`); once the tools answered, a real turn."""

    script = "".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
        for name, args in (
            ("explode", '{"reason": "disk"}'),
            ("no_such_tool", "{}"),
            ("stall", '{"seconds": 5}'),
        )
    )

    async def generate_one_turn(self, prompt_ids, max_tokens=None):
        real = await super().generate_one_turn(prompt_ids, max_tokens=min(3, max_tokens or 3))
        if (
            real.num_output_tokens == 0
            or self.tokenizer.convert_tokens_to_ids("<tool_response>") in prompt_ids
        ):
            return real  # no room left under max_model_len, or the tools already answered
        return scripted_turn(self.tokenizer, real, self.script)


class FaultyToolTrainer(AsyncGRPOTrainer):
    loop_cls = FaultyToolLoop

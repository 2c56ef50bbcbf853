"""`Toolbox`: the tools one rollout may call, their JSON schemas, and running one turn's calls.

Owns tool registration by `__name__`, schema extraction (transformers' `get_json_schema`, so tools
need type hints and a Google-style docstring), and execution: calls of one assistant turn run one
after another in the order the model emitted them; sync tools run in the caller's thread pool so a
slow tool never stalls the event loop, async tools run on the loop. An unknown name, a raising tool
or a call still running after `timeout_s` becomes a tool message the model sees, never an exception
(a timed-out async tool is cancelled; a sync tool's thread cannot be stopped, so it finishes in the
pool and its result is dropped). Does not know chat templates or metrics (it returns `ToolOutcome`s;
the loop counts them).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from ._exceptions import ToolSetupError


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """What one tool call produced."""

    name: str
    """The name the model asked for."""
    content: str
    """The tool message content: the result as text, or the error."""
    failed: bool
    """True when the tool raised, did not return in time, or the name was unknown."""
    unknown: bool
    """True when no tool has that name (a policy error, not a tool error)."""
    latency_s: float
    """Wall time of the call in seconds (0 for unknown names)."""

    def as_chat_message(self) -> dict[str, Any]:
        return {"role": "tool", "name": self.name, "content": self.content}


def _schema(tool: Callable) -> dict[str, Any]:
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        return get_json_schema(tool)
    except (DocstringParsingException, TypeHintParsingException, ValueError, TypeError) as exc:
        raise ToolSetupError(
            f"tool {getattr(tool, '__name__', tool)!r} cannot be described to the model: {exc}. Give it type "
            "hints and a Google-style docstring with an `Args:` section for every argument"
        ) from exc


def _as_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list, tuple, int, float, bool)) or result is None:
        return json.dumps(result, default=str)
    return str(result)


class Toolbox:
    """Tools by name; `schemas` is what `apply_chat_template(tools=...)` receives."""

    def __init__(
        self, tools: Sequence[Callable] = (), schemas: Sequence[dict[str, Any]] | None = None
    ) -> None:
        self.by_name: dict[str, Callable] = {}
        for tool in tools:
            name = getattr(tool, "__name__", None)
            if not callable(tool) or not name or name == "<lambda>":
                raise ToolSetupError(
                    f"tool {tool!r} has no usable __name__; tools are called by name, so pass module-level "
                    "functions or bound methods (not lambdas or functools.partial)"
                )
            if name in self.by_name:
                raise ToolSetupError(f"two tools are named {name!r}; tool names must be unique")
            self.by_name[name] = tool
        self.schemas = list(schemas) if schemas is not None else [_schema(t) for t in self.by_name.values()]

    def __add__(self, other: Toolbox) -> Toolbox:
        return Toolbox([*self.by_name.values(), *other.by_name.values()], [*self.schemas, *other.schemas])

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def __len__(self) -> int:
        return len(self.by_name)

    def __iter__(self) -> Iterator[Callable]:
        """Iterates the tools themselves, so a `Toolbox` reads like the reference's `list[Callable]`."""
        return iter(self.by_name.values())

    async def _call(self, tool: Callable, arguments: dict[str, Any], executor: Executor | None) -> Any:
        if inspect.iscoroutinefunction(tool):
            return await tool(**arguments)
        result = await asyncio.get_running_loop().run_in_executor(
            executor, functools.partial(tool, **arguments)
        )
        return await result if inspect.isawaitable(result) else result

    async def _result(
        self,
        name: str,
        tool: Callable,
        arguments: dict[str, Any],
        executor: Executor | None,
        timeout_s: float | None,
    ) -> tuple[str, bool]:
        """(tool message content, failed) of one call."""
        try:
            async with asyncio.timeout(timeout_s) as limit:
                return _as_text(await self._call(tool, arguments, executor)), False
        except TimeoutError as exc:
            if limit.expired():
                return f"Error: TimeoutError: tool {name!r} did not return within {timeout_s:g} s", True
            return f"Error: TimeoutError: {exc}", True  # the tool's own timeout
        except Exception as exc:  # noqa: BLE001 - a tool's error is shown to the model (SPEC F-ROLL)
            return f"Error: {type(exc).__name__}: {exc}", True

    async def run(
        self,
        calls: Sequence[dict[str, Any]],
        executor: Executor | None = None,
        timeout_s: float | None = None,
    ) -> list[ToolOutcome]:
        """Run one assistant turn's calls in the order given and return one outcome per call; a call still
        running after `timeout_s` seconds (None: no limit) becomes an error message."""
        outcomes = []
        for call in calls:
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            tool = self.by_name.get(name)
            if tool is None:
                known = ", ".join(sorted(self.by_name)) or "none"
                outcomes.append(
                    ToolOutcome(name, f"Error: unknown tool {name!r}; tools: {known}", True, True, 0.0)
                )
                continue
            start = time.perf_counter()
            content, failed = await self._result(name, tool, arguments, executor, timeout_s)
            outcomes.append(ToolOutcome(name, content, failed, False, time.perf_counter() - start))
        return outcomes

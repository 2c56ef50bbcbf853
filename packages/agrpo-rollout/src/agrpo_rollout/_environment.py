"""`EnvironmentPool`: environments from an `environment_factory`, one live instance per rollout.

Owns the factory contract: a zero-argument callable, or a dict name -> callable selected by each
dataset row's `environment` column; `reset(**row)` (sync or async) may return text appended to the
last user message; every other public method is a tool; an optional `get_reward()` is an extra
reward source named after the class. Instances are built once and reused ("construct once, reset
often"): a finished rollout returns its instance to the pool. `reset` and `get_reward` run in the
tool thread pool, so a slow environment delays only its own rollout. A `reset()` or `get_reward()` that
raises ends the run with its own exception and a note naming the environment, the row's prompt and the
fix: like a raising reward function, it is a bug to fix, not a sample to skip unseen (`filter_prompt`
rejects rows an environment cannot start; `get_reward` may return None). Does not know the model loop.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any

from ._exceptions import ToolSetupError
from ._group import prompt_preview
from ._toolbox import Toolbox

ENVIRONMENT_COLUMN = "environment"
_NOT_TOOLS = frozenset({"reset", "get_reward"})


async def _call(method: Callable, executor: Executor | None, **kwargs: Any) -> Any:
    if inspect.iscoroutinefunction(method):
        return await method(**kwargs)
    result = await asyncio.get_running_loop().run_in_executor(executor, lambda: method(**kwargs))
    return await result if inspect.isawaitable(result) else result


def _tool_methods(instance: object) -> list[Callable]:
    names = [n for n in dir(type(instance)) if not n.startswith("_") and n not in _NOT_TOOLS]
    return [getattr(instance, n) for n in names if callable(getattr(instance, n))]


class EnvironmentPool:
    """Builds, resets and recycles environment instances; exposes their tools and rewards."""

    def __init__(self, factory: Callable[[], object] | Mapping[str, Callable[[], object]]) -> None:
        self.factories = dict(factory) if isinstance(factory, Mapping) else {"": factory}
        self.is_dict = isinstance(factory, Mapping)
        self._free: dict[str, list[object]] = {name: [] for name in self.factories}
        self._schemas: dict[type, list[dict[str, Any]]] = {}

    def name_for(self, row: Mapping[str, Any]) -> str:
        """The factory key of `row`: its `environment` column with a dict factory, else ``""``."""
        if not self.is_dict:
            return ""
        name = row.get(ENVIRONMENT_COLUMN)
        if name not in self.factories:
            raise ValueError(
                f"row has {ENVIRONMENT_COLUMN}={name!r} but environment_factory knows {sorted(self.factories)}; "
                f"add an `{ENVIRONMENT_COLUMN}` column naming one of them to every dataset row"
            )
        return name

    def _build(self, name: str) -> object:
        instance = self.factories[name]()
        if not callable(getattr(instance, "reset", None)):
            raise ToolSetupError(
                f"environment {type(instance).__name__} has no reset() method; define reset(**row)"
            )
        return instance

    def toolbox(self, instance: object) -> Toolbox:
        """The instance's public methods as tools (schemas computed once per class)."""
        methods = _tool_methods(instance)
        if type(instance) not in self._schemas:
            self._schemas[type(instance)] = Toolbox(methods).schemas
        return Toolbox(methods, self._schemas[type(instance)])

    async def acquire(
        self, row: Mapping[str, Any], executor: Executor | None
    ) -> tuple[str, object, Any, float]:
        """(name, instance, what reset returned, reset seconds) for one new rollout of `row`."""
        name = self.name_for(row)
        instance = self._free[name].pop() if self._free[name] else self._build(name)
        start = time.perf_counter()
        kwargs = {k: v for k, v in row.items() if isinstance(k, str)}
        try:
            returned = await _call(instance.reset, executor, **kwargs)
        except Exception as error:
            error.add_note(
                f"environment {type(instance).__name__}.reset() raised for the row with prompt "
                f"{prompt_preview(row.get('prompt'))!r}, which stops the run: make reset() handle such rows, "
                "or reject the rows it cannot start in filter_prompt"
            )
            raise
        return name, instance, returned, time.perf_counter() - start

    async def reward(self, instance: object, executor: Executor | None) -> tuple[float | None, float]:
        """(get_reward() or None when the class has none, seconds spent)."""
        get_reward = getattr(instance, "get_reward", None)
        if get_reward is None:
            return None, 0.0
        start = time.perf_counter()
        try:
            value = await _call(get_reward, executor)
        except Exception as error:
            error.add_note(
                f"environment {type(instance).__name__}.get_reward() raised, which stops the run: fix it, or "
                "return None for a rollout it cannot score (its reward then comes from the other sources)"
            )
            raise
        return (None if value is None else float(value)), time.perf_counter() - start

    def release(self, name: str, instance: object) -> None:
        """Return an instance for reuse by a later rollout."""
        self._free[name].append(instance)

"""`RewardScorer`: runs reward functions over a group and sums reward sources.

Owns the reward-function contract: `func(prompts=..., completions=..., completion_ids=..., **columns)`
returns a list with one float or None per rollout; sync functions run in the tool thread pool, async
ones on the loop, all functions of a group concurrently. `None` (and NaN) exclude that source for that
rollout; so do +-inf and values beyond float32's range (`exclude_unusable`, counted by the caller as
`rollout/rewards_nonfinite_total`, see `_group.usable_rewards`); a rollout no source scored gets NaN.

A function that raises ends the run with its own exception and a note naming it and the fix (return None
for what it cannot score). It is not turned into a silent exclusion: a source that fails, often on every
group (a misnamed column, a verifier that cannot start), would leave training on the other sources alone,
or on nothing, with no sign of it; None is the per-rollout opt-out a function chooses on purpose.
Does not know advantages or environments (their rewards arrive as extra columns).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from ._group import usable_rewards

RAISED_NOTE = (
    "reward function {name!r} raised, which stops the run (a failing source would otherwise change what is "
    "optimised unseen). Fix it, or make it return None for the completions it cannot score: that leaves this "
    "source out of those rollouts' rewards, and the other sources still count"
)
"""The note added to the exception of a reward function that raised."""


def reward_name(func: Callable) -> str:
    """A reward function's metric name: its `__name__`, the wrapped function's, or its class name."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", None) or type(func).__name__


def sum_rewards(columns: Sequence[np.ndarray]) -> np.ndarray:
    """(G,) sum over sources ignoring NaN; NaN where every source is NaN."""
    if not columns:
        raise ValueError(
            "no reward source: pass reward_funcs, an environment with get_reward, or set Rollout.reward"
        )
    stacked = np.stack([np.asarray(c, dtype=np.float64) for c in columns])
    scored = ~np.isnan(stacked)
    return np.where(scored.any(axis=0), np.where(scored, stacked, 0.0).sum(axis=0), np.nan)


def exclude_unusable(columns: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Columns with +-inf and out-of-range values set to NaN, and how many each source had."""
    out, counts = {}, {}
    for name, values in columns.items():
        bad = ~usable_rewards(values) & ~np.isnan(values)
        out[name] = np.where(bad, np.nan, values)
        if bad.any():
            counts[name] = int(bad.sum())
    return out, counts


def with_other_sources(
    columns: dict[str, np.ndarray],
    env_rewards: Sequence[tuple[type, float] | None],
    rollout_rewards: Sequence[float | None],
) -> dict[str, np.ndarray]:
    """Reward-function columns plus an environment column (named after its class) and a `rollout`
    column (`Rollout.reward`), each added only when some rollout has that source."""
    columns = dict(columns)
    if any(e is not None for e in env_rewards):
        name = next(e[0].__name__ for e in env_rewards if e is not None)
        columns[name] = np.asarray([np.nan if e is None else e[1] for e in env_rewards], dtype=np.float64)
    if any(r is not None for r in rollout_rewards):
        columns["rollout"] = np.asarray(
            [np.nan if r is None else r for r in rollout_rewards], dtype=np.float64
        )
    return columns


class RewardScorer:
    """The reward functions of a loop, by name."""

    def __init__(self, reward_funcs: Sequence[Callable] = ()) -> None:
        self.funcs = list(reward_funcs)
        self.names = [reward_name(f) for f in self.funcs]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"reward functions share names {self.names}; give each a distinct __name__")

    async def _run_one(
        self, name: str, func: Callable, kwargs: dict[str, Any], executor: Executor | None
    ) -> Any:
        try:
            if inspect.iscoroutinefunction(func):
                return await func(**kwargs)
            call = functools.partial(func, **kwargs)
            result = await asyncio.get_running_loop().run_in_executor(executor, call)
            return await result if inspect.isawaitable(result) else result
        except Exception as error:
            error.add_note(RAISED_NOTE.format(name=name))
            raise

    async def score(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        reward_kwargs: dict[str, list[Any]],
        executor: Executor | None = None,
    ) -> dict[str, np.ndarray]:
        """Name -> (G,) float64 rewards, NaN where a function returned None."""
        kwargs = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            **reward_kwargs,
        }
        results = await asyncio.gather(
            *(self._run_one(n, f, kwargs, executor) for n, f in zip(self.names, self.funcs, strict=True))
        )
        return {
            name: _reward_column(name, values, len(prompts))
            for name, values in zip(self.names, results, strict=True)
        }


def _reward_column(name: str, values: Any, num_completions: int) -> np.ndarray:
    """One function's (G,) float64 rewards, NaN for None; the errors name the function."""
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise TypeError(
            f"reward function {name} returned {values!r} ({type(values).__name__}); it must return a list "
            f"with one float (or None) per completion, here {num_completions}"
        )
    values = list(values)
    if len(values) != num_completions:
        raise ValueError(
            f"reward function {name} returned {len(values)} values for {num_completions} completions; return "
            "one float (or None) per completion, in the order of `completions`"
        )
    column = np.full(num_completions, np.nan)
    for i, value in enumerate(values):
        if value is None:
            continue
        try:
            column[i] = float(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"reward function {name} returned {value!r} for completion {i}; expected a float or None"
            ) from exc
    return column

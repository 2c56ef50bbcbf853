"""`RolloutHandoff`: everything the spawned rollout process receives, and the check that it can cross (SPEC F-PROC).

Owns what crosses the process boundary: the loop class and its settings (`LoopSettings`: the resolved
`RolloutConfig` first, then the trainer config's fields), tokenizer, dataset, rewards, tools, environment
factory and the resume position, pickled once at start and checked object by object, so a lambda fails with
its name and the fix. Does not know processes or channels (`_rollout_process.py`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from agrpo_rollout import RolloutConfig


class LoopSettings:
    """What the loop reads as `self.config`: the resolved `RolloutConfig` fields first, then the trainer
    config's (so fields of an `AsyncGRPOConfig` subclass reach a custom loop, as in the reference)."""

    def __init__(self, rollout: RolloutConfig, trainer: Any) -> None:
        self.rollout = rollout
        self.trainer = trainer

    def __getattr__(self, name: str) -> Any:
        if name in ("rollout", "trainer"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        try:
            return getattr(self.rollout, name)
        except AttributeError:
            return getattr(self.trainer, name)

    def __getstate__(self) -> dict[str, Any]:
        return {"rollout": self.rollout, "trainer": self.trainer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.rollout, self.trainer = state["rollout"], state["trainer"]


@dataclass(kw_only=True)
class RolloutHandoff:
    """Everything the spawned process gets; every part must pickle (module-level functions and classes)."""

    loop_cls: type
    settings: LoopSettings
    tokenizer: Any
    dataset: Any
    reward_funcs: list[Callable]
    tools: list[Callable]
    environment_factory: Any
    start_index: int = 0
    max_epochs: int | None = None
    skip_prompts: frozenset[tuple[int, int]] = frozenset()
    """Prompts a resumed run already trained, in the loop's own epochs."""
    sync_journal: str | None = None
    """The trainer's weight-sync journal: settled here if the trainer dies mid-sync (agrpo_sync)."""

    def build_loop(self) -> Any:
        return self.loop_cls(
            self.settings,
            tokenizer=self.tokenizer,
            dataset=self.dataset,
            reward_funcs=self.reward_funcs,
            tools=self.tools,
            environment_factory=self.environment_factory,
            start_index=self.start_index,
            max_epochs=self.max_epochs,
            skip_prompts=self.skip_prompts,
        )


def _named_parts(handoff: RolloutHandoff) -> Iterator[tuple[str, Any, str]]:
    """(name, object, fix) of every user-supplied part, checked one by one for a precise message."""
    module_level = (
        "define it at module level (a function, functools.partial of one, or a callable class instance)"
    )
    for i, func in enumerate(handoff.reward_funcs):
        yield f"reward_funcs[{i}] {getattr(func, '__qualname__', func)!r}", func, module_level
    for i, tool in enumerate(handoff.tools):
        fix = "tools are registered by __name__: make it a module-level function"
        yield f"tools[{i}] {getattr(tool, '__qualname__', tool)!r}", tool, fix
    factory = handoff.environment_factory
    factories = (
        factory.items() if isinstance(factory, dict) else ([("", factory)] if factory is not None else [])
    )
    for key, value in factories:
        where = f"environment_factory[{key!r}]" if key else "environment_factory"
        yield f"{where} {getattr(value, '__qualname__', value)!r}", value, module_level
    yield (
        f"loop_cls {handoff.loop_cls.__qualname__!r}",
        handoff.loop_cls,
        "define the loop subclass at module level",
    )
    yield "the trainer config (args)", handoff.settings.trainer, "keep config fields plain values"
    yield "train_dataset", handoff.dataset, "pass a datasets.Dataset/IterableDataset or a list of dicts"
    yield "processing_class", handoff.tokenizer, "pass a tokenizer loaded with from_pretrained"


def pickle_handoff(handoff: RolloutHandoff) -> bytes:
    """The handoff as bytes; a part that cannot cross the process boundary raises TypeError naming it."""
    for name, obj, fix in _named_parts(handoff):
        try:
            pickle.dumps(obj)
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            raise TypeError(
                f"{name} cannot be sent to the rollout process, which is spawned and receives everything pickled "
                f"({type(error).__name__}: {error}); a lambda or a closure cannot be pickled: {fix}"
            ) from error
    return pickle.dumps(handoff)

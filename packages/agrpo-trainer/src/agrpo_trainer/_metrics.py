"""`MetricWindow`: metrics gathered between two logging steps, reduced by what their names say.

Owns the reduction rule, one for every source (the rollout process's pushes, samples, micro-batches,
steps): a name containing `_total` is a count since the previous push and is summed, so every logged
`*_total` counts what happened within its logging window; `max` / `min` in the last path part take the
extreme; a running count (`num_tokens`) keeps its last value; everything else is averaged. NaNs are
skipped. Also owns `CounterDeltas`, which turns the running totals the rollout process pushes (counts
since its loop started, so a lost push loses nothing) into those per-push counts. Does not know where
metrics come from or where they go (the trainer hands `reduce()`'s dict to `Trainer.log`).
"""

from __future__ import annotations

import math
from collections import defaultdict

_RUNNING = frozenset({"num_tokens"})


def _rule(name: str) -> str:
    if name in _RUNNING:
        return "last"
    last = name.rsplit("/", 1)[-1]
    if "_total" in last or last.endswith("total"):
        return "sum"
    if last.startswith("max") or last.endswith("max") or "_max" in last:
        return "max"
    if last.startswith("min") or last.endswith("min") or "_min" in last:
        return "min"
    return "mean"


class MetricWindow:
    """Collects values per name; `reduce` empties the window."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = defaultdict(list)

    def add(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            value = float(value)
            if not math.isnan(value):
                self._values[name].append(value)

    def add_value(self, name: str, value: float) -> None:
        self.add({name: value})

    def reduce(self) -> dict[str, float]:
        out = {}
        for name, values in self._values.items():
            if not values:
                continue
            rule = _rule(name)
            if rule == "sum":
                out[name] = sum(values)
            elif rule == "max":
                out[name] = max(values)
            elif rule == "min":
                out[name] = min(values)
            elif rule == "last":
                out[name] = values[-1]
            else:
                out[name] = sum(values) / len(values)
        self._values.clear()
        return out


class CounterDeltas:
    """Running totals in, counts since the previous push out; other names pass through unchanged."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, metrics: dict[str, float]) -> dict[str, float]:
        out = {}
        for name, value in metrics.items():
            if _rule(name) == "sum":
                last = self._last.get(name, 0.0)
                self._last[name] = value
                value = value - last if value >= last else value  # a smaller total: a restarted counter
            out[name] = value
        return out

"""`MetricWindow`: metrics gathered between two logging steps, reduced by what their names say.

Owns the reduction rule, one for every source (the rollout process's pushes, samples, micro-batches,
steps): a name containing `_total` is a count since the previous push and is summed; `max` / `min` in
the last path part take the extreme; everything else is averaged. NaNs are skipped. Does not know where
metrics come from or where they go (the trainer hands `reduce()`'s dict to `Trainer.log`).
"""

from __future__ import annotations

import math
from collections import defaultdict


def _rule(name: str) -> str:
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
            else:
                out[name] = sum(values) / len(values)
        self._values.clear()
        return out

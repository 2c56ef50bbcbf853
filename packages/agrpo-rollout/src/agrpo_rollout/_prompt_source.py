"""`PromptSource`: the stream of dataset rows, epoch after epoch, with a resume position.

Owns iteration order (row order, no shuffling: shuffle the dataset beforehand), epoch counting,
the resume start index, and the rule that an epoch whose every row is rejected raises. Does not
know what a row means: the loop reads `prompt` and passes the other columns to reward functions.
A resumed trainer also passes `skip`: (epoch, row_index) pairs, epochs counted from this source's start,
that were already trained before the resume; they are not drawn and count as neither seen nor rejected.

Accepts a `datasets.Dataset` (or any sized, indexable sequence of dicts), a `datasets.IterableDataset`
(or any re-iterable; restarts at row 0 on resume, since it cannot seek), or None: an endless stream
of empty rows for environments whose `reset()` writes the prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ._exceptions import PromptsExhaustedError

logger = logging.getLogger("agrpo_rollout")


@dataclass(frozen=True, slots=True)
class PromptDraw:
    """One row drawn from the dataset, accepted or not."""

    row_index: int
    row: Mapping[str, Any]
    epoch: int
    """Passes over the dataset completed before this row was drawn."""
    accepted: bool


class PromptSource:
    """Rows of `dataset` from `start_index`, for `max_epochs` passes (None: forever)."""

    def __init__(
        self,
        dataset: Any,
        *,
        start_index: int = 0,
        max_epochs: int | None = None,
        skip: frozenset[tuple[int, int]] = frozenset(),
    ) -> None:
        self.dataset = dataset
        self.start_index = start_index
        self.max_epochs = max_epochs
        self.skip = frozenset(skip)

    def _rows(self, epoch: int) -> Iterator[tuple[int, Mapping[str, Any]]]:
        if self.dataset is None:
            index = 0
            while True:
                yield index, {}
                index += 1
        if hasattr(self.dataset, "__len__") and hasattr(self.dataset, "__getitem__"):
            size = len(self.dataset)
            first = self.start_index % size if epoch == 0 and size else 0
            for index in range(first, size):
                yield index, self.dataset[index]
            return
        if epoch == 0 and self.start_index:
            logger.warning(
                "an iterable dataset cannot seek; resuming at row 0 instead of %d", self.start_index
            )
        yield from enumerate(self.dataset)

    def draws(self, accept: Callable[[int, Mapping[str, Any], int], bool]) -> Iterator[PromptDraw]:
        """Every row in order with `accept(row_index, row, epoch)`'s verdict; raises when an epoch is empty."""
        epoch = 0
        while self.max_epochs is None or epoch < self.max_epochs:
            seen = accepted = skipped = 0
            for index, row in self._rows(epoch):
                if (epoch, index) in self.skip:
                    skipped += 1
                    continue
                verdict = bool(accept(index, row, epoch))
                seen += 1
                accepted += verdict
                yield PromptDraw(index, row, epoch, verdict)
            if seen and not accepted:
                raise PromptsExhaustedError(
                    f"filter_prompt rejected all {seen} prompts of epoch {epoch}; no group can reach the trainer. "
                    "Loosen filter_prompt or stop training"
                )
            if not seen and not skipped:
                raise PromptsExhaustedError(
                    "the prompt dataset is empty; pass a dataset with at least one row"
                )
            epoch += 1

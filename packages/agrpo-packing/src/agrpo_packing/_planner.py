"""`Planner`: turns a stream of samples into micro-batches of one `TreeRow` per DP rank (SPEC F-PACK).

Owns routing, spilling, closing micro-batches, attention-cost balance, fixed-count mode and oversize
drops. Does not know ranks or devices (a micro-batch is a list of rows; the trainer scatters them) nor
the tensor layout (`TreeRow.pack`).

Token-budget mode (budget > 0), per sample:
1. A sample whose forwarded tokens alone exceed the budget can never fit: dropped, counted
   (`dropped_oversize_total`, `batch/dropped_oversize_total` of the next micro-batch) and warned
   about. `flush` emits a micro-batch of empty rows when only drops are pending, so none goes unreported.
2. Group routing: it goes to the row that already holds its `group_id` if it fits there, so the
   group's prompt is forwarded once.
3. Otherwise a new group goes to the fitting row with the lowest attention cost after adding it
   (empty rows first; a row already holding a common prefix pays less). A spilling sample (its
   group's row is full) goes only to a row that is empty (an idle rank) or whose cost after adding
   stays within the busiest row's (the micro-batch's step time does not grow).
4. Otherwise the micro-batch closes and the sample opens the next one.
Fixed-count mode (budget <= 0): every `per_device_train_batch_size * num_ranks` samples form a
micro-batch; whole groups are placed costliest first on the cheapest row (LPT).
Both modes: while a row is empty and another holds several samples, the costliest such row is split
in two (in key order, so shared prefixes stay together): an idle rank costs as much as a busy one.
Cost is causal attention score pairs (sum over unique tokens of depth + 1); see `TreeRow`.
"""

from __future__ import annotations

import warnings
from bisect import bisect_left
from collections.abc import Iterable
from itertools import accumulate

from ._micro_batch import MicroBatch
from ._packing_config import PackingConfig
from ._sample import PackSample
from ._tree_row import RowProbe, TreeRow
from ._trie_entry import TrieEntry, score_pairs


class Planner:
    """Feed samples with `add` (it returns the micro-batches it closed); `flush` emits the open one."""

    def __init__(self, config: PackingConfig) -> None:
        self.config = config
        self.token_budget = config.resolved_budget
        self.dropped_oversize_total = 0
        """Samples dropped as longer than the budget, since the planner was made."""
        self._dropped_pending = 0
        self._rows = self._new_rows()
        self._holder: dict[int, int] = {}
        self._buffer: list[TrieEntry] = []

    def add(self, sample: PackSample) -> list[MicroBatch]:
        entry = TrieEntry.of(sample)
        if self.config.fixed_count:
            return self._add_counted(entry)
        if entry.num_nodes > self.token_budget:
            self._drop(entry)
            return []
        closed = []
        target = self._route(entry)
        if target is None:
            closed.append(self._close())
            target = (0, self._rows[0]._probe(entry))
        index, probe = target
        self._rows[index]._insert(entry, probe)
        self._holder[sample.group_id] = index
        return closed

    def flush(self) -> MicroBatch | None:
        """The open micro-batch (rows may be empty if there were fewer samples than ranks), or None when
        there is nothing to report. Samples dropped as oversize since the last micro-batch are reported
        even when nothing else is open: the tail then has only empty rows (`num_samples == 0`; log its
        metrics, train nothing), so a step whose samples were all oversize still shows its drops."""
        if self.config.fixed_count:
            batch = self._counted(self._buffer) if self._buffer else None
            self._buffer = []
            return batch
        if all(row.is_empty for row in self._rows) and not self._dropped_pending:
            return None
        return self._close()

    def plan(self, samples: Iterable[PackSample]) -> list[MicroBatch]:
        """Every micro-batch of `samples`, the last one flushed."""
        batches = [batch for sample in samples for batch in self.add(sample)]
        tail = self.flush()
        return batches + ([tail] if tail is not None else [])

    def _new_rows(self) -> list[TreeRow]:
        share = self.config.share_prefixes
        return [TreeRow(self.token_budget, share_prefixes=share) for _ in range(self.config.num_ranks)]

    def _drop(self, entry: TrieEntry) -> None:
        self.dropped_oversize_total += 1
        self._dropped_pending += 1
        warnings.warn(
            f"dropping a sample of group {entry.sample.group_id}: it forwards {entry.num_nodes} tokens, over "
            f"token_budget={self.token_budget} (dropped so far: {self.dropped_oversize_total}); raise "
            "token_budget (or the server's max_model_len) or lower max_completion_length",
            RuntimeWarning,
            stacklevel=3,
        )

    def _route(self, entry: TrieEntry) -> tuple[int, RowProbe] | None:
        """(row, probe) for `entry` under the routing and spill rules, or None to close the micro-batch."""
        rows, holder = self._rows, self._holder.get(entry.sample.group_id)
        if holder is not None:
            probe = rows[holder]._probe(entry)
            if rows[holder]._fits_probe(entry, probe):
                return holder, probe
        busiest = max(row.cost for row in rows)
        best: tuple[int, int, RowProbe] | None = None
        for index, row in enumerate(rows):
            if index == holder:
                continue
            probe = row._probe(entry)
            after = row.cost + probe.added_cost
            if not row._fits_probe(entry, probe) or (
                holder is not None and not row.is_empty and after > busiest
            ):
                continue
            if best is None or after < best[0]:
                best = (after, index, probe)
        return None if best is None else best[1:]

    def _close(self) -> MicroBatch:
        _spread_into_empty_rows(self._rows)
        batch = MicroBatch(self._rows, self.token_budget, self._dropped_pending)
        self._rows, self._holder, self._dropped_pending = self._new_rows(), {}, 0
        return batch

    def _add_counted(self, entry: TrieEntry) -> list[MicroBatch]:
        self._buffer.append(entry)
        if len(self._buffer) < self.config.samples_per_micro_batch:
            return []
        batch, self._buffer = self._counted(self._buffer), []
        return [batch]

    def _counted(self, entries: list[TrieEntry]) -> MicroBatch:
        """Fixed-count micro-batch: groups costliest first onto the cheapest row."""
        groups: dict[int, list[TrieEntry]] = {}
        for entry in entries:
            groups.setdefault(entry.sample.group_id, []).append(entry)
        rows = self._new_rows()
        for group in sorted(groups.values(), key=_group_cost, reverse=True):
            row = min(rows, key=lambda r: r.cost)
            for entry in group:
                row._insert(entry, row._probe(entry))
        _spread_into_empty_rows(rows)
        self._rows = rows
        return self._close()


def _group_cost(entries: list[TrieEntry]) -> int:
    row = TreeRow(0)
    for entry in entries:
        row._insert(entry, row._probe(entry))
    return row.cost


def _spread_into_empty_rows(rows: list[TreeRow]) -> None:
    """Split the costliest multi-sample row in two while some row is empty."""
    while any(row.is_empty for row in rows):
        donors = [i for i, row in enumerate(rows) if row.num_samples > 1]
        if not donors:
            return
        donor = max(donors, key=lambda i: rows[i].cost)
        entries = rows[donor]._entries_in_key_order()
        cumulative = list(accumulate(score_pairs(0, e.num_nodes) for e in entries))
        cut = min(max(bisect_left(cumulative, cumulative[-1] / 2) + 1, 1), len(entries) - 1)
        empty = next(i for i, row in enumerate(rows) if row.is_empty)
        for index, part in ((donor, entries[:cut]), (empty, entries[cut:])):
            rows[index] = TreeRow(rows[donor].token_budget, share_prefixes=rows[donor].share_prefixes)
            for entry in part:
                rows[index]._insert(entry, rows[index]._probe(entry))

"""`MicroBatch`: the rows of one micro-batch (one per DP rank) and its `batch/*` metrics.

Owns the packing part of SPEC F-MET `batch/`. Does not know how rows were filled (the planner) nor how
metrics are logged: `metrics()` returns plain floats that the trainer reduces (means, except
`batch/dropped_oversize_total`, a count since the previous micro-batch, which sums to a window total).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._packed_row import PackedRow
from ._tree_row import TreeRow


@dataclass(slots=True)
class MicroBatch:
    """`rows[r]` is rank r's forward. Rows can be empty only in a flushed tail: with fewer samples than
    ranks, or all of them when the tail only reports oversize drops (`num_samples == 0`, nothing to train)."""

    rows: list[TreeRow]
    token_budget: int
    """The budget rows were filled under; <= 0 in fixed-count mode."""
    dropped_oversize: int = 0
    """Samples dropped as oversize since the previous micro-batch."""

    def pack(self) -> list[PackedRow]:
        return [row.pack() for row in self.rows]

    @property
    def num_samples(self) -> int:
        return sum(row.num_samples for row in self.rows)

    @property
    def num_loss_terms(self) -> int:
        """Trained tokens of the micro-batch, all ranks: the loss normaliser sums this over a step."""
        return sum(row.num_loss_terms for row in self.rows)

    @property
    def group_ids(self) -> set[int]:
        return set().union(*(row.group_ids for row in self.rows))

    def metrics(self) -> dict[str, float]:
        """The `batch/*` metrics of SPEC F-MET that packing owns."""
        tokens = [row.num_tokens for row in self.rows]
        costs = [row.cost for row in self.rows]
        most, mean = max(tokens), sum(tokens) / len(tokens)
        raw = sum(row.num_raw_tokens for row in self.rows)
        mean_cost = sum(costs) / len(costs)
        capacity = self.token_budget if self.token_budget > 0 else most
        return {
            "batch/samples_per_row": self.num_samples / len(self.rows),
            "batch/row_tokens_mean": mean,
            "batch/row_tokens_max": float(most),
            "batch/row_tokens_min": float(min(tokens)),
            "batch/row_fill_frac": mean / capacity if capacity else 0.0,
            "batch/row_imbalance": max(costs) / mean_cost if mean_cost else 1.0,
            "batch/packing_ratio": raw / max(sum(tokens), 1),
            "batch/pad_frac": 1.0 - sum(tokens) / (most * len(tokens)) if most else 0.0,
            "batch/dropped_oversize_total": float(self.dropped_oversize),
        }

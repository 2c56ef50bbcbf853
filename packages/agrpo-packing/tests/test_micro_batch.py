"""`MicroBatch`: the packing `batch/*` metrics of SPEC F-MET, checked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from agrpo_packing import MicroBatch, PackSample, TreeRow


def _sample(ids) -> PackSample:
    mask = np.arange(len(ids)) >= 1
    n = int(mask.sum())
    return PackSample(
        input_ids=np.array(ids),
        trained_mask=mask,
        group_id=0,
        advantages=np.zeros(n),
        sampler_logprobs=np.zeros(n),
    )


def test_metrics_by_hand():
    a, b = TreeRow(10), TreeRow(10)
    a.extend([_sample([1, 2, 3, 4, 5]), _sample([1, 2, 3, 4, 6])])  # 4 + 1 unique tokens, 10 raw
    b.add(_sample([7, 8, 9]))  # 2 unique tokens, 3 raw
    batch = MicroBatch([a, b], token_budget=10, dropped_oversize=2)
    metrics = batch.metrics()
    assert metrics["batch/samples_per_row"] == 1.5
    assert (metrics["batch/row_tokens_mean"], metrics["batch/row_tokens_max"]) == (3.5, 5.0)
    assert metrics["batch/row_tokens_min"] == 2.0
    assert metrics["batch/row_fill_frac"] == pytest.approx(0.35)
    assert metrics["batch/row_imbalance"] == pytest.approx(14 / ((14 + 3) / 2))  # costs 1+2+3+4+4, 1+2
    assert metrics["batch/packing_ratio"] == pytest.approx(13 / 7)
    assert metrics["batch/pad_frac"] == pytest.approx(1 - 7 / 10)
    assert metrics["batch/dropped_oversize_total"] == 2.0
    assert batch.num_samples == 3 and batch.num_loss_terms == 10 and batch.group_ids == {0}
    assert [p.num_tokens for p in batch.pack()] == [5, 2]


def test_fixed_count_fill_is_relative_to_the_longest_row():
    a, b = TreeRow(0), TreeRow(0)
    a.add(_sample([1, 2, 3, 4, 5]))
    b.add(_sample([1, 2, 3]))
    assert MicroBatch([a, b], token_budget=0).metrics()["batch/row_fill_frac"] == pytest.approx(3 / 4)


def test_empty_rows_give_finite_metrics():
    metrics = MicroBatch([TreeRow(8), TreeRow(8)], token_budget=8).metrics()
    assert all(np.isfinite(v) for v in metrics.values())

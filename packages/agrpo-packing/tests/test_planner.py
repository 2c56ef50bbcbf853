"""`Planner`: budgets, group routing, spill rules, balance, fixed-count mode and oversize drops."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agrpo_packing import PackingConfig, PackSample, Planner
from agrpo_packing.testing import GroupShape, assert_row_layout, grpo_groups, random_grpo_groups

PROPERTY = settings(max_examples=100, deadline=None)


def _sample(length: int, group_id: int, token: int, prompt: int = 0) -> PackSample:
    """Tokens `token + 7 i`, except a prompt shared by the group; trained after the prompt."""
    ids = np.full(length, token, dtype=np.int64)
    ids[:prompt] = 1000 + group_id
    ids += np.arange(length) * 7
    mask = np.arange(length) >= max(prompt, 1)
    n = int(mask.sum())
    return PackSample(
        input_ids=ids,
        trained_mask=mask,
        group_id=group_id,
        advantages=np.zeros(n),
        sampler_logprobs=np.zeros(n),
    )


def _forwarded(sample: PackSample) -> int:
    trained = np.flatnonzero(sample.trained_mask)
    return int(trained[-1]) if trained.size else 0


def _check_plan(samples, batches, config):
    budget = config.resolved_budget
    placed = [id(s) for batch in batches for row in batch.rows for s in row.samples]
    kept = [id(s) for s in samples if budget <= 0 or _forwarded(s) <= budget]
    assert sorted(placed) == sorted(kept), "every kept sample is placed exactly once"
    for batch in batches:
        assert len(batch.rows) == config.num_ranks
        for row in batch.rows:
            if budget > 0:
                assert row.num_tokens <= budget and row.num_loss_terms <= budget
            packed = row.pack()
            assert packed.num_tokens == row.num_tokens
            assert_row_layout(packed, row.samples, shared=config.share_prefixes)


@PROPERTY
@given(grpo_groups(max_groups=4), st.integers(1, 30), st.integers(1, 4), st.booleans())
def test_token_budget_plans_place_every_kept_sample_once_within_budget(samples, budget, ranks, share):
    config = PackingConfig(token_budget=budget, num_ranks=ranks, share_prefixes=share)
    planner = Planner(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = planner.plan(samples)
    _check_plan(samples, batches, config)
    dropped = sum(_forwarded(s) > budget for s in samples)
    assert planner.dropped_oversize_total == dropped == len(caught)
    assert sum(b.metrics()["batch/dropped_oversize_total"] for b in batches) == dropped


@PROPERTY
@given(grpo_groups(max_groups=4), st.integers(1, 3), st.integers(1, 3))
def test_fixed_count_mode_forms_micro_batches_of_a_fixed_number_of_samples(samples, per_rank, ranks):
    config = PackingConfig(token_budget=0, num_ranks=ranks, per_device_train_batch_size=per_rank)
    batches = Planner(config).plan(samples)
    _check_plan(samples, batches, config)
    sizes = [b.num_samples for b in batches]
    assert all(size == per_rank * ranks for size in sizes[:-1]) and 0 < sizes[-1] <= per_rank * ranks
    for batch in batches:
        assert sum(row.is_empty for row in batch.rows) == max(ranks - batch.num_samples, 0)


def test_a_group_that_fits_stays_in_one_row_and_shares_its_prompt():
    samples = random_grpo_groups(
        GroupShape(num_prompts=6, completion_tokens=(64, 256), prompt_tokens=(300, 400))
    )
    batches = Planner(PackingConfig(token_budget=100_000, num_ranks=3)).plan(samples)
    assert len(batches) == 1
    for group in {s.group_id for s in samples}:
        assert sum(group in row.group_ids for row in batches[0].rows) == 1
    assert batches[0].metrics()["batch/packing_ratio"] > 1.5


def test_a_spilling_sample_goes_to_an_idle_rank():
    planner = Planner(PackingConfig(token_budget=20, num_ranks=2))
    for token in (1, 2, 3):  # 11 nodes, then 4 novel each (7 prompt nodes shared): 11, 15, 19 tokens
        assert planner.add(_sample(12, group_id=0, token=token, prompt=8)) == []
    assert planner.add(_sample(12, group_id=0, token=4, prompt=8)) == []  # 23 > 20: spills to row 1
    assert [row.num_samples for row in planner.flush().rows] == [3, 1]


def test_a_micro_batch_closes_when_no_row_fits():
    planner = Planner(PackingConfig(token_budget=20, num_ranks=2))
    planner.add(_sample(19, group_id=0, token=1))  # row 0: 18 tokens
    planner.add(_sample(6, group_id=1, token=2))  # new group, row 0 too full: row 1, 5 tokens
    planner.add(_sample(11, group_id=1, token=3))  # its group's row: 15 tokens
    closed = planner.add(_sample(10, group_id=1, token=4))  # 9 more fit neither row
    assert len(closed) == 1 and [r.num_samples for r in closed[0].rows] == [1, 2]
    assert [r.num_samples for r in planner.flush().rows] == [1, 0]


def test_a_spill_goes_to_a_busy_row_only_if_the_busiest_cost_does_not_grow():
    planner = Planner(PackingConfig(token_budget=30, num_ranks=2))
    planner.add(_sample(25, group_id=0, token=1))  # row 0: 24 tokens, cost 300
    planner.add(_sample(12, group_id=1, token=2))  # row 1: 11 tokens, cost 66
    planner.add(_sample(8, group_id=0, token=3))  # row 0 full for it; row 1: 66 + 28 <= 300
    assert planner.add(_sample(8, group_id=0, token=4)) == []  # follows its group to row 1
    assert [r.num_samples for r in planner.flush().rows] == [1, 3]


def test_a_spill_that_would_make_the_busiest_row_busier_closes_the_micro_batch():
    planner = Planner(PackingConfig(token_budget=30, num_ranks=2))
    planner.add(_sample(20, group_id=0, token=1))  # row 0: 19 tokens, cost 190
    planner.add(_sample(16, group_id=1, token=2))  # row 1: 15 tokens, cost 120
    closed = planner.add(_sample(14, group_id=0, token=3))  # fits row 1 only, but 120 + 91 > 190
    assert len(closed) == 1 and [r.num_samples for r in closed[0].rows] == [1, 1]


def test_new_groups_balance_attention_cost_across_ranks():
    samples = random_grpo_groups(GroupShape(num_prompts=64), seed=5)
    batches = Planner(PackingConfig(token_budget=32768, num_ranks=8)).plan(samples)
    imbalance = [b.metrics()["batch/row_imbalance"] for b in batches[:-1]]
    assert np.mean(imbalance) < 1.3, imbalance


def test_oversize_samples_are_dropped_counted_and_warned_about():
    planner = Planner(PackingConfig(token_budget=10, num_ranks=1))
    with pytest.warns(RuntimeWarning, match="raise token_budget"):
        assert planner.add(_sample(12, group_id=0, token=1)) == []  # forwards 11 tokens
    planner.add(_sample(11, group_id=1, token=2))  # forwards 10: fits exactly
    batch = planner.flush()
    assert planner.dropped_oversize_total == 1 and batch.metrics()["batch/dropped_oversize_total"] == 1
    assert batch.rows[0].num_tokens == 10


def test_a_step_of_only_oversize_samples_still_reports_its_drops():
    planner = Planner(PackingConfig(token_budget=10, num_ranks=2))
    with pytest.warns(RuntimeWarning, match="raise token_budget"):
        batches = planner.plan([_sample(12, group_id=0, token=1), _sample(20, group_id=1, token=2)])
    assert len(batches) == 1, "a micro-batch with no rows' worth of samples carries the drop count"
    (batch,) = batches
    assert batch.metrics()["batch/dropped_oversize_total"] == 2
    assert batch.num_samples == batch.num_loss_terms == 0 and all(row.is_empty for row in batch.rows)
    assert [p.num_tokens for p in batch.pack()] == [0, 0]
    assert planner.flush() is None, "the drops are reported once"


def test_flush_splits_a_lone_group_across_idle_ranks():
    samples = random_grpo_groups(GroupShape(num_prompts=1, multi_turn_frac=0.0), seed=2)
    batch = Planner(PackingConfig(token_budget=100_000, num_ranks=4)).plan(samples)[0]
    assert all(row.num_samples >= 1 for row in batch.rows)  # split by cost, not by count
    assert batch.metrics()["batch/row_imbalance"] < 2.0
    assert sorted(id(s) for row in batch.rows for s in row.samples) == sorted(map(id, samples))


def test_plain_rows_are_plain_varlen():
    samples = random_grpo_groups(GroupShape(num_prompts=2, completion_tokens=(8, 16), prompt_tokens=(8, 16)))
    batch = Planner(PackingConfig(token_budget=4096, num_ranks=2, share_prefixes=False)).plan(samples)[0]
    assert all(row.is_plain for row in batch.pack())
    assert batch.metrics()["batch/packing_ratio"] == pytest.approx(
        sum(s.num_tokens for s in samples) / sum(_forwarded(s) for s in samples)
    )

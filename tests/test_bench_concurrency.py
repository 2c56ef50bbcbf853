"""The concurrency benchmark's bound: the best time-mix of fixed caps within a preemption budget."""

from __future__ import annotations

import pytest

from tools.bench.concurrency.__main__ import mix_bound


def test_a_point_within_the_budget_is_reached_and_a_mix_interpolates_between_neighbours():
    points = [(0.0, 500.0), (100.0, 800.0), (400.0, 1400.0)]
    assert mix_bound(points, 100.0) == pytest.approx(800.0)
    assert mix_bound(points, 250.0) == pytest.approx(1100.0)  # half way from (100, 800) to (400, 1400)
    assert mix_bound(points, 1000.0) == pytest.approx(1400.0)


def test_the_bound_takes_the_upper_hull_not_the_nearest_points():
    # (50, 300) lies below the chord from (0, 500) to (100, 800): mixing those two does better
    points = [(0.0, 500.0), (50.0, 300.0), (100.0, 800.0)]
    assert mix_bound(points, 50.0) == pytest.approx(650.0)
    assert mix_bound([(10.0, 100.0)], 5.0) == 0.0

"""`MetricWindow`'s reduction rules, and the rollout process's running totals turned into window counts."""

from __future__ import annotations

from agrpo_trainer._metrics import CounterDeltas, MetricWindow


def test_each_name_reduces_by_what_it_says():
    window = MetricWindow()
    window.add({"a/x_total": 2, "a/x_max": 1, "a/x_min": 5, "a/y": 1, "num_tokens": 100, "a/z": float("nan")})
    window.add({"a/x_total": 3, "a/x_max": 4, "a/x_min": 2, "a/y": 3, "num_tokens": 250})
    assert window.reduce() == {"a/x_total": 5, "a/x_max": 4, "a/x_min": 2, "a/y": 2, "num_tokens": 250}
    assert window.reduce() == {}


def test_running_totals_become_counts_since_the_previous_push_and_a_restart_starts_over():
    deltas = CounterDeltas()
    pushes = [{"tools/f/call_total": 2, "rollout/concurrency": 8}, {"tools/f/call_total": 5},
              {"tools/f/call_total": 5}, {"tools/f/call_total": 1}]  # fmt: skip
    out = [deltas(p) for p in pushes]
    assert [o["tools/f/call_total"] for o in out] == [2, 3, 0, 1]
    assert out[0]["rollout/concurrency"] == 8
    window = MetricWindow()
    for counts in out[:3]:
        window.add(counts)
    assert window.reduce()["tools/f/call_total"] == 5, "a window's count is the total's growth within it"

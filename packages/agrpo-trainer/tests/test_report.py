"""The run report (`_report`): one self-contained page whose figure holds exactly the logged curves."""

from __future__ import annotations

import re

from report_reader import read_curves

from agrpo_trainer._report import PANELS, write_report

HISTORY = [
    {"step": s, "reward": 0.1 * s, "kl": 0.01 / s, "rollout/concurrency_cap": 8.0 + s, "rollout/kv_cache_usage": 0.05 * s,
     "perf/weight_sync_s": 0.3 + 0.01 * s, "perf/forwarded_tok_s_wall_clock": 100.0 * s, "loss": 1.0}
    for s in range(1, 6)
] + [{"step": 5, "train_runtime": 12.5, "train_loss": 0.5}]  # fmt: skip


def test_the_page_plots_each_logged_panel_metric_over_optimizer_steps(tmp_path):
    history = [dict(h) for h in HISTORY]
    history[2]["kl"] = float("nan")  # a window without a value: left out, not drawn as 0
    path = write_report(history, tmp_path / "report.html", title="unit run")
    curves = read_curves(path)
    plotted = {n for p in PANELS for n in p.metrics}
    assert set(curves) == {k for h in HISTORY for k in h if k in plotted}
    assert curves["reward"] == ([1, 2, 3, 4, 5], [0.1 * s for s in range(1, 6)])
    assert curves["kl"] == ([1, 2, 4, 5], [0.01 / s for s in (1, 2, 4, 5)])
    assert curves["rollout/kv_cache_usage"][1] == [0.05 * s for s in range(1, 6)]


def test_the_page_is_self_contained_and_says_what_run_it_is(tmp_path):
    page = write_report(HISTORY, tmp_path / "report.html", title="unit run").read_text()
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=", page), (
        "plotly.js is embedded, nothing is fetched"
    )
    assert "Plotly.newPlot" in page and len(page) > 1_000_000, "plotly.js itself (several MB) is in the page"
    assert "unit run" in page and "12.5 s" in page and "optimizer steps" in page


def test_nothing_logged_with_a_step_writes_no_page(tmp_path):
    assert write_report([{"train_runtime": 1.0}], tmp_path / "report.html") is None
    assert not (tmp_path / "report.html").exists()

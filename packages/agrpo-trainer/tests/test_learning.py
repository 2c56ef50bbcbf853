"""It learns, for real, on this CPU machine: the main job's setup (`agrpo-trainer demo`) against the real CPU vLLM
server with disk weight sync. A tiny random model learns to write digits; after every sync the server scores
the parity probe exactly as the trainer does; `reward` is logged on every optimizer step; a healthy server
needs no retried request; the main job's own settings raise no warning; train() leaves no process behind
and writes its report."""

from __future__ import annotations

import statistics
import warnings

import psutil
import pytest
import torch
from report_reader import read_curves

from agrpo_trainer._demo import run_demo

STEPS = 40


@pytest.mark.server
def test_a_tiny_model_learns_against_the_real_server_and_every_sync_lands(
    training_server, untied_qwen3_dir, tmp_path
):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the demo does: the CPU server's worker holds one of the two cores
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = run_demo(training_server, untied_qwen3_dir, str(tmp_path / "run"), STEPS)
    finally:
        torch.set_num_threads(threads)
    ours = [w for w in caught if issubclass(w.category, FutureWarning | DeprecationWarning | RuntimeWarning)]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    history = trainer.state.log_history
    rewards = [h["reward"] for h in history if "reward" in h]
    assert len(rewards) == STEPS, "the trained reward on every optimizer step"
    assert sum(h.get("rollout/vllm_retry_total", 0) for h in history) == 0, "a healthy server: no retry"
    assert sum(h.get("perf/weight_sync_retries", 0) for h in history) == 0
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert last > 2 * first and last > first + 0.05, (
        f"mean reward of the first 10 steps {first:.3f}, last 10 {last:.3f}"
    )

    gaps = [h["sync/logprob_max_abs_diff"] for h in history if "sync/logprob_max_abs_diff" in h]
    assert (
        len(gaps) == STEPS
    )  # one push per optimizer step (the first push, at train begin, logs with step 1)
    assert max(gaps) < 1e-4, f"the server's log-probs left the trainer's after a sync: {max(gaps):.2e}"
    assert all(h.get("sample/staleness_max", 0) <= 2 for h in history)
    assert read_curves(tmp_path / "run" / "report.html")["reward"][1] == rewards
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before

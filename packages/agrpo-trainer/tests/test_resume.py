"""Checkpoint and resume against the real server (SPEC F-CKPT), the hard way: one run is SIGKILLed three
times at different points (right after a checkpoint at which a group is partly trained, in the middle of a
step, while the packer holds half of a group), resumed from its last checkpoint each time, and finishes its
epoch. What was trained is read back from the packed rows each step fed the model (`resume_run.py`), and
only the steps that survive into the final weights count (a run's steps after the checkpoint the next run
resumed from were lost with it). Every prompt must be trained in exactly one run, or never when its group
is dropped; and each killed trainer's rollout process must exit by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest
from resume_run import NUM_GENERATIONS, NUM_PROMPTS, dropped
from transformers.trainer_utils import get_last_checkpoint

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
KILLS = ["split-checkpoint", "mid-step", "half-group", "none"]


def _run(server, model_dir, out: Path, record: Path, kill: str, *resume: str) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(HERE / "resume_run.py"), server.url, str(model_dir), str(out), str(record),
               kill, *resume]  # fmt: skip
    log = out.parent / f"{record.stem}.log"
    with open(log, "w") as f:
        code = subprocess.run(command, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=500).returncode
    return code, log.read_text()[-3000:]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _assert_worker_exits(steps: list[dict], log: Path) -> None:
    """The killed trainer's rollout process notices its parent is gone and exits by itself (else its threads'
    stacks, dumped by `resume_run`'s SIGUSR1 handler, are the failure message)."""
    if not steps or not psutil.pid_exists(steps[-1]["worker_pid"]):
        return
    worker = psutil.Process(steps[-1]["worker_pid"])
    try:
        worker.wait(timeout=30)
    except psutil.TimeoutExpired:
        worker.send_signal(signal.SIGUSR1)
        time.sleep(3)
        worker.kill()
        pytest.fail(f"the rollout process outlived its killed trainer by 30 s:\n{log.read_text()[-8000:]}")


@pytest.mark.server
def test_a_run_killed_at_three_points_trains_every_prompt_exactly_once(
    training_server, untied_qwen3_dir, tmp_path
):
    out = tmp_path / "run"
    resumed_from, survived = 0, []  # survived: (run, step, {item: samples}) of the steps in the final weights
    splits: dict[int, list] = {}
    for run, kill in enumerate(KILLS):
        record = tmp_path / f"run{run}.jsonl"
        code, log = _run(training_server, untied_qwen3_dir, out, record, kill, *(["--resume"] if run else []))
        lines = _records(record)
        steps = [line for line in lines if "step" in line]
        splits.update({line["checkpoint"]: line["split"] for line in lines if "checkpoint" in line})
        if kill == "none":
            assert code == 0, log
            until = float("inf")
        else:
            assert code == -signal.SIGKILL and lines[-1].get("killed") == kill, (
                f"{kill} never reached:\n{log}"
            )
            _assert_worker_exits(steps, out.parent / f"{record.stem}.log")
            until = int(get_last_checkpoint(str(out)).rsplit("-", 1)[1])
        assert [s["step"] for s in steps] == list(range(resumed_from + 1, resumed_from + 1 + len(steps))), log
        survived += [(run, s["step"], s["items"]) for s in steps if s["step"] <= until]
        resumed_from = until
    assert any(splits[step] for step in splits), (
        "no checkpoint fell inside a group: the split case went untested"
    )

    trained = defaultdict(lambda: defaultdict(int))  # item -> run -> samples trained
    for run, _, items in survived:
        for item, samples in items.items():
            trained[int(item)][run] += samples
    kept = {i for i in range(NUM_PROMPTS) if not dropped(i)}
    assert set(trained) == kept, f"skipped: {kept - set(trained)}, dropped but trained: {set(trained) - kept}"
    twice = {item: dict(runs) for item, runs in trained.items() if len(runs) > 1}
    assert not twice, f"prompts trained in two runs: {twice}"
    for item, runs in trained.items():
        (samples,) = runs.values()
        assert 1 <= samples <= NUM_GENERATIONS, f"item {item}: {samples} samples trained"
        if (
            samples < NUM_GENERATIONS
        ):  # only a group split by the checkpoint a resume started from loses samples
            assert any([0, item] in split for split in splits.values()), f"item {item} lost samples unsplit"

"""Checkpoint and resume against the real server (SPEC F-CKPT): the trainer process is killed with SIGKILL
after a checkpoint, its rollout process notices and exits by itself, and a resumed run trains exactly the
prompts the checkpoint had not trained: none twice, none skipped (from the recorded prompt keys)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from transformers.trainer_utils import get_last_checkpoint

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
NUM_PROMPTS = 12


def _start(server, model_dir, out: Path, record: Path, max_steps: int, *resume: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(HERE / "resume_run.py"), server.url, str(model_dir), str(out), str(record),
               str(max_steps), *resume]  # fmt: skip
    log = open(out.parent / f"{record.stem}.log", "w")  # noqa: SIM115 - the child writes it until it exits
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _lin(key) -> int:
    return key[0] * NUM_PROMPTS + key[1]


@pytest.mark.server
def test_a_killed_trainer_resumes_without_training_a_prompt_twice_or_skipping_one(
    training_server, untied_qwen3_dir, tmp_path
):
    out, first, second = tmp_path / "run", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    run = _start(training_server, untied_qwen3_dir, out, first, 1000)
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and not (len(_records(first)) >= 8 and get_last_checkpoint(str(out))):
        assert run.poll() is None, (out.parent / "first.log").read_text()[-3000:]
        time.sleep(0.5)
    os.kill(run.pid, signal.SIGKILL)  # the trainer only: its rollout process must notice and exit
    run.wait()
    worker = (
        psutil.Process(_records(first)[-1]["worker_pid"])
        if psutil.pid_exists(_records(first)[-1]["worker_pid"])
        else None
    )
    if worker is not None:
        worker.wait(timeout=30)  # raises if the orphaned rollout process keeps running

    checkpoint = get_last_checkpoint(str(out))
    saved_step = int(checkpoint.rsplit("-", 1)[1])
    state = json.loads((Path(checkpoint) / "rollout_state.json").read_text())
    before = [tuple(k) for r in _records(first) if r["step"] <= saved_step for k in r["prompts"]]
    resume_from, done = _lin(state["resume_from"]), {_lin(k) for k in state["done"]}

    resumed = _start(training_server, untied_qwen3_dir, out, second, saved_step + 6, "--resume")
    assert resumed.wait(timeout=400) == 0, (out.parent / "second.log").read_text()[-3000:]
    records = _records(second)
    assert [r["step"] for r in records] == list(range(saved_step + 1, saved_step + 7))
    after = [tuple(k) for r in records for k in r["prompts"]]

    trained_before, trained_after = {_lin(k) for k in before}, {_lin(k) for k in after}
    assert len(trained_before) == len(before) and len(trained_after) == len(after), "a prompt trained twice"
    assert not trained_before & trained_after, (
        f"trained before the checkpoint and again: {trained_before & trained_after}"
    )
    # Nothing skipped: every prompt before the saved position was trained before it (no group is ever
    # dropped with rank_reward), the position's own prompt is trained after the resume, and the prompts
    # the state marks done after the position are exactly the ones trained before the checkpoint.
    assert set(range(resume_from)) <= trained_before
    assert resume_from in trained_after
    assert done == {k for k in trained_before if k >= resume_from}
    assert all(k >= resume_from and k not in done for k in trained_after)

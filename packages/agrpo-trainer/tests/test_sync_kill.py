"""A trainer SIGKILLed during a weight sync never leaves the real server paused without a word: at each phase
of a disk sync (right after `/pause`, with the reload in flight, reloaded but not resumed) its rollout process,
which outlives it, settles the sync journal: the server answers again within seconds, serving one whole
version (the one before the sync when nothing was sent, else the synced one, reloaded again). When the rollout
process dies too, the next start-up in that output directory settles it; a sync whose weights may mix two
versions (NCCL cut short) stays paused and says so with the ways out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agrpo_sync import JOURNAL_NAME, ServerControl, settle_interrupted_sync

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def _completes(url: str, model: str) -> bool:
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=20).status_code == 200


def _wait_unpaused(control: ServerControl, timeout_s: float) -> float:
    start = time.monotonic()
    while control.is_paused():
        assert time.monotonic() - start < timeout_s, f"still paused {timeout_s:.0f} s after the kill"
        time.sleep(0.5)
    return time.monotonic() - start


@pytest.mark.server
@pytest.mark.parametrize(
    ("phase", "serves"), [("after-pause", "1"), ("during-reload", "2"), ("before-resume", "2")]
)
def test_a_trainer_killed_mid_sync_leaves_the_server_answering_on_one_version(
    phase, serves, training_server, untied_qwen3_dir, tmp_path
):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        str(HERE / "sync_kill_run.py"),
        training_server.url,
        str(untied_qwen3_dir),
        str(out),
        phase,
    ]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    log = run.stdout + run.stderr
    assert run.returncode == -9 and "SIGKILL at version 2" in log, log[-3000:]
    # the run's pipes close when its rollout process exits too: by then it has settled the sync, and said so
    assert f"agrpo-sync: {training_server.url}: " in log and ("resumed" in log.split("agrpo-sync: ")[-1]), (
        log[-3000:]
    )

    control = ServerControl(training_server.url)
    waited = _wait_unpaused(control, 30)
    assert control.weight_version() == serves, f"label {control.weight_version()!r} after a kill {phase}"
    assert _completes(training_server.url, training_server.served_name)
    assert not (out / JOURNAL_NAME).exists(), "a settled sync leaves no journal"
    print(f"{phase}: answering {waited:.1f} s after the kill, serving version {serves}")


@pytest.mark.server
def test_without_a_rollout_process_the_next_start_up_settles_it_and_a_mixed_sync_stays_paused(
    training_server, tmp_path
):
    control = ServerControl(training_server.url)
    journal = tmp_path / JOURNAL_NAME
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    entry = {"phase": "pausing", "version": 7, "backend": "disk", "servers": [training_server.url],
             "pid": int(dead.stdout)}  # fmt: skip
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        control.pause("keep", False)
        journal.write_text(json.dumps({**entry, "pid": sleeper.pid}))
        assert settle_interrupted_sync(journal) == [] and control.is_paused(), "a live trainer is left alone"
        # its rollout process saw it die: the sentinel closes before /proc shows a zombie, so it says so
        (line,) = settle_interrupted_sync(journal, dead_pid=sleeper.pid)
        assert "resumed" in line and not control.is_paused() and not journal.exists()

        control.pause("keep", False)
        journal.write_text(json.dumps(entry))
        assert control.is_paused()
        (line,) = settle_interrupted_sync(journal)  # what WeightSync.start runs first
        assert "resumed" in line and not control.is_paused() and not journal.exists()

        control.pause("keep", False)
        journal.write_text(json.dumps({**entry, "phase": "sending", "backend": "nccl"}))
        (line,) = settle_interrupted_sync(journal)
        assert (
            "left paused" in line
            and "resume_from_checkpoint=True" in line
            and f"{training_server.url}/resume" in line
        )
        assert control.is_paused() and journal.exists(), "weights that may mix two versions are not resumed"
    finally:
        sleeper.kill()
        control.resume()
    assert _completes(training_server.url, training_server.served_name)

"""`examples/train_async_grpo.py`, the reference's quick start: its `--cpu` variant trains a couple of steps
against the real CPU vLLM server (the session's, attached through `AGRPO_VLLM_URL`) and writes its report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from report_reader import read_curves

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "train_async_grpo.py"


def test_the_gpu_path_is_the_reference_quick_start_unchanged():
    source = EXAMPLE.read_text()
    for line in ('dataset = load_dataset("trl-lib/DeepMath-103K", split="train")',
                 'trainer = AsyncGRPOTrainer(model="Qwen/Qwen3-4B", reward_funcs=accuracy_reward, train_dataset=dataset)',
                 "trainer.train()"):  # fmt: skip
        assert line in source


@pytest.mark.server
def test_the_cpu_flag_trains_against_the_local_cpu_server(training_server, tmp_path):
    from agrpo_rollout.testing import ATTACH_URL_ENV

    env = {**os.environ, ATTACH_URL_ENV: training_server.url, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        str(EXAMPLE),
        "--cpu",
        "--max-steps",
        "2",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"trained 2 steps; report: {tmp_path / 'run' / 'report.html'}" in done.stdout
    curves = read_curves(tmp_path / "run" / "report.html")
    assert curves["reward"][0] == [1, 2], "the rewards of the samples each optimizer step trained"

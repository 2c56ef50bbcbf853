"""Distributed training on CPU with two gloo ranks (torchrun, DDP) against one rank on the same fixed samples:
the same parameters after three optimizer steps (SPEC F-LOSS normalisation, rank 0 owning the sample stream
and scattering rows). Tolerance: float32 weights; rows packed on one rank or split over two round
differently at ~1e-7 per step, while the steps move weights by ~1e-3.

FSDP2 runs the same script with `--fsdp` on GPUs (accelerate enables FSDP only for accelerator devices, not
for CPU ranks): measured on 2 x H200, see docs/benchmarks.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agrpo_rollout.testing import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SCRIPT = HERE / "distributed_replay.py"


def _run(out: Path, *, ranks: int, fsdp: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    flags = ["--fsdp"] if fsdp else []
    if ranks == 1:
        command = [sys.executable, str(SCRIPT), str(out), *flags]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                   "--master_port", str(free_port()), str(SCRIPT), str(out), *flags]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("one") / "weights.pt", ranks=1, fsdp=False)


def test_two_gloo_ranks_end_on_the_weights_of_one(one_rank, tmp_path):
    two = _run(tmp_path / "weights.pt", ranks=2, fsdp=False)
    assert two["world"] == 2
    from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer

    initial = build_model(TinyModelSpec(seed=7, tie_word_embeddings=False), build_tokenizer()).state_dict()
    moved = max((one_rank["weights"][k] - initial[k]).abs().max().item() for k in initial)
    gap = max((one_rank["weights"][k] - two["weights"][k]).abs().max().item() for k in initial)
    assert moved > 1e-3, "the steps must move the weights for the comparison to mean anything"
    assert gap < 1e-5, f"one rank vs two differ by {gap:.2e} (weights moved {moved:.2e})"

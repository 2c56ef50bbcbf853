"""`WeightSync`: backend choice, timings, and two FSDP2 ranks where only rank 0 talks to the server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from agrpo_sync import ServerInfo, SyncSetupError, WeightSyncConfig
from agrpo_sync._weight_sync import choose_backend

ROOT = Path(__file__).resolve().parents[3]
RANK_SCRIPT = Path(__file__).with_name("fsdp_sync_rank.py")


def _info(**overrides) -> ServerInfo:
    fields = dict(
        version="0.32.0", dtype="bfloat16", device="cuda", model_root="m", data_parallel_size=1, lora_enabled=True,
        max_lora_rank=16, max_loras=4, runtime_lora_updating=True, weight_transfer_backend="nccl",
    )  # fmt: skip
    return ServerInfo(**{**fields, **overrides})


def _config(**overrides) -> WeightSyncConfig:
    return WeightSyncConfig(
        base_url="http://server:8000", output_dir="/tmp/run", max_staleness=2, **overrides
    )


def test_backend_choice_for_plain_and_lora_models(tiny_model):
    plain = tiny_model()
    peft = get_peft_model(tiny_model(), LoraConfig(r=8, target_modules=["q_proj"]))
    assert choose_backend(_config(), plain, _info()) == "nccl"
    assert choose_backend(_config(backend="disk"), plain, _info()) == "disk"
    assert choose_backend(_config(), peft, _info()) == "lora"
    assert choose_backend(_config(lora_sync="merged"), peft, _info()) == "nccl"
    assert choose_backend(_config(), peft, _info(lora_enabled=False)) == "nccl"  # auto falls back to merged
    assert choose_backend(_config(), peft, _info(data_parallel_size=2)) == "nccl"
    with pytest.raises(SyncSetupError, match="--max-loras 4"):
        choose_backend(_config(lora_sync="adapter"), peft, _info(max_loras=3))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_ranks_gather_in_buckets_and_only_rank_0_talks(stub_worker, tmp_path, tiny_model):
    port, env = str(_free_port()), {**os.environ, "PYTHONPATH": str(ROOT)}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), str(r), port, stub_worker.url, str(tmp_path)],
            env=env,
            cwd=ROOT,
        )
        for r in (0, 1)
    ]
    assert [p.wait(timeout=300) for p in ranks] == [0, 0]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    expected = tiny_model()
    with torch.no_grad():
        for param in expected.parameters():
            param.mul_(1.5)
    assert stub_worker.state["version"] == "2"  # the second sync was re-sent once; the third failed twice
    for name, param in expected.named_parameters():
        torch.testing.assert_close(stub_worker.weights[name], param.detach(), rtol=0, atol=0)
    total = sum(p.nbytes for p in expected.parameters())
    assert [r["num_bytes"] for r in results] == [total, 0]
    assert [r["has_backend"] for r in results] == [True, False]
    largest = max(p.nbytes for p in expected.parameters())
    assert all(r["peak_gather_bytes"] <= max(40_000, largest) for r in results)
    assert all(r["peak_gather_bytes"] < total / 2 for r in results)  # never the whole model at once
    assert [r["second_retries"] for r in results] == [1, 1]  # both ranks gathered again for the re-send
    assert all("the retry failed too" in r["third"] for r in results)  # both ranks see the failure
    assert all("generation stays paused" in r["third"] for r in results)
    assert stub_worker.state["paused"] is True  # left paused: its layers mix versions 2 and 3

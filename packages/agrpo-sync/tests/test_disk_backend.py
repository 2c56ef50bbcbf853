"""The disk backend against the real CPU server: the server serves the new weights after a sync, and
a failed sync leaves it resumed and serving the last good version, or paused when that cannot be restored.

Tolerance: the server's prompt log-probs match the trainer model's within 1e-4 (both float32; measured
about 5e-7), and a sync changes them by more than 0.05. The tied embedding is left unperturbed: a CPU
server keeps a prepacked copy of the tied `lm_head` across reloads (see the package README).
"""

from __future__ import annotations

import pytest
import torch

from agrpo_sync import ServerControl, TransferFailedError, WeightSync, WeightSyncConfig

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("restore_server")]
TOLERANCE = 1e-4


def _config(url: str, tmp_path) -> WeightSyncConfig:
    return WeightSyncConfig(
        base_url=url, output_dir=str(tmp_path), backend="disk", gather_bucket_bytes=100_000
    )


def test_after_a_sync_the_server_serves_the_trainers_new_weights(
    vllm_server, tmp_path, tiny_model, perturb, logprobs
):
    model = tiny_model()
    before = logprobs.server(vllm_server.model_name)
    assert torch.allclose(before, logprobs.trainer(model), atol=TOLERANCE)
    perturb(model, 1)
    sync = WeightSync.start(_config(vllm_server.url, tmp_path), model)
    timings = sync.sync(model, 1)
    after = logprobs.server(vllm_server.model_name)
    assert torch.allclose(after, logprobs.trainer(model), atol=TOLERANCE)
    assert (after - before).abs().max() > 0.05
    control = ServerControl(vllm_server.url)
    assert control.weight_version() == "1" and control.is_paused() is False
    shards = sorted(p.name for p in (tmp_path / ".vllm_weights" / "v1").iterdir())
    assert "model.safetensors.index.json" in shards and len(shards) > 2  # sharded by gather bucket
    perturb(model, 2)
    sync.sync(model, 2)
    assert sorted(p.name for p in (tmp_path / ".vllm_weights").iterdir()) == ["v2"]  # only the newest kept
    assert timings.pause_s > 0 and timings.transfer_s > 0


def test_a_failed_reload_is_undone_and_generation_resumed(
    vllm_server, fault_proxy, tmp_path, tiny_model, perturb, logprobs
):
    model = tiny_model()
    perturb(model, 1)
    sync = WeightSync.start(_config(fault_proxy.url, tmp_path), model)
    sync.sync(model, 1)
    good = logprobs.server(vllm_server.model_name)
    perturb(model, 2)
    fault_proxy.arm("/collective_rpc", "after", contains="/v2")  # the server loads v2, then the call "fails"
    with pytest.raises(TransferFailedError, match="collective_rpc: HTTP 500") as failure:
        sync.sync(model, 2)
    assert "reloaded from" in failure.value.server_state and "/v1" in failure.value.server_state
    control = ServerControl(vllm_server.url)
    assert control.is_paused() is False and control.weight_version() == "1"
    assert torch.allclose(logprobs.server(vllm_server.model_name), good, atol=TOLERANCE)
    assert not (tmp_path / ".vllm_weights" / "v2").exists()


def test_a_failed_pause_sends_nothing(vllm_server, fault_proxy, tmp_path, tiny_model, perturb, logprobs):
    model = tiny_model()
    before = logprobs.server(vllm_server.model_name)
    sync = WeightSync.start(_config(fault_proxy.url, tmp_path), model)
    perturb(model, 3)
    fault_proxy.arm("/pause", "before")
    with pytest.raises(TransferFailedError, match="pause failed") as failure:
        sync.sync(model, 1)
    assert "nothing was sent" in failure.value.server_state
    assert torch.allclose(logprobs.server(vllm_server.model_name), before, atol=TOLERANCE)


def test_a_reload_that_cannot_be_undone_keeps_generation_paused_until_a_complete_sync(
    vllm_server, fault_proxy, tmp_path, tiny_model, perturb, logprobs
):
    model = tiny_model()
    sync = WeightSync.start(_config(fault_proxy.url, tmp_path), model)
    perturb(model, 4)
    fault_proxy.arm("/collective_rpc", "before")  # the reload fails, and so does reloading the last good dir
    with pytest.raises(TransferFailedError, match="collective_rpc: HTTP 500") as failure:
        sync.sync(model, 1)
    assert failure.value.left_paused is True
    assert "restoring the last good version failed too" in failure.value.server_state
    assert "generation stays paused" in failure.value.server_state and "call sync() again" in str(
        failure.value
    )
    control = ServerControl(vllm_server.url)
    assert control.is_paused() is True
    fault_proxy.faults.clear()
    sync.sync(model, 1)  # what the error says to do: a complete sync resumes generation
    assert control.is_paused() is False and control.weight_version() == "1"
    assert torch.allclose(logprobs.server(vllm_server.model_name), logprobs.trainer(model), atol=TOLERANCE)

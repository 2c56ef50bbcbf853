"""The disk backend against the real CPU server: the server serves the new weights after a sync, and
a failed sync leaves it resumed and serving the last good version, or paused when that cannot be restored.

Tolerance: the server's prompt log-probs match the trainer model's within 1e-4 (both float32; measured
about 5e-7), and a sync changes them by more than 0.05. The tied embedding is left unperturbed: a CPU
server keeps a prepacked copy of the tied `lm_head` across reloads (see the package README).
"""

from __future__ import annotations

import pytest
import torch

from agrpo_attention.testing import TinyModelSpec, save_tiny_model
from agrpo_rollout.testing import VLLMServer
from agrpo_sync import ManifestMismatchError, ServerControl, TransferFailedError, WeightSync, WeightSyncConfig

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
    # the checkpoint is written before generation pauses: the pause covers the reload only
    assert (
        timings.stage_s > 0 and timings.generation_paused_s < timings.weight_sync_s - timings.stage_s + 1e-3
    )
    assert "perf/weight_sync_stage_s" in timings.metrics()
    sync.sync(model, 2)  # the same version twice: written beside the served directory, never over it
    assert sorted(p.name for p in (tmp_path / ".vllm_weights").iterdir()) == ["v2.1"]
    assert torch.allclose(logprobs.server(vllm_server.model_name), logprobs.trainer(model), atol=TOLERANCE)


def test_a_reload_the_server_refuses_is_undone_on_a_fresh_connection(
    vllm_server, tmp_path, tiny_model, perturb, logprobs
):
    model = tiny_model()
    perturb(model, 1)
    sync = WeightSync.start(_config(vllm_server.url, tmp_path), model)
    sync.sync(model, 1)
    good = logprobs.server(vllm_server.model_name)
    stage = sync.backend.stage

    def truncated_stage(stream, version):  # the server's own refusal: a shard cut in half
        stage(stream, version)
        shard = sorted(sync.backend._staged[1].glob("*.safetensors"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    sync.backend.stage = truncated_stage
    perturb(model, 2)
    # vLLM answers 500 and closes that connection; a recovery reusing it failed with "connection reset"
    with pytest.raises(
        TransferFailedError, match="collective_rpc: HTTP 500.*deserializing header"
    ) as failure:
        sync.sync(model, 2)
    assert "reloaded from" in failure.value.server_state and "/v1" in failure.value.server_state
    assert not failure.value.left_paused
    control = ServerControl(vllm_server.url)
    assert control.is_paused() is False and control.weight_version() == "1"
    assert torch.allclose(logprobs.server(vllm_server.model_name), good, atol=TOLERANCE)
    assert sorted(p.name for p in (tmp_path / ".vllm_weights").iterdir()) == ["v1"]


def test_a_checkpoint_that_cannot_be_written_pauses_nothing_and_leaves_nothing(
    vllm_server, tmp_path, tiny_model, perturb, logprobs, file_size_limit
):
    model = tiny_model()
    before = logprobs.server(vllm_server.model_name)
    sync = WeightSync.start(_config(vllm_server.url, tmp_path), model)
    pauses = []
    sync.control.pause = lambda *args: pauses.append(args)
    perturb(model, 3)
    # a real "File too large" from the OS, raised by safetensors as its own SafetensorError
    with (
        file_size_limit(20_000),
        pytest.raises(TransferFailedError, match="before pausing.*File too large") as failure,
    ):
        sync.sync(model, 1)
    assert "nothing reached the server" in failure.value.server_state and not failure.value.left_paused
    assert pauses == [] and list((tmp_path / ".vllm_weights").iterdir()) == []
    assert ServerControl(vllm_server.url).is_paused() is False
    assert torch.allclose(logprobs.server(vllm_server.model_name), before, atol=TOLERANCE)


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


@pytest.fixture
def own_server(tmp_path_factory):
    """A server of its own: a reload with a tensor of another shape breaks a vLLM 0.32 server for good."""
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny-own"), TinyModelSpec())
    with VLLMServer(model_dir=model_dir, max_model_len=512) as server:
        yield server


def test_a_tensor_of_another_shape_is_refused_before_pausing_and_the_servers_own_refusal_is_reported(
    own_server, tmp_path, tiny_model
):
    model = tiny_model()
    url = own_server.url
    sync = WeightSync.start(_config(url, tmp_path), model)
    control = ServerControl(url)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(torch.zeros(64, 120))
    name = r"model\.layers\.0\.mlp\.down_proj\.weight \[64, 120\] \(expected \[64, 128\]\)"
    with pytest.raises(ManifestMismatchError, match=name) as refused:  # checked against the served checkpoint
        sync.sync(model, 1)
    assert "nothing was sent and generation was not paused" in refused.value.server_state
    assert control.is_paused() is False and control.weight_version() == "default"
    sync.manifest = None  # without the pre-flight, the server itself refuses the reload (HTTP 500)
    with pytest.raises(TransferFailedError, match="exceeds dimension size") as failure:
        sync.sync(model, 1)
    message = str(failure.value) + "".join(getattr(failure.value, "__notes__", []))
    # the recovery reload reached the server on a fresh connection (no "connection reset"), which refused it
    # too: vLLM keeps the misshapen tensor, so only a restart helps; a bare /resume would crash the engine
    assert "restoring the last good version failed too" in message and "Connection reset" not in message
    assert "restart it" in message and "/resume" not in message and failure.value.left_paused
    assert control.is_paused() is True
    control.close()

"""The NCCL backend's protocol flow against a protocol-level stub worker (gloo stands in for NCCL on CPU),
and against the real CPU server where it must refuse cleanly (the CPU build cannot join NCCL)."""

from __future__ import annotations

import base64
import re

import pytest
import torch

from agrpo_sync import (
    NcclBackend,
    SyncSetupError,
    TransferFailedError,
    TransportError,
    WeightSync,
    WeightSyncConfig,
)
from agrpo_sync._server_control import ServerControl
from tools.bench.weight_sync.gloo_transport import GlooTransport
from tools.bench.weight_sync.stub_worker import checksums

SYNC_CALLS = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"]


def _config(url: str, tmp_path, **overrides) -> WeightSyncConfig:
    return WeightSyncConfig(
        base_url=url, output_dir=str(tmp_path), packed_buffer_size_bytes=50_000, **overrides
    )


def _assert_received(worker, model: torch.nn.Module) -> None:
    sent = dict(model.named_parameters())
    assert set(worker.weights) == set(sent)
    for name, param in sent.items():
        assert torch.equal(worker.weights[name], param.detach()), name
    assert checksums(worker.weights) == checksums({n: p.detach() for n, p in sent.items()})


def test_init_then_each_sync_follow_the_servers_protocol(stub_worker, tmp_path, tiny_model, perturb):
    model = tiny_model()
    sync = WeightSync.start(_config(stub_worker.url, tmp_path), model, transport=GlooTransport())
    assert stub_worker.calls[-2:] == ["/get_world_size", "/init_weight_transfer_engine"]
    for version in (1, 2):
        perturb(model, version, skip="")
        stub_worker.calls.clear()
        timings = sync.sync(model, version)
        # from the second sync on, the label this trainer set is read back first: a restart would show
        assert stub_worker.calls == (["/weight_info"] if version > 1 else []) + SYNC_CALLS
        _assert_received(stub_worker, model)
        assert stub_worker.state == {
            **stub_worker.state,
            "paused": False,
            "started": False,
            "version": str(version),
        }
    assert stub_worker.chunks_received > 1  # several packed chunks per sync at this buffer size
    assert set(timings.metrics()) == {
        "perf/weight_sync_s", "perf/weight_sync_pause_s", "perf/weight_sync_barrier_s", "perf/weight_sync_transfer_s",
        "perf/weight_sync_retries", "perf/weight_sync_stage_s", "perf/weight_sync_generation_paused_s",
    }  # fmt: skip
    assert timings.metrics()["perf/weight_sync_retries"] == 0
    assert timings.num_bytes == sum(p.nbytes for p in model.parameters())
    sync.close()


def test_init_payload_is_what_vllm_parses(stub_worker, tmp_path, tiny_model):
    seen = {}
    original = stub_worker.init_engine
    stub_worker.init_engine = lambda info: seen.update(info) or original(info)
    WeightSync.start(
        _config(stub_worker.url, tmp_path, packed_num_buffers=3), tiny_model(), transport=GlooTransport()
    )
    assert seen.keys() == {
        "nccl_unique_id_b64", "rank_offset", "world_size", "packed", "packed_buffer_size_bytes", "packed_num_buffers"
    }  # fmt: skip
    assert len(base64.b64decode(seen["nccl_unique_id_b64"], validate=True)) == 128
    assert (seen["rank_offset"], seen["world_size"], seen["packed"]) == (1, 2, True)
    assert (seen["packed_buffer_size_bytes"], seen["packed_num_buffers"]) == (50_000, 3)


def test_a_failure_mid_transfer_is_retried_once_and_the_server_ends_on_the_new_version(
    stub_worker, tmp_path, tiny_model, perturb, caplog
):
    model = tiny_model()
    sync = WeightSync.start(_config(stub_worker.url, tmp_path), model, transport=GlooTransport(timeout_s=5))
    sync.sync(model, 1)
    perturb(model, 2, skip="")
    stub_worker.fail_update_after_chunks, stub_worker.fail_update_times = 2, 1  # after 2 of n chunks, once
    stub_worker.calls.clear()
    with caplog.at_level("WARNING", logger="agrpo_sync"):
        timings = sync.sync(model, 2)
    assert timings.retries == 1 and timings.metrics()["perf/weight_sync_retries"] == 1
    assert (
        "load_weights failed after chunk 2" in caplog.text and "re-sending every weight once" in caplog.text
    )
    _assert_received(stub_worker, model)  # exactly the new weights: no layer left on version 1
    assert stub_worker.state == {**stub_worker.state, "paused": False, "started": False, "version": "2"}
    assert stub_worker.calls == [
        "/weight_info",  # the label of version 1: the same process
        "/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",  # failed attempt, closed
        "/shutdown_weight_transfer_engine", "/get_world_size", "/init_weight_transfer_engine",  # fresh group
        "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume",
    ]  # fmt: skip
    sync.close()


def test_a_retry_that_fails_too_keeps_the_server_paused_until_a_complete_sync(
    stub_worker, tmp_path, tiny_model, perturb
):
    model = tiny_model()
    sync = WeightSync.start(_config(stub_worker.url, tmp_path), model, transport=GlooTransport(timeout_s=5))
    sync.sync(model, 1)
    perturb(model, 2, skip="")
    stub_worker.fail_update_after_chunks = 1  # every update fails after its first chunk
    with pytest.raises(TransferFailedError, match=r"load_weights failed.*the retry failed too") as failure:
        sync.sync(model, 2)
    assert failure.value.left_paused is True
    assert re.search(r"\d of \d+ chunks were sent before the failure", failure.value.server_state)
    assert "generation stays paused so that mixed weights are not served" in failure.value.server_state
    assert "call sync() again" in failure.value.server_state and f"{stub_worker.url}/resume" in str(
        failure.value
    )
    assert stub_worker.state["paused"] is True and stub_worker.state["version"] == "1"
    assert stub_worker.state["started"] is False
    stub_worker.fail_update_after_chunks = None
    timings = sync.sync(model, 3)  # what the error says to do: a complete sync resumes generation
    assert timings.retries == 0
    _assert_received(stub_worker, model)
    assert stub_worker.state["paused"] is False and stub_worker.state["version"] == "3"


def test_a_failure_before_any_byte_keeps_the_last_good_version_without_a_retry(
    stub_worker, tmp_path, tiny_model, perturb
):
    model = tiny_model()
    sync = WeightSync.start(_config(stub_worker.url, tmp_path), model, transport=GlooTransport(timeout_s=3))
    sync.sync(model, 1)
    before = checksums(stub_worker.weights)
    perturb(model, 2, skip="")
    stub_worker.reject_start = True
    stub_worker.calls.clear()
    with pytest.raises(TransferFailedError, match="start_weight_update rejected") as failure:
        sync.sync(model, 2)
    assert stub_worker.calls == [
        "/weight_info",
        "/pause",
        "/start_weight_update",
        "/resume",
    ]  # no retry, resumed
    assert "serves the last good version" in failure.value.server_state and not failure.value.left_paused
    assert checksums(stub_worker.weights) == before
    assert stub_worker.state == {**stub_worker.state, "paused": False, "started": False, "version": "1"}


def test_a_server_blocked_inside_nccl_is_not_retried_and_the_error_says_restart(
    stub_worker, tmp_path, tiny_model, perturb
):
    model = tiny_model()
    config = _config(stub_worker.url, tmp_path, transfer_timeout_s=2)
    sync = WeightSync.start(config, model, transport=GlooTransport(timeout_s=2))
    perturb(model, 2, skip="")
    stub_worker.stall_update = True  # the server's /update_weights never answers
    with pytest.raises(TransferFailedError, match="has not answered /update_weights") as failure:
        sync.sync(model, 1)
    assert "restart the server" in failure.value.server_state and failure.value.left_paused
    assert stub_worker.calls.count("/update_weights") == 1 and stub_worker.state["paused"] is True


def test_a_server_that_cannot_join_nccl_fails_setup_naming_the_flags(stub_worker, tmp_path, tiny_model):
    stub_worker.fail_init = True
    with pytest.raises(TransportError, match="weight-transfer-config"):
        WeightSync.start(
            _config(stub_worker.url, tmp_path), tiny_model(), transport=GlooTransport(timeout_s=5)
        )


@pytest.mark.server
def test_the_real_cpu_server_is_refused_at_start_with_the_flag_to_add(vllm_server, tmp_path, tiny_model):
    with pytest.raises(SyncSetupError, match=r"""--weight-transfer-config '\{"backend":"nccl"\}'"""):
        WeightSync.start(
            _config(vllm_server.url, tmp_path), tiny_model(), transport=GlooTransport(timeout_s=5)
        )


@pytest.mark.server
def test_the_real_cpu_servers_nccl_refusal_becomes_a_clear_error(vllm_server, tmp_path):
    control = ServerControl(vllm_server.url)
    backend = NcclBackend.from_config(
        _config(vllm_server.url, tmp_path), [control], GlooTransport(timeout_s=5)
    )
    with pytest.raises(TransportError, match="did not join the NCCL group.*HTTP 500"):
        backend.links[0].connect()
    assert control.is_paused() is False
    control.close()

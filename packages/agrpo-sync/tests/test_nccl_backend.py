"""The NCCL backend's protocol flow against a protocol-level stub worker (gloo stands in for NCCL on CPU),
and against the real CPU server where it must refuse cleanly (the CPU build cannot join NCCL)."""

from __future__ import annotations

import base64

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


def test_init_then_each_sync_follow_the_servers_protocol(stub_worker, tmp_path, tiny_model, perturb):
    model = tiny_model()
    sync = WeightSync.start(_config(stub_worker.url, tmp_path), model, transport=GlooTransport())
    assert stub_worker.calls[-2:] == ["/get_world_size", "/init_weight_transfer_engine"]
    for version in (1, 2):
        perturb(model, version, skip="")
        stub_worker.calls.clear()
        timings = sync.sync(model, version)
        assert stub_worker.calls == SYNC_CALLS
        _assert_received(stub_worker, model)
        assert stub_worker.state == {
            **stub_worker.state,
            "paused": False,
            "started": False,
            "version": str(version),
        }
    assert stub_worker.chunks_received > 1  # several packed chunks per sync at this buffer size
    assert set(timings.metrics()) == {
        "perf/weight_sync_s", "perf/weight_sync_pause_s", "perf/weight_sync_barrier_s", "perf/weight_sync_transfer_s"
    }  # fmt: skip
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


def test_a_server_that_fails_mid_transfer_is_resumed_and_the_next_sync_rejoins(
    stub_worker, tmp_path, tiny_model, perturb
):
    model = tiny_model()
    sync = WeightSync.start(_config(stub_worker.url, tmp_path), model, transport=GlooTransport(timeout_s=5))
    sync.sync(model, 1)
    perturb(model, 2, skip="")
    stub_worker.fail_update_after_chunks = 1
    with pytest.raises(
        TransferFailedError, match=r"load_weights failed.*\d of \d+ chunks were sent"
    ) as failure:
        sync.sync(model, 2)
    assert "re-sends every weight" in failure.value.server_state
    assert stub_worker.state["paused"] is False and stub_worker.state["version"] == "1"
    stub_worker.fail_update_after_chunks = None
    stub_worker.calls.clear()
    sync.sync(model, 3)
    assert stub_worker.calls[:4] == [
        "/pause",
        "/shutdown_weight_transfer_engine",
        "/get_world_size",
        "/init_weight_transfer_engine",
    ]
    _assert_received(stub_worker, model)


def test_an_update_rejected_before_any_byte_leaves_the_last_good_version(stub_worker, tmp_path, tiny_model):
    model = tiny_model()
    sync = WeightSync.start(_config(stub_worker.url, tmp_path), model, transport=GlooTransport(timeout_s=3))
    stub_worker.reject_update = True
    stub_worker.calls.clear()
    with pytest.raises(TransferFailedError, match="rejected before any chunk") as failure:
        sync.sync(model, 1)
    assert stub_worker.calls[-2:] == ["/finish_weight_update", "/resume"]
    assert stub_worker.state["version"] == "default" and stub_worker.state["paused"] is False
    assert (
        "serves the last good version" in failure.value.server_state
        or "re-sends" in failure.value.server_state
    )


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
    backend = NcclBackend.from_config(_config(vllm_server.url, tmp_path), control, GlooTransport(timeout_s=5))
    with pytest.raises(TransportError, match="did not join the NCCL group.*HTTP 500"):
        backend.connect()
    assert control.is_paused() is False
    control.close()

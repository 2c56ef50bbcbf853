"""Adapter-only LoRA sync against the real CPU server (`--enable-lora --max-lora-rank 8 --max-loras 4`):
each new version serves the new adapter, in-window versions keep serving, out-of-window versions are
gone from the server and from disk; re-pushing a registered version loads it in place, a restarted
trainer takes over the window (and the old one's late, repeated close() finds its adapters already
unloaded: not an error); plus the start-up checks and a failed load."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model

from agrpo_sync import (
    ServerControl,
    SyncSetupError,
    TransferFailedError,
    WeightSync,
    WeightSyncConfig,
    adapter_name,
)
from agrpo_sync._lora_limits import adapter_problems, restart_command

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("restore_server")]
NAME = "agrpo-test-policy"
TOLERANCE = 1e-4


def _peft_model(tiny_model, rank: int = 8):
    config = LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    return get_peft_model(tiny_model(), config)


def _config(url: str, tmp_path, **overrides) -> WeightSyncConfig:
    return WeightSyncConfig(base_url=url, output_dir=str(tmp_path), lora_name=NAME, **overrides)


def _registered(url: str) -> list[str]:
    return sorted(m["id"] for m in ServerControl(url).models() if m.get("parent"))


def test_adapter_versions_serve_within_the_window_and_leave_it(
    vllm_server, tmp_path, tiny_model, perturb, logprobs
):
    model = _peft_model(tiny_model)
    sync = WeightSync.start(_config(vllm_server.url, tmp_path, lora_sync="adapter", max_staleness=2), model)
    assert sync.backend_name == "lora"
    served = {}
    for version in range(1, 5):
        perturb(model, version, skip="", only="lora_", scale=0.1)
        timings = sync.sync(model, version)
        assert timings.pause_s < 0.05  # adapter loads need no pause
        parts = sync.backend.last_send  # where the send's time went: each part measured, inside the sync
        split = [parts.copy_s, parts.write_s, parts.load_s, parts.retire_s]
        assert min(split) >= 0 and parts.write_s > 0 and parts.load_s > 0
        assert sum(split) <= timings.weight_sync_s
        name = sync.served_model(version)
        assert name == adapter_name(NAME, version)
        served[version] = logprobs.server(name)
        assert torch.allclose(served[version], logprobs.trainer(model), atol=TOLERANCE)
    assert _registered(vllm_server.url) == [adapter_name(NAME, v) for v in (2, 3, 4)]
    for version in (2, 3):  # still in the window: unchanged answers under their own adapter
        assert torch.allclose(logprobs.server(adapter_name(NAME, version)), served[version], atol=TOLERANCE)
    assert logprobs.server(adapter_name(NAME, 1)) == 404
    assert sorted(p.name for p in (tmp_path / ".vllm_lora").iterdir()) == [
        adapter_name(NAME, v) for v in (2, 3, 4)
    ]
    with pytest.raises(ValueError, match="left the window"):
        sync.served_model(1)
    sync.close()
    assert _registered(vllm_server.url) == [] and list((tmp_path / ".vllm_lora").iterdir()) == []


def test_a_failed_adapter_load_keeps_the_window_serving(
    vllm_server, fault_proxy, tmp_path, tiny_model, perturb, logprobs
):
    model = _peft_model(tiny_model)
    sync = WeightSync.start(_config(fault_proxy.url, tmp_path, max_staleness=1), model)
    perturb(model, 1, skip="", only="lora_", scale=0.1)
    sync.sync(model, 1)
    good = logprobs.server(adapter_name(NAME, 1))
    fault_proxy.arm("/v1/load_lora_adapter", "before")
    with pytest.raises(TransferFailedError, match="load_lora_adapter: HTTP 500") as failure:
        sync.sync(model, 2)
    assert f"the last good version is {adapter_name(NAME, 1)}" in failure.value.server_state
    assert torch.allclose(logprobs.server(adapter_name(NAME, 1)), good, atol=TOLERANCE)
    assert not (tmp_path / ".vllm_lora" / adapter_name(NAME, 2)).exists()
    sync.close()


def test_merged_sync_is_the_fallback_and_serves_the_merged_weights(
    vllm_server, tmp_path, tiny_model, perturb, logprobs
):
    model = _peft_model(tiny_model)
    perturb(model, 5, skip="", only="lora_", scale=0.1)
    config = _config(
        vllm_server.url, tmp_path, backend="disk", max_staleness=3
    )  # needs --max-loras 5 for adapters
    sync = WeightSync.start(config, model)
    assert sync.backend_name == "disk" and sync.served_model(1) is None
    sync.sync(model, 1)
    assert torch.allclose(logprobs.server(vllm_server.model_name), logprobs.trainer(model), atol=TOLERANCE)


def test_start_up_checks_print_the_exact_flags_to_restart_with(vllm_server, tmp_path, tiny_model):
    with pytest.raises(SyncSetupError) as error:
        WeightSync.start(
            _config(vllm_server.url, tmp_path, lora_sync="adapter", max_staleness=4),
            _peft_model(tiny_model, 16),
        )
    message = str(error.value)
    assert "--max-lora-rank is 8, below the adapter's rank 16" in message
    assert "--max-loras is 4, below max_staleness + 2 = 6" in message
    assert "--enable-lora --max-lora-rank 16 --max-loras 6" in message
    info = ServerControl(vllm_server.url).server_info()
    assert adapter_problems(info, LoraConfig(r=8), 2) == []
    off = dataclasses.replace(info, lora_enabled=False, runtime_lora_updating=False)
    assert len(adapter_problems(off, LoraConfig(r=8), 2)) == 2
    assert restart_command(LoraConfig(r=20, rank_pattern={"q_proj": 40}), 1).endswith(
        "--max-lora-rank 64 --max-loras 3"
    )


def test_re_pushing_a_registered_version_loads_it_in_place_from_a_fresh_directory(
    vllm_server, tmp_path, tiny_model, perturb, logprobs
):
    model = _peft_model(tiny_model)
    sync = WeightSync.start(_config(vllm_server.url, tmp_path, lora_sync="adapter", max_staleness=1), model)
    for version in (1, 2):
        perturb(model, version, skip="", only="lora_", scale=0.1)
        sync.sync(model, version)
    perturb(model, 3, skip="", only="lora_", scale=0.1)
    sync.sync(model, 2)  # vLLM answered 400 "already loaded" and the registered directory was deleted
    assert torch.allclose(logprobs.server(adapter_name(NAME, 2)), logprobs.trainer(model), atol=TOLERANCE)
    assert _registered(vllm_server.url) == [adapter_name(NAME, v) for v in (1, 2)]
    lora_dir = tmp_path / ".vllm_lora"
    assert sorted(p.name for p in lora_dir.iterdir()) == [adapter_name(NAME, 1), adapter_name(NAME, 2) + ".1"]
    sync.sync(model, 3)  # the window moves on as usual; every registered adapter still serves
    assert _registered(vllm_server.url) == [adapter_name(NAME, v) for v in (2, 3)]
    assert torch.allclose(logprobs.server(adapter_name(NAME, 2)), logprobs.trainer(model), atol=TOLERANCE)
    sync.close()
    assert _registered(vllm_server.url) == [] and list(lora_dir.iterdir()) == []


def test_a_restarted_trainer_takes_over_the_window_and_deletes_only_inside_its_directory(
    vllm_server, tmp_path, tiny_model, perturb, logprobs
):
    model = _peft_model(tiny_model)
    config = _config(vllm_server.url, tmp_path, lora_sync="adapter", max_staleness=1)
    before = WeightSync.start(config, model)
    perturb(model, 1, skip="", only="lora_", scale=0.1)
    before.sync(model, 1)
    elsewhere = tmp_path / "elsewhere"  # an adapter of this name registered from outside .vllm_lora
    shutil.move(tmp_path / ".vllm_lora" / adapter_name(NAME, 1), elsewhere)
    control = ServerControl(vllm_server.url)
    control.unload_lora_adapter(adapter_name(NAME, 1))
    control.load_lora_adapter(adapter_name(NAME, 1), str(elsewhere))
    perturb(model, 2, skip="", only="lora_", scale=0.1)
    before.sync(model, 2)  # the trainer stops here without close()
    after = WeightSync.start(config, model)
    assert after.backend.live == [1, 2]
    after.sync(model, 2)  # a re-push inside the window: in place
    perturb(model, 3, skip="", only="lora_", scale=0.1)
    after.sync(model, 3)
    assert _registered(vllm_server.url) == [adapter_name(NAME, v) for v in (2, 3)]
    assert torch.allclose(logprobs.server(adapter_name(NAME, 3)), logprobs.trainer(model), atol=TOLERANCE)
    assert elsewhere.is_dir()  # unloaded, but not deleted: it is outside <output_dir>/.vllm_lora
    after.close()
    assert _registered(vllm_server.url) == [] and list((tmp_path / ".vllm_lora").iterdir()) == []
    assert before.backend.live == [1, 2]  # the old trainer's close, late: the new one unloaded all of them
    before.close()  # the server answers 404 "cannot be found" for each: already unloaded, not an error
    before.close()
    after.close()  # twice is fine too
    assert before.backend.live == [] and _registered(vllm_server.url) == []

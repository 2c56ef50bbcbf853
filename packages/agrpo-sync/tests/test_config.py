"""`WeightSyncConfig`: construction fails on a bad value, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from agrpo_sync import SyncSetupError, WeightSyncConfig


def _config(**overrides) -> WeightSyncConfig:
    return WeightSyncConfig(**{"base_url": "http://h:8000", "output_dir": "/tmp/run", **overrides})


@pytest.mark.parametrize(
    ("field", "value"),
    [("backend", "ipc"), ("lora_sync", "sometimes"), ("pause_mode", "freeze"), ("transfer_dtype", "fp8"),
     ("base_url", "h:8000"), ("output_dir", ""), ("max_staleness", -1), ("packed_num_buffers", 0),
     ("gather_bucket_bytes", 0), ("http_timeout_s", 0)],
)  # fmt: skip
def test_bad_values_name_the_field(field, value):
    with pytest.raises(SyncSetupError, match=field):
        _config(**{field: value})


def test_defaults_and_derived_directories():
    config = _config()
    assert (config.backend, config.lora_sync, config.pause_mode, config.max_staleness) == (
        "nccl",
        "auto",
        "keep",
        4,
    )
    assert (
        config.pause_clear_cache is True
    )  # sampler log-probs stay the served weights' (test_stale_prefix.py)
    assert config.packed_buffer_size_bytes == 1 << 30 and config.packed_num_buffers == 2
    assert config.lora_dir == Path("/tmp/run/.vllm_lora") and config.weights_dir == Path(
        "/tmp/run/.vllm_weights"
    )
    assert _config(disk_dir="/shared/w").weights_dir == Path("/shared/w")
    with pytest.raises(TypeError):
        WeightSyncConfig("http://h:8000", "/tmp/run")  # keyword-only


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".hidden", "", "a/../../b", "x..y", "/abs"])
def test_lora_names_that_would_leave_the_adapter_directory_are_refused(name):
    with pytest.raises(SyncSetupError, match="lora_name"):
        _config(lora_name=name)


def test_ordinary_lora_names_are_accepted():
    assert _config(lora_name="agrpo-policy_2.run-3").lora_name == "agrpo-policy_2.run-3"

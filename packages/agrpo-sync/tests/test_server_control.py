"""`ServerControl` and `ServerInfo` against the real CPU server: discovery, pause/resume, loud errors."""

from __future__ import annotations

import pytest

from agrpo_sync import ServerControl, ServerRequestError
from agrpo_sync._server_control import parse_server_info

pytestmark = pytest.mark.server


def test_server_info_reads_the_flags_the_start_up_checks_need(vllm_server):
    control = ServerControl(vllm_server.url)
    info = control.server_info()
    assert info.version.startswith("0.3")
    assert (info.dtype, info.device, info.model_root) == ("float32", "cpu", vllm_server.model_name)
    assert (info.lora_enabled, info.max_lora_rank, info.max_loras) == (True, 8, 4)
    assert info.runtime_lora_updating is True and info.data_parallel_size == 1
    assert info.weight_transfer_backend is None  # the shared server has no --weight-transfer-config
    assert control.world_size() == 1
    control.close()


def test_pause_keep_and_resume(vllm_server):
    control = ServerControl(vllm_server.url)
    try:
        control.pause("keep", clear_cache=False)
        assert control.is_paused() is True
    finally:
        control.resume()
    assert control.is_paused() is False
    control.close()


def test_errors_name_the_endpoint_and_the_status(vllm_server):
    control = ServerControl(vllm_server.url)
    with pytest.raises(ServerRequestError, match=r"POST /pause: HTTP 4\d\d") as error:
        control.pause("sideways", clear_cache=False)
    assert error.value.status in (400, 422) and error.value.endpoint == "POST /pause"
    with pytest.raises(ServerRequestError, match="unload_lora_adapter: HTTP"):
        control.unload_lora_adapter("no-such-adapter")
    assert control.is_paused() is False
    control.close()
    unreachable = ServerControl("http://127.0.0.1:9", timeout_s=2)
    with pytest.raises(ServerRequestError, match="no answer"):
        unreachable.is_paused()


def test_parse_server_info_without_lora_or_transfer_config():
    info = parse_server_info({"vllm_config": {"model_config": {"dtype": "torch.bfloat16"}}}, "0.33.0", "m")
    assert (info.dtype, info.lora_enabled, info.max_loras, info.weight_transfer_backend) == (
        "bfloat16",
        False,
        0,
        None,
    )
    assert info.runtime_lora_updating is False and info.data_parallel_size == 1

"""What adapter sync writes, against the protocol stub (`tools/bench/weight_sync/stub_worker.py`, which loads
adapters with vLLM 0.32's steps): files in the server's dtype unless `transfer_dtype` names one, the same
values the server then holds, and where each send's time went."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open

from agrpo_sync import WeightSync, WeightSyncConfig
from tools.bench.weight_sync.stub_worker import StubWorker


@pytest.fixture
def lora_stub():
    """A stub server that serves bfloat16 and takes adapters up to rank 8 (no weight transport needed)."""
    worker = StubWorker(transport=None, dtype="bfloat16", lora={"max_lora_rank": 8, "max_loras": 3})
    server = worker.serve()
    yield worker, server.url
    server.stop()


def _file_dtypes(directory) -> set[torch.dtype]:
    with safe_open(str(directory / "adapter_model.safetensors"), framework="pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict


@pytest.mark.parametrize(("transfer_dtype", "written"), [("", torch.bfloat16), ("float32", torch.float32)])
def test_adapters_are_written_in_the_servers_dtype_unless_transfer_dtype_says(
    lora_stub, tmp_path, tiny_model, transfer_dtype, written
):
    worker, url = lora_stub
    model = get_peft_model(tiny_model(), LoraConfig(r=8, target_modules=["q_proj", "down_proj"]))
    config = WeightSyncConfig(
        base_url=url,
        output_dir=str(tmp_path),
        lora_sync="adapter",
        max_staleness=1,
        transfer_dtype=transfer_dtype,
    )
    sync = WeightSync.start(config, model)
    adapter_bytes = sum(p.numel() * written.itemsize for n, p in model.named_parameters() if "lora_" in n)
    for version in (1, 2, 3):
        timings = sync.sync(model, version)
        file = sync.backend.path(version) / "adapter_model.safetensors"
        assert adapter_bytes < file.stat().st_size < adapter_bytes + 8192  # the tensors plus the header
        parts = sync.backend.last_send
        assert sum([parts.copy_s, parts.write_s, parts.load_s, parts.retire_s]) <= timings.weight_sync_s
    assert _file_dtypes(sync.backend.path(3)) == {written}
    served = worker.adapters[sync.served_model(3)]
    for name, param in model.named_parameters():
        if "lora_A" in name:
            key = name.replace(".default", "")
            assert torch.equal(served[key], param.detach().to(written).to(torch.bfloat16))
    assert len(worker.lora_load_s) == 3 and sorted(worker.adapters) == [sync.served_model(v) for v in (2, 3)]
    sync.close()

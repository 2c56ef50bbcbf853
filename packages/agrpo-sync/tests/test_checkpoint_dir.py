"""Writing safetensors directories atomically: shards plus index, single files, shared storage."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from agrpo_sync._checkpoint_dir import INDEX_FILE, host_copy, write_checkpoint


def test_shards_and_index_hold_every_tensor_and_the_partial_dir_is_gone(tmp_path):
    buckets = [[("a", torch.ones(2)), ("b", torch.zeros(3))], [("c", torch.arange(4.0))]]
    target = write_checkpoint(iter(buckets), tmp_path / "v1")
    index = json.loads((target / INDEX_FILE).read_text())
    assert index["weight_map"] == {
        "a": "model-00001.safetensors",
        "b": "model-00001.safetensors",
        "c": "model-00002.safetensors",
    }
    assert index["metadata"]["total_size"] == 4 * 9
    assert torch.equal(load_file(target / "model-00002.safetensors")["c"], torch.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_single_file_with_extra_files_replaces_an_existing_directory(tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "stale.txt").write_text("old")
    target = write_checkpoint(
        iter([[("x", torch.ones(1))]]),
        tmp_path / "adapter",
        single_file="adapter_model.safetensors",
        extra_files=lambda d: (d / "adapter_config.json").write_text("{}"),
    )
    assert sorted(p.name for p in target.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_tensors_sharing_storage_are_copied_apart():
    base = torch.arange(6.0)
    copies = host_copy([("whole", base), ("alias", base.view(2, 3))])
    assert copies["alias"].untyped_storage().data_ptr() != copies["whole"].untyped_storage().data_ptr()
    assert torch.equal(copies["alias"], base.view(2, 3))

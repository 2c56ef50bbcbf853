"""Writing safetensors directories atomically: shards plus index, single files, shared storage."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from agrpo_sync._checkpoint_dir import (
    INDEX_FILE,
    CheckpointWriteError,
    HostStaging,
    fresh_directory,
    host_copy,
    write_checkpoint,
)
from agrpo_sync._wire_format import TensorMeta


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


def test_a_failed_write_leaves_no_partial_directory_and_names_the_cause(tmp_path, file_size_limit):
    # safetensors raises its own SafetensorError (not OSError) for "File too large" / "No space left"
    with file_size_limit(4096), pytest.raises(CheckpointWriteError, match="File too large") as error:
        write_checkpoint(iter([[("big", torch.zeros(10_000))]]), tmp_path / "v1")
    assert isinstance(error.value, OSError) and "SafetensorError" in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_a_directory_in_use_gets_a_fresh_name_beside_it(tmp_path):
    target = tmp_path / "p-v3"
    assert fresh_directory(target, set()) == target
    assert fresh_directory(target, {target}) == tmp_path / "p-v3.1"
    assert fresh_directory(target, {target, tmp_path / "p-v3.1"}) == tmp_path / "p-v3.2"


def test_host_staging_hands_host_tensors_through_and_reserves_buffers_by_name(tmp_path):
    staging = HostStaging()
    staging.reserve([TensorMeta("a", torch.bfloat16, (2, 3)), TensorMeta("b", torch.float32, (4,))])
    assert {n: (tuple(b.shape), b.dtype) for n, b in staging._buffers.items()} == {
        "a": ((2, 3), torch.bfloat16),
        "b": ((4,), torch.float32),
    }
    base = torch.arange(6.0)
    copies = staging.copy(iter([("whole", base), ("alias", base.view(2, 3))]))
    assert copies["whole"].data_ptr() == base.data_ptr()  # host tensors are written from where they are
    assert copies["alias"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    target = write_checkpoint(
        iter([list(copies.items())]), tmp_path / "v1", single_file="adapter_model.safetensors"
    )
    written = load_file(target / "adapter_model.safetensors")
    assert torch.equal(written["whole"], base) and torch.equal(written["alias"], base.view(2, 3))


def test_host_staging_buffers_follow_a_changed_shape_or_dtype():
    staging = HostStaging()
    first = staging._buffer("x", (2,), torch.float32)
    assert staging._buffer("x", (2,), torch.float32) is first  # reused from one write to the next
    assert staging._buffer("x", (3,), torch.float32) is not first
    assert staging._buffer("x", (3,), torch.bfloat16).dtype == torch.bfloat16

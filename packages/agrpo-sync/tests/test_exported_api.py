"""Freezes agrpo_sync's public surface (style habit 14): growing it is a reviewed decision."""

import agrpo_sync

EXPORTED = [
    "BACKENDS",
    "ChunkPlan",
    "ChunkTransport",
    "DiskBackend",
    "JOURNAL_NAME",
    "LoraAdapterBackend",
    "ManifestMismatchError",
    "NcclBackend",
    "NcclTransport",
    "ParamStream",
    "Recovery",
    "ServerControl",
    "ServerInfo",
    "ServerRequestError",
    "ServerUnreachableError",
    "SyncBackend",
    "SyncSetupError",
    "SyncTimings",
    "TensorMeta",
    "TransferFailedError",
    "TransportError",
    "WeightSync",
    "WeightSyncConfig",
    "WeightSyncError",
    "adapter_name",
    "pack_chunk",
    "plan_chunks",
    "settle_interrupted_sync",
    "unpack_chunk",
    "update_info",
]


def test_exported_api_is_frozen():
    assert agrpo_sync.__all__ == EXPORTED


def test_the_backend_table_lists_one_module_per_backend():
    assert sorted(agrpo_sync.BACKENDS) == ["disk", "lora", "nccl"]
    assert {cls.view for cls in agrpo_sync.BACKENDS.values()} == {"full", "adapter"}

"""agrpo-sync: push a trainer's weights to a vLLM server (NCCL, disk, LoRA adapters) with pause/resume.

See the package README for the map of modules and what to read first.
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from ._backend import Recovery, SyncBackend
from ._config import WeightSyncConfig
from ._disk_backend import DiskBackend
from ._exceptions import (
    ManifestMismatchError,
    ServerRequestError,
    ServerUnreachableError,
    SyncSetupError,
    TransferFailedError,
    TransportError,
    WeightSyncError,
)
from ._lora_backend import LoraAdapterBackend, adapter_name
from ._nccl_backend import NcclBackend
from ._nccl_transport import NcclTransport
from ._param_stream import ParamStream
from ._registry import BACKENDS
from ._server_control import ServerControl, ServerInfo
from ._sync_journal import JOURNAL_NAME, settle_interrupted_sync
from ._sync_timings import SyncTimings
from ._transport import ChunkTransport
from ._weight_sync import WeightSync
from ._wire_format import ChunkPlan, TensorMeta, pack_chunk, plan_chunks, unpack_chunk, update_info

try:
    __version__ = _version("agrpo-sync")
except _PackageNotFoundError:  # run from a source tree on PYTHONPATH (e.g. the GPU machine), not installed
    __version__ = "0+source"

__all__ = [
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

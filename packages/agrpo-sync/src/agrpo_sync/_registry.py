"""The backend table: every way of pushing weights, by name. Adding a backend is one module and one line here.

Owns the mapping from `WeightSyncConfig.backend` (full weights: `nccl`, `disk`) and from the adapter-only
LoRA path (`lora`) to the `SyncBackend` classes. Does not know when each is chosen (`_weight_sync.py`).
"""

from __future__ import annotations

from ._backend import SyncBackend
from ._disk_backend import DiskBackend
from ._lora_backend import LoraAdapterBackend
from ._nccl_backend import NcclBackend

BACKENDS: dict[str, type[SyncBackend]] = {
    NcclBackend.name: NcclBackend,
    DiskBackend.name: DiskBackend,
    LoraAdapterBackend.name: LoraAdapterBackend,
}

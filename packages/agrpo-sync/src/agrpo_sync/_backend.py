"""`SyncBackend`: what every way of pushing weights to the server implements (one module each, one table).

Owns the protocol between `WeightSync` (which pauses, times, resumes and keeps ranks in lockstep) and a
backend (which moves one version of the weights). Every method here runs on the sending rank only;
the other ranks just drain the same `ParamStream`. Does not know which backends exist: `_registry.py`
holds the table, and adding a backend means adding a module and one line there.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from ._config import WeightSyncConfig
from ._param_stream import ParamStream
from ._server_control import ServerControl, ServerInfo
from ._transport import ChunkTransport


class SyncBackend(Protocol):
    """Pushes one version of the weights to the server; restores the last good one when that fails."""

    name: ClassVar[str]
    """The key in the backend table."""
    pauses: ClassVar[bool]
    """Whether generation is paused while this backend sends (adapter loads need no pause)."""
    view: ClassVar[str]
    """Which tensors it sends: `full` weights (LoRA merged in) or the `adapter` alone."""

    @classmethod
    def from_config(
        cls, config: WeightSyncConfig, control: ServerControl, transport: ChunkTransport | None
    ) -> SyncBackend:
        """Build it (assignments only; nothing talks to the server yet)."""
        ...

    def setup(self, model: torch.nn.Module, stream: ParamStream, info: ServerInfo) -> None:
        """Once, before the first sync: start-up checks and any rendezvous with the server."""
        ...

    def send(self, stream: ParamStream, version: int) -> None:
        """Push `stream` to the server as `version`; raise on any failure."""
        ...

    def recover(self) -> str:
        """After `send` raised: bring the server back to the last good version where possible, and
        say what the server serves now (the sentence ends up in the error the trainer sees)."""
        ...

    def served_model(self, version: int) -> str | None:
        """The `model` name requests for `version` must use; None means the base model's name."""
        ...

    def close(self) -> None:
        """Release what this backend holds on the server and on disk."""
        ...

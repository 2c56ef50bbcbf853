"""`SyncBackend`: what every way of pushing weights to the server implements (one module each, one table).

Owns the protocol between `WeightSync` (which pauses, times, resumes and keeps ranks in lockstep) and a
backend (which moves one version of the weights to the servers it is given, by index into the config's
`base_url`). Every method here runs on the sending rank only; the other ranks just drain the same
`ParamStream`s. Does not know which backends exist: `_registry.py`
holds the table, and adding a backend means adding a module and one line there. Also owns `Recovery`,
what a backend says it left behind after a failed send (and so whether generation may resume).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from ._config import WeightSyncConfig
from ._param_stream import ParamStream
from ._server_control import ServerControl, ServerInfo
from ._transport import ChunkTransport


@dataclass(frozen=True, kw_only=True, slots=True)
class Recovery:
    """What a failed send left on the server, as the backend's `recover` found it."""

    state: str
    """What the server serves now, one clause of the error the trainer sees."""
    consistent: bool = True
    """The server's weights are known to be one whole version (the last good one): generation may resume."""
    resend: bool = False
    """Sending every weight once more, within the same sync, can make the server consistent (it still answers)."""
    fix: str = ""
    """When not consistent: how to get the server back to one version (e.g. sync again, restart it)."""
    resume_as_is: bool = False
    """When not consistent: a bare `POST /resume` serves the weights as they are (mixed but whole tensors).
    False where resuming may crash the engine (e.g. a wrong-shape tensor left by a failed disk reload)."""


class SyncBackend(Protocol):
    """Pushes one version of the weights to the server; restores the last good one when that fails."""

    name: ClassVar[str]
    """The key in the backend table."""
    pauses: ClassVar[bool]
    """Whether generation is paused while this backend sends (adapter loads need no pause)."""
    view: ClassVar[str]
    """Which tensors it sends: `full` weights (LoRA merged in) or the `adapter` alone."""
    fans_out: ClassVar[bool]
    """True: one pass over the weights reaches every server (`send` gets them all); False: one pass per
    server (`send` gets one server each time, and a fresh stream)."""

    @classmethod
    def from_config(
        cls,
        config: WeightSyncConfig,
        controls: list[ServerControl],
        transport: ChunkTransport | Callable[[], ChunkTransport] | None,
    ) -> SyncBackend:
        """Build it for these servers (assignments only; nothing talks to a server yet)."""
        ...

    stages: ClassVar[bool]
    """Whether `stage` consumes the stream before generation pauses (then `send` uses what it wrote)."""

    def setup(self, model: torch.nn.Module, stream: ParamStream, infos: list[ServerInfo]) -> None:
        """Once, before the first sync: start-up checks and any rendezvous with each server."""
        ...

    def stage(self, stream: ParamStream, version: int) -> None:
        """Before generation pauses, when `stages`: prepare `version` without touching the server (the disk
        backend writes its checkpoint). A failure must leave nothing behind; nothing reached the server."""
        ...

    def send(self, stream: ParamStream, version: int, targets: list[int]) -> set[int]:
        """Push `stream` to the `targets` as `version` and label each with it; return the targets that
        stopped answering (`ServerUnreachableError`: left out, the others got it); raise on any other failure."""
        ...

    def rejoin(self, index: int) -> None:
        """Before a server that restarted (or was left out) takes the next `send`: forget what it held (a new
        NCCL rendezvous, the adapter window registered again). Raises `ServerUnreachableError` if it is gone."""
        ...

    def recover(self) -> Recovery:
        """After `send` raised: bring its targets back to the last good version where possible, and say
        what they serve now and whether that is one consistent version (`WeightSync` resumes only then)."""
        ...

    def served_model(self, version: int) -> str | None:
        """The `model` name requests for `version` must use; None means the base model's name."""
        ...

    def close(self) -> None:
        """Release what this backend holds on the server and on disk."""
        ...

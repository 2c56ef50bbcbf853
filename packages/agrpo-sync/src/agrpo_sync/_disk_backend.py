"""`DiskBackend`: full weights as safetensors in a shared directory, reloaded in place by the server.

Owns the version directories (`<weights_dir>/v<version>/`, written by `_checkpoint_dir.py`), the reload
(`POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`), the version
label (`/update_weight_version`), and recovery: after a failed reload the server is reloaded from the
last good directory (at first, the directory the server was started from), on fresh connections: vLLM
closes the connection of a reload it answered 500, and a wrong-shape reload leaves a bad tensor that
only a complete reload replaces (a bare `/resume` then crashes the engine). When no such directory is
known, or that reload fails too, the server's weights are not known to be one version and `recover`
says so (`WeightSync` then keeps generation paused). Only the newest good version directory is kept.
The checkpoint is written by `stage`, before generation pauses, so the pause covers only the reload;
a failed write reaches nothing on the server. Does not know pausing or ranks.

Works wherever both sides see the directory (a CPU server, a shared filesystem across machines). Cost:
the weights go through host memory and the filesystem twice (write, then the server reads), so it is
the slow path; `nccl` is the fast one. vLLM's reload does not clear the prefix cache.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import ClassVar

import torch

from ._backend import Recovery
from ._checkpoint_dir import fresh_directory, write_checkpoint
from ._config import WeightSyncConfig
from ._exceptions import ServerRequestError
from ._param_stream import ParamStream
from ._server_control import ServerControl, ServerInfo
from ._transport import ChunkTransport

logger = logging.getLogger("agrpo_sync")

RELOAD_FIX = (
    "call sync() again (a complete reload resumes generation); if the server refused the reload itself (an "
    "HTTP 500 naming a tensor, e.g. of another shape), it keeps that tensor and fails every later reload: "
    "restart it, since resuming it as it is crashes its engine at the next request"
)


class DiskBackend:
    """Writes safetensors the server reloads in place; keeps the last good directory to fall back to."""

    name: ClassVar[str] = "disk"
    pauses: ClassVar[bool] = True
    view: ClassVar[str] = "full"
    stages: ClassVar[bool] = True

    def __init__(self, *, control: ServerControl, weights_dir: Path) -> None:
        self.control = control
        self.weights_dir = weights_dir
        self.last_good: str | None = None
        """The directory the server last loaded successfully (at first, the one it started from)."""
        self._staged: tuple[int, Path] | None = None
        self._pending: Path | None = None
        self._reload_sent = False

    @classmethod
    def from_config(cls, config: WeightSyncConfig, control: ServerControl, transport: ChunkTransport | None):
        return cls(control=control, weights_dir=config.weights_dir)

    def setup(self, model: torch.nn.Module, stream: ParamStream, info: ServerInfo) -> None:
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.last_good = info.model_root if Path(info.model_root).is_dir() else None
        if self.last_good is None:
            logger.warning(
                "the server's model %r is not a directory this trainer sees: if the first reload fails, the "
                "server cannot be put back on its original weights",
                info.model_root,
            )

    def stage(self, stream: ParamStream, version: int) -> None:
        """Write `version`'s checkpoint (before generation pauses); a failure leaves no directory behind."""
        in_use = {Path(self.last_good)} if self.last_good else set()
        target = fresh_directory(self.weights_dir / f"v{version}", in_use)
        self._staged = None
        write_checkpoint(stream.buckets(), target)
        self._staged = (version, target)

    def send(self, stream: ParamStream, version: int) -> None:
        if self._staged is None or self._staged[0] != version:
            self.stage(stream, version)
        (_, self._pending), self._staged, self._reload_sent = self._staged, None, True
        self.control.reload_weights(str(self._pending))
        self.control.set_weight_version(str(version))
        previous, self.last_good, self._pending = self.last_good, str(self._pending), None
        if previous is not None and Path(previous).parent == self.weights_dir and previous != self.last_good:
            shutil.rmtree(previous, ignore_errors=True)

    def recover(self) -> Recovery:
        """Reload the last good directory, on fresh connections (vLLM closes the connection of a reload it
        answered 500); when that fails too, say so: generation stays paused and no bare resume is offered."""
        pending, self._pending = self._pending or (self._staged and self._staged[1]), None
        self._staged = None
        if pending is not None and str(pending) != self.last_good and pending.parent == self.weights_dir:
            shutil.rmtree(pending, ignore_errors=True)
        if not self._reload_sent:
            return Recovery(state="nothing reached the server: it serves the last good version")
        self._reload_sent = False
        if self.last_good is None:
            return Recovery(
                state="the server may serve partly reloaded weights: no earlier weights directory is known to reload",
                consistent=False,
                fix=RELOAD_FIX,
            )
        self.control.renew_connections()
        try:
            self.control.reload_weights(self.last_good)
        except ServerRequestError as error:
            return Recovery(
                state=f"restoring the last good version failed too (reloading {self.last_good}: {error})",
                consistent=False,
                fix=RELOAD_FIX,
            )
        return Recovery(
            state=f"the server was reloaded from {self.last_good} and serves the last good version"
        )

    def served_model(self, version: int) -> str | None:
        return None

    def close(self) -> None:
        """Keeps the last good directory: the server may reload from it again (e.g. after a restart)."""

"""`DiskBackend`: full weights as safetensors in a shared directory, reloaded in place by the server.

Owns the version directories (`<weights_dir>/v<version>/`, written by `_checkpoint_dir.py`), the reload
(`POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`), the version
label (`/update_weight_version`), and recovery: after a failed reload the server is reloaded from the
last good directory (at first, the directory the server was started from). When no such directory is
known, or that reload fails too, the server's weights are not known to be one version and `recover`
says so (`WeightSync` then keeps generation paused). Only the newest good version directory is kept.
Does not know pausing or ranks.

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
from ._checkpoint_dir import write_checkpoint
from ._config import WeightSyncConfig
from ._param_stream import ParamStream
from ._server_control import ServerControl, ServerInfo
from ._transport import ChunkTransport

logger = logging.getLogger("agrpo_sync")


class DiskBackend:
    """Writes safetensors the server reloads in place; keeps the last good directory to fall back to."""

    name: ClassVar[str] = "disk"
    pauses: ClassVar[bool] = True
    view: ClassVar[str] = "full"

    def __init__(self, *, control: ServerControl, weights_dir: Path) -> None:
        self.control = control
        self.weights_dir = weights_dir
        self.last_good: str | None = None
        """The directory the server last loaded successfully (at first, the one it started from)."""
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

    def send(self, stream: ParamStream, version: int) -> None:
        self._pending, self._reload_sent = self.weights_dir / f"v{version}", False
        write_checkpoint(stream.buckets(), self._pending)
        self._reload_sent = True
        self.control.reload_weights(str(self._pending))
        self.control.set_weight_version(str(version))
        previous, self.last_good, self._pending = self.last_good, str(self._pending), None
        if previous is not None and Path(previous).parent == self.weights_dir and previous != self.last_good:
            shutil.rmtree(previous, ignore_errors=True)

    def recover(self) -> Recovery:
        """Reload the last good directory; a failure of that reload propagates (`WeightSync` reports it)."""
        pending, self._pending = self._pending, None
        if pending is not None and str(pending) != self.last_good:
            shutil.rmtree(pending, ignore_errors=True)
        if not self._reload_sent:
            return Recovery(state="the server was not asked to reload and serves the last good version")
        if self.last_good is None:
            return Recovery(
                state="the server may serve partly reloaded weights: no earlier weights directory is known to reload",
                consistent=False,
                fix="call sync() again (a complete reload resumes generation), or restart the server",
            )
        self.control.reload_weights(self.last_good)
        return Recovery(
            state=f"the server was reloaded from {self.last_good} and serves the last good version"
        )

    def served_model(self, version: int) -> str | None:
        return None

    def close(self) -> None:
        """Keeps the last good directory: the server may reload from it again (e.g. after a restart)."""

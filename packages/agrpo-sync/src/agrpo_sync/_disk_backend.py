"""`DiskBackend`: full weights as safetensors in a shared directory, reloaded in place by every server.

Owns the version directories (`<weights_dir>/v<version>/`, written by `_checkpoint_dir.py`), the reload
(`POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`), the version
label (`/update_weight_version`), and recovery: after a failed reload the servers are reloaded from the
last good directory (at first, the directory the servers were started from), on fresh connections: vLLM
closes the connection of a reload it answered 500, and a wrong-shape reload leaves a bad tensor that
only a complete reload replaces (a bare `/resume` then crashes the engine). When no such directory is
known, or that reload fails too, the servers' weights are not known to be one version and `recover`
says so (`WeightSync` then keeps generation paused). Only the newest good version directory is kept.
The checkpoint is written by `stage`, before generation pauses, so the pause covers only the reload;
a failed write reaches nothing on the server. Does not know pausing or ranks.

Several servers: the checkpoint is written once and every server reloads it, all at once (one thread
each), then each is labelled; a server that stops answering is reported lost and the others keep the new
version; a server that refuses makes the sync fail, and `recover` reloads the last good directory on
every server the reload went to. A restarted server needs nothing to rejoin: a reload replaces every
weight (and the last good directory stays on disk for exactly that).

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
from ._server_roster import each_server

logger = logging.getLogger("agrpo_sync")

RELOAD_FIX = (
    "call sync() again (a complete reload resumes generation); if the server refused the reload itself (an "
    "HTTP 500 naming a tensor, e.g. of another shape), it keeps that tensor and fails every later reload: "
    "restart it, since resuming it as it is crashes its engine at the next request"
)


class DiskBackend:
    """Writes safetensors the servers reload in place; keeps the last good directory to fall back to."""

    name: ClassVar[str] = "disk"
    pauses: ClassVar[bool] = True
    view: ClassVar[str] = "full"
    stages: ClassVar[bool] = True
    fans_out: ClassVar[bool] = True

    def __init__(self, *, controls: list[ServerControl], weights_dir: Path) -> None:
        self.controls = controls
        self.weights_dir = weights_dir
        self.last_good: str | None = None
        """The directory the servers last loaded successfully (at first, the one they started from)."""
        self._staged: tuple[int, Path] | None = None
        self._pending: Path | None = None
        self._reloaded: list[int] = []
        """The servers the last send's reload went to (`recover` reloads the last good directory there)."""

    @property
    def control(self) -> ServerControl:
        """The first server's control."""
        return self.controls[0]

    @property
    def staged_dir(self) -> str | None:
        """The complete directory of the version being sent (the sync journal's way back to one version)."""
        pending = self._pending or (self._staged and self._staged[1])
        return str(pending) if pending else None

    @classmethod
    def from_config(cls, config: WeightSyncConfig, controls: list[ServerControl], transport):
        return cls(controls=controls, weights_dir=config.weights_dir)

    def setup(self, model: torch.nn.Module, stream: ParamStream, infos: list[ServerInfo]) -> None:
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        root = infos[0].model_root
        self.last_good = root if Path(root).is_dir() else None
        if self.last_good is None:
            logger.warning(
                "the server's model %r is not a directory this trainer sees: if the first reload fails, the "
                "server cannot be put back on its original weights",
                root,
            )

    def stage(self, stream: ParamStream, version: int) -> None:
        """Write `version`'s checkpoint (before generation pauses); a failure leaves no directory behind."""
        in_use = {Path(self.last_good)} if self.last_good else set()
        target = fresh_directory(self.weights_dir / f"v{version}", in_use)
        self._staged = None
        write_checkpoint(stream.buckets(), target)
        self._staged = (version, target)

    def send(self, stream: ParamStream, version: int, targets: list[int]) -> set[int]:
        """Every target reloads the staged directory (at once), then each is labelled `version`."""
        if self._staged is None or self._staged[0] != version:
            self.stage(stream, version)
        self._reloaded = []
        (_, self._pending), self._staged = self._staged, None
        self._reloaded = list(targets)
        path = str(self._pending)
        lost = each_server(lambda i: self.controls[i].reload_weights(path), targets)
        lost |= each_server(lambda i: self.controls[i].set_weight_version(str(version)), set(targets) - lost)
        previous, self.last_good, self._pending = self.last_good, path, None
        if previous is not None and Path(previous).parent == self.weights_dir and previous != self.last_good:
            shutil.rmtree(previous, ignore_errors=True)
        return lost

    def rejoin(self, index: int) -> None:
        """Nothing to prepare: the next reload replaces every weight of a restarted server."""

    def recover(self) -> Recovery:
        """Reload the last good directory on the servers the reload went to, on fresh connections (vLLM closes
        the connection of a reload it answered 500); when that fails too, say so: generation stays paused and
        no bare resume is offered."""
        pending, self._pending = self._pending or (self._staged and self._staged[1]), None
        self._staged = None
        if pending is not None and str(pending) != self.last_good and pending.parent == self.weights_dir:
            shutil.rmtree(pending, ignore_errors=True)
        reloaded, self._reloaded = self._reloaded, []
        if not reloaded:
            return Recovery(state="nothing reached the server: it serves the last good version")
        if self.last_good is None:
            return Recovery(
                state="the server may serve partly reloaded weights: no earlier weights directory is known to reload",
                consistent=False,
                fix=RELOAD_FIX,
            )
        for index in reloaded:
            self.controls[index].renew_connections()
        try:
            each_server(lambda i: self.controls[i].reload_weights(self.last_good), reloaded)
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
        """Keeps the last good directory: a server may reload from it again (e.g. after a restart)."""

"""`LoraAdapterBackend`: pushes only the LoRA adapter; the server keeps a window of adapter versions.

Owns the adapter versions: version v is written (PEFT layout: `adapter_model.safetensors` plus
`adapter_config.json`) to `<output_dir>/.vllm_lora/<lora_name>-v<v>/` and registered under that name
with `/v1/load_lora_adapter`. The next version is loaded before the oldest is unloaded, so in-flight
requests always find their adapter: `max_staleness + 1` versions stay registered, one more for a
moment, hence `--max-loras >= max_staleness + 2`. Versions leaving the window are unloaded and their
directories deleted (only ever inside `<output_dir>/.vllm_lora/`). A registered adapter's directory is
never rewritten: re-pushing a version that is still registered (the same version twice, or a restarted
trainer) writes `<lora_name>-v<v>.1/` (`.2`, ...) and loads it in place (`load_inplace`), then deletes
the old directory. At start-up the versions of `lora_name` already registered (a previous trainer's)
are taken over: they join the window and leave it as new versions arrive. The start-up checks that
print the exact server flags to restart with are in `_lora_limits.py`. Does not know how the adapter
tensors are gathered (`_lora_weights.py`, `_param_stream.py`).

Several servers: each version is written once and loaded on every server at once (one thread each); the
window is one list of versions (`live`), and each server's own registrations are kept apart
(`registered`), so a version leaves the window by being unloaded wherever it is registered. A server
that restarted holds no adapter: `rejoin` reads what it has and loads every version of the window it
lacks, so the groups already dispatched at older versions find theirs on any server. After each load the
server is labelled with the version (`/update_weight_version`, where dev mode serves it), which is how a
restart shows (`ServerRoster`).

Adapters are written in the dtype the server serves (`ServerInfo.dtype`, which vLLM's default
`lora_dtype="auto"` casts every adapter to on load) unless `transfer_dtype` names one: PEFT keeps adapters
in float32, and a bfloat16 server would otherwise read twice the bytes and cast them itself (one H200, r=32
on a 4B model, a receiver that loads like vLLM: 337 ms median per sync with float32 files, 164 ms with
bfloat16 ones; docs/benchmarks.md).
Where a sync's time goes is kept in `last_send` (`AdapterSendTimes`: gather and host copy, file write,
the server's load, the unload of the version leaving the window). GPU tensors reach the file through
pinned host buffers reserved at start-up and reused by every version (`HostStaging`).

No pause: loading a new adapter does not touch requests running under older ones. The directory must
be on a filesystem the server can read. vLLM serves LoRA at roughly 1.3-1.4x the per-token time of
merged weights; the sync itself moves about 1% of the bytes of a full sync.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from ._backend import Recovery
from ._checkpoint_dir import HostStaging, fresh_directory, write_checkpoint
from ._config import WeightSyncConfig
from ._exceptions import ServerRequestError, ServerUnreachableError, WeightSyncError
from ._lora_limits import check_adapter_server, lora_config_of
from ._param_stream import ParamStream
from ._server_control import ServerControl, ServerInfo
from ._server_roster import each_server

logger = logging.getLogger("agrpo_sync")
_NOT_FOUND = re.compile(r"(not|cannot be) found", re.IGNORECASE)
"""How a server that answers 400 to unloading an adapter it does not hold says so."""


def adapter_name(lora_name: str, version: int) -> str:
    """The server-side name of adapter version `version`; requests select it with `model=<name>`."""
    return f"{lora_name}-v{version}"


@dataclass(frozen=True, kw_only=True, slots=True)
class AdapterSendTimes:
    """Wall-clock parts of one adapter send, in seconds."""

    copy_s: float
    """Gathering the adapter tensors (FSDP2 all-gathers, the transfer-dtype cast) and copying them to the host."""
    write_s: float
    """Writing `adapter_model.safetensors` and `adapter_config.json` and publishing the directory."""
    load_s: float
    """`/v1/load_lora_adapter`: the servers reading and registering the files (all at once)."""
    retire_s: float
    """Unloading the versions that left the window and deleting their directories."""


class LoraAdapterBackend:
    """Writes and registers adapter versions, keeping `max_staleness + 1` of them on every server."""

    name: ClassVar[str] = "lora"
    pauses: ClassVar[bool] = False
    view: ClassVar[str] = "adapter"
    stages: ClassVar[bool] = False
    fans_out: ClassVar[bool] = True

    def __init__(
        self,
        *,
        controls: list[ServerControl],
        lora_dir: Path,
        lora_name: str,
        max_staleness: int,
        transfer_dtype: str = "",
    ) -> None:
        self.controls = controls
        self.transfer_dtype = transfer_dtype
        """The config's `transfer_dtype`; empty: adapters are written in the server's dtype."""
        self.file_dtype: torch.dtype | None = None
        """The dtype adapter files are written in when `transfer_dtype` is empty: the server's (`setup`).
        The cast happens on the device before the host copy; the stream's metadata (and so `num_bytes`
        of the sync's timings) still shows the parameters' dtype."""
        self.lora_dir = lora_dir
        self.lora_name = lora_name
        self.max_staleness = max_staleness
        self.live: list[int] = []
        """Versions in the window, oldest first."""
        self.dirs: dict[int, Path] = {}
        """The directory each version of the window was loaded from (never rewritten while registered)."""
        self.registered: list[set[int]] = [set() for _ in controls]
        """The versions each server has registered."""
        self._peft_config = None
        self._pending: Path | None = None
        self._touched: list[tuple[int, int, bool]] = []
        """(server, version, in place) of each load of the send under way, for `recover`."""
        self._staging = HostStaging()
        self.last_send: AdapterSendTimes | None = None
        """Where the last successful send's time went."""

    @property
    def control(self) -> ServerControl:
        """The first server's control."""
        return self.controls[0]

    @classmethod
    def from_config(cls, config: WeightSyncConfig, controls: list[ServerControl], transport):
        return cls(
            controls=controls,
            lora_dir=config.lora_dir,
            lora_name=config.lora_name,
            max_staleness=config.max_staleness,
            transfer_dtype=config.transfer_dtype,
        )

    def setup(self, model: torch.nn.Module, stream: ParamStream, infos: list[ServerInfo]) -> None:
        self._peft_config = lora_config_of(model)
        for info in infos:
            check_adapter_server(info, self._peft_config, self.max_staleness)
        self.lora_dir.mkdir(parents=True, exist_ok=True)
        served = getattr(torch, infos[0].dtype, None) if infos[0].dtype else None
        if not self.transfer_dtype and isinstance(served, torch.dtype) and served.is_floating_point:
            self.file_dtype = served
        if any(source.is_cuda for entry in stream.entries for source in entry.sources):
            self._staging.reserve(stream.metadata(), self.file_dtype)
        for index in range(len(self.controls)):  # a restarted trainer's predecessor's versions are adopted
            found = self._registered_on(index)
            self.registered[index] = set(found)
            for version, directory in found.items():
                self.dirs.setdefault(version, directory)
        self.live = sorted(self.dirs)
        if self.live:
            logger.warning(
                "adapters %s were already registered on the server (an earlier trainer's); taking them over: "
                "they leave the window as new versions arrive, and re-pushed versions are loaded in place",
                [adapter_name(self.lora_name, v) for v in self.live],
            )

    def _registered_on(self, index: int) -> dict[int, Path]:
        """The versions of `lora_name` server `index` has registered, with the directory each came from."""
        pattern = re.compile(re.escape(self.lora_name) + r"-v(\d+)")
        found = {}
        for model in self.controls[index].models():
            match = pattern.fullmatch(str(model["id"]))
            if model.get("parent") and match:
                found[int(match.group(1))] = Path(str(model.get("root") or ""))
        return found

    def stage(self, stream: ParamStream, version: int) -> None:
        """Nothing to write ahead: adapter loads need no pause."""

    def path(self, version: int) -> Path:
        return self.lora_dir / adapter_name(self.lora_name, version)

    def send(self, stream: ParamStream, version: int, targets: list[int]) -> set[int]:
        """Write `version` to a directory no registered adapter uses, and load it on every target (in place
        where that version is registered, e.g. pushed twice or by a restarted trainer)."""
        started = time.perf_counter()
        self._pending = fresh_directory(self.path(version), set(self.dirs.values()))
        tensors = self._staging.copy(
            (pair for bucket in stream.buckets() for pair in bucket), self.file_dtype
        )
        copied = time.perf_counter()
        write_checkpoint(
            iter([list(tensors.items())]),
            self._pending,
            single_file="adapter_model.safetensors",
            extra_files=self._write_config,
        )
        written = time.perf_counter()
        self._touched = []
        lost = each_server(lambda i: self._load(i, version, self._pending), targets)
        lost |= each_server(lambda i: self._label(i, version), set(targets) - lost)
        loaded = time.perf_counter()
        previous, self.dirs[version], self._pending = self.dirs.get(version), self._pending, None
        if previous is not None:
            self._remove(previous)
        self._shrink_window(version)
        self.last_send = AdapterSendTimes(
            copy_s=copied - started,
            write_s=written - copied,
            load_s=loaded - written,
            retire_s=time.perf_counter() - loaded,
        )
        return lost

    def _load(self, index: int, version: int, directory: Path) -> None:
        inplace = version in self.registered[index]
        self.controls[index].load_lora_adapter(
            adapter_name(self.lora_name, version), str(directory), inplace=inplace
        )
        self.registered[index].add(version)
        self._touched.append((index, version, inplace))

    def _label(self, index: int, version: int) -> None:
        """Label the server with the version (how a restart shows); a server without dev mode has no label."""
        try:
            self.controls[index].set_weight_version(str(version))
        except ServerUnreachableError:
            raise
        except ServerRequestError as error:
            if error.status != 404:
                raise

    def rejoin(self, index: int) -> None:
        """Register on server `index` every version of the window it lacks (a restarted server has none),
        and unload those of its own that left the window."""
        have = set(self.registered[index])
        self.registered[index] = set(self._registered_on(index))
        if self.registered[index] != have:
            logger.warning(
                "vLLM server %s has adapters %s registered where this trainer loaded %s: it restarted; "
                "loading the window %s again", self.controls[index].base_url,
                sorted(self.registered[index]), sorted(have), self.live,
            )  # fmt: skip
        for version in self.live:
            if version not in self.registered[index]:
                self._load(index, version, self.dirs[version])
        for version in sorted(self.registered[index] - set(self.live)):
            self._unload(index, adapter_name(self.lora_name, version))
            self.registered[index].discard(version)

    def _shrink_window(self, version: int) -> None:
        """Retire versions until `max_staleness + 1` stay in the window (an earlier run's newer ones first)."""
        self.live = sorted(self.dirs)
        for old in [v for v in self.live if v > version] + self.live:
            if len(self.live) <= self.max_staleness + 1:
                break
            if old == version or old not in self.live:
                continue
            if not self._retire(old):
                break
            self.live.remove(old)

    def _write_config(self, directory: Path) -> None:
        self._peft_config.save_pretrained(str(directory))

    def _retire(self, version: int) -> bool:
        """Unload a version wherever it is registered and delete its directory; on a failure warn and retry
        at the next sync (a server that no longer answers forgets it anyway)."""
        name = adapter_name(self.lora_name, version)
        holders = [i for i, versions in enumerate(self.registered) if version in versions]
        try:
            each_server(lambda i: self._unload(i, name), holders)
        except ServerRequestError as error:
            logger.warning("could not unload %s (retried at the next sync): %s", name, error)
            return False
        for versions in self.registered:
            versions.discard(version)
        self._remove(self.dirs.pop(version, self.path(version)))
        return True

    def _unload(self, index: int, name: str) -> None:
        """Unload adapter `name` from server `index`; one the server does not hold counts as unloaded: a
        restarted trainer that took the window over may have unloaded it already (vLLM 0.32 answers 404
        "The lora adapter '<name>' cannot be found."; a 400 saying so counts too)."""
        try:
            self.controls[index].unload_lora_adapter(name)
        except ServerUnreachableError:
            raise
        except ServerRequestError as error:
            gone = error.status == 404 or (
                error.status == 400 and _NOT_FOUND.search(error.detail) is not None
            )
            if not gone:
                raise
            logger.info(
                "%s was no longer registered on %s: already unloaded", name, self.controls[index].base_url
            )

    def _remove(self, directory: Path) -> None:
        """Delete an adapter directory, only ever one inside `lora_dir`."""
        if directory.resolve().parent != self.lora_dir.resolve():
            logger.warning("not deleting %s: it is outside %s", directory, self.lora_dir)
            return
        shutil.rmtree(directory, ignore_errors=True)

    def recover(self) -> Recovery:
        """A failed load leaves the registered versions as they were, each one whole: always consistent. A
        version the failed send loaded on some servers only is taken back there (unloaded, or reloaded in
        place from its previous directory)."""
        pending, self._pending = self._pending, None
        touched, self._touched = self._touched, []
        if pending is not None and pending not in self.dirs.values():
            for index, version, inplace in touched:
                name = adapter_name(self.lora_name, version)
                try:
                    if inplace:
                        self.controls[index].load_lora_adapter(name, str(self.dirs[version]), inplace=True)
                    else:
                        self._unload(index, name)
                        self.registered[index].discard(version)
                except ServerRequestError as error:
                    logger.warning(
                        "could not take %s back on %s: %s", name, self.controls[index].base_url, error
                    )
            self._remove(pending)
        if not self.live:
            return Recovery(state="no adapter version is registered; the server serves the base model")
        names = [adapter_name(self.lora_name, v) for v in self.live]
        return Recovery(
            state=f"the new adapter was not registered; {names} still serve, the last good version is {names[-1]}"
        )

    def served_model(self, version: int) -> str | None:
        if version in self.live:
            return adapter_name(self.lora_name, version)
        if self.live and version < self.live[0]:
            raise ValueError(
                f"adapter version {version} left the window {self.live}; its requests cannot be served"
            )
        return None

    def close(self) -> None:
        """Unload every version this backend registered, on every server, and delete its directory.
        Idempotent: a second call finds nothing left, and versions another backend (a restarted trainer
        that took the window over) already unloaded or deleted count as done."""
        while self.live and self._retire(self.live[0]):
            self.live.pop(0)
        if self.live:
            names = [adapter_name(self.lora_name, v) for v in self.live]
            raise WeightSyncError(
                f"could not unload adapters {names}; unload them with /v1/unload_lora_adapter"
            )

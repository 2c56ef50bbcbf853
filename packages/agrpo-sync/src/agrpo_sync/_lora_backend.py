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
are taken over: they join the window and leave it as new versions arrive. Also owns the start-up
checks that print the exact server flags to restart with.
Does not know how the adapter tensors are gathered (`_lora_weights.py`, `_param_stream.py`).

No pause: loading a new adapter does not touch requests running under older ones. The directory must
be on a filesystem the server can read. vLLM serves LoRA at roughly 1.3-1.4x the per-token time of
merged weights; the sync itself moves about 1% of the bytes of a full sync.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import ClassVar

import torch

from ._backend import Recovery
from ._checkpoint_dir import fresh_directory, write_checkpoint
from ._config import WeightSyncConfig
from ._exceptions import ServerRequestError, SyncSetupError, WeightSyncError
from ._param_stream import ParamStream
from ._server_control import ServerControl, ServerInfo
from ._transport import ChunkTransport

logger = logging.getLogger("agrpo_sync")

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's `--max-lora-rank` accepts (0.32 and 0.33)."""


def adapter_name(lora_name: str, version: int) -> str:
    """The server-side name of adapter version `version`; requests select it with `model=<name>`."""
    return f"{lora_name}-v{version}"


def lora_config_of(model: torch.nn.Module):
    """The active adapter's `LoraConfig` (from a PEFT model's `peft_config`)."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        raise SyncSetupError(
            "adapter sync needs a PEFT model (peft.get_peft_model); this model has no peft_config"
        )
    active = getattr(model, "active_adapter", None) or next(iter(configs))
    return configs[active if isinstance(active, str) else active[0]]


def adapter_rank(config) -> int:
    return max([int(config.r), *(int(r) for r in (getattr(config, "rank_pattern", None) or {}).values())])


def adapter_problems(info: ServerInfo, config, max_staleness: int) -> list[str]:
    """Why the server cannot serve this adapter with `max_staleness + 1` live versions (empty: it can)."""
    problems = []
    if getattr(config, "use_dora", False):
        problems.append("the adapter uses DoRA, which vLLM does not serve")
    if getattr(config, "modules_to_save", None):
        problems.append(
            f"the adapter has modules_to_save={config.modules_to_save}, which vLLM does not serve"
        )
    if not info.lora_enabled:
        problems.append("the server runs without --enable-lora")
    else:
        if info.max_lora_rank < adapter_rank(config):
            problems.append(
                f"--max-lora-rank is {info.max_lora_rank}, below the adapter's rank {adapter_rank(config)}"
            )
        if info.max_loras < max_staleness + 2:
            problems.append(
                f"--max-loras is {info.max_loras}, below max_staleness + 2 = {max_staleness + 2} "
                f"({max_staleness + 1} live versions plus the next one, loaded before the oldest is unloaded)"
            )
    if not info.runtime_lora_updating:
        problems.append(
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING is not set, so /v1/load_lora_adapter does not exist"
        )
    if info.data_parallel_size > 1:
        problems.append(
            f"the server is data-parallel (DP={info.data_parallel_size}); adapter loads reach one replica"
        )
    return problems


def restart_command(config, max_staleness: int) -> str:
    """The server command line that serves this adapter with the window `max_staleness` needs."""
    rank = adapter_rank(config)
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise SyncSetupError(
            f"adapter rank {rank} > 512, the largest vLLM serves; lower r or use lora_sync='merged'"
        )
    return (
        "VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve <model> "
        f"--enable-lora --max-lora-rank {fitting[0]} --max-loras {max_staleness + 2}"
    )


def check_adapter_server(info: ServerInfo, config, max_staleness: int) -> None:
    """Raise `SyncSetupError` listing every problem and the exact flags to restart the server with."""
    problems = adapter_problems(info, config, max_staleness)
    if problems:
        raise SyncSetupError(
            "the server cannot take adapter-only sync: "
            + "; ".join(problems)
            + f". Restart it as: {restart_command(config, max_staleness)} (or set lora_sync='merged')"
        )


class LoraAdapterBackend:
    """Writes and registers adapter versions, keeping `max_staleness + 1` of them on the server."""

    name: ClassVar[str] = "lora"
    pauses: ClassVar[bool] = False
    view: ClassVar[str] = "adapter"
    stages: ClassVar[bool] = False

    def __init__(self, *, control: ServerControl, lora_dir: Path, lora_name: str, max_staleness: int) -> None:
        self.control = control
        self.lora_dir = lora_dir
        self.lora_name = lora_name
        self.max_staleness = max_staleness
        self.live: list[int] = []
        """Versions registered on the server, oldest first."""
        self.dirs: dict[int, Path] = {}
        """The directory each registered version was loaded from (never rewritten while registered)."""
        self._peft_config = None
        self._pending: Path | None = None

    @classmethod
    def from_config(cls, config: WeightSyncConfig, control: ServerControl, transport: ChunkTransport | None):
        return cls(
            control=control,
            lora_dir=config.lora_dir,
            lora_name=config.lora_name,
            max_staleness=config.max_staleness,
        )

    def setup(self, model: torch.nn.Module, stream: ParamStream, info: ServerInfo) -> None:
        self._peft_config = lora_config_of(model)
        check_adapter_server(info, self._peft_config, self.max_staleness)
        self.lora_dir.mkdir(parents=True, exist_ok=True)
        self._take_over()

    def _take_over(self) -> None:
        """Adopt the versions of `lora_name` already registered (a restarted trainer's predecessor): they
        join the window, age out of it like this trainer's own, and a re-push of one loads in place."""
        pattern = re.compile(re.escape(self.lora_name) + r"-v(\d+)")
        for model in self.control.models():
            found = pattern.fullmatch(str(model["id"]))
            if model.get("parent") and found:
                self.dirs[int(found.group(1))] = Path(str(model.get("root") or ""))
        self.live = sorted(self.dirs)
        if self.live:
            logger.warning(
                "adapters %s were already registered on the server (an earlier trainer's); taking them over: "
                "they leave the window as new versions arrive, and re-pushed versions are loaded in place",
                [adapter_name(self.lora_name, v) for v in self.live],
            )

    def stage(self, stream: ParamStream, version: int) -> None:
        """Nothing to write ahead: adapter loads need no pause."""

    def path(self, version: int) -> Path:
        return self.lora_dir / adapter_name(self.lora_name, version)

    def send(self, stream: ParamStream, version: int) -> None:
        """Write `version` to a directory no registered adapter uses, and load it (in place when that
        version is still registered, e.g. pushed twice or by a restarted trainer)."""
        inplace = version in self.dirs
        self._pending = fresh_directory(self.path(version), set(self.dirs.values()))
        write_checkpoint(
            stream.buckets(),
            self._pending,
            single_file="adapter_model.safetensors",
            extra_files=self._write_config,
        )
        self.control.load_lora_adapter(
            adapter_name(self.lora_name, version), str(self._pending), inplace=inplace
        )
        previous, self.dirs[version], self._pending = self.dirs.get(version), self._pending, None
        if previous is not None:
            self._remove(previous)
        self.live = sorted(self.dirs)
        for old in [v for v in self.live if v > version] + self.live:  # an earlier run's newer versions first
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
        """Unload a version and delete its directory; on failure warn and retry at the next sync."""
        try:
            self.control.unload_lora_adapter(adapter_name(self.lora_name, version))
        except ServerRequestError as error:
            logger.warning(
                "could not unload %s (retried at the next sync): %s",
                adapter_name(self.lora_name, version),
                error,
            )
            return False
        self._remove(self.dirs.pop(version, self.path(version)))
        return True

    def _remove(self, directory: Path) -> None:
        """Delete an adapter directory, only ever one inside `lora_dir`."""
        if directory.resolve().parent != self.lora_dir.resolve():
            logger.warning("not deleting %s: it is outside %s", directory, self.lora_dir)
            return
        shutil.rmtree(directory, ignore_errors=True)

    def recover(self) -> Recovery:
        """A failed load leaves the registered versions as they were, each one whole: always consistent."""
        pending, self._pending = self._pending, None
        if pending is not None and pending not in self.dirs.values():
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
        """Unload every version this backend registered and delete its directory."""
        while self.live and self._retire(self.live[0]):
            self.live.pop(0)
        if self.live:
            names = [adapter_name(self.lora_name, v) for v in self.live]
            raise WeightSyncError(
                f"could not unload adapters {names}; unload them with /v1/unload_lora_adapter"
            )

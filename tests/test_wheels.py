"""The five packages as users get them: built by `uv build` into a wheel and an sdist each, installed into a
fresh virtual environment outside the workspace, and every README example run from there.

The wheels are built once per session (`uv build --all-packages`, about 10 s) and installed once, not
editable, with `uv pip` into a venv in a temporary directory (about 30 s from uv's cache). The install takes
the workspace lock's versions as constraints (what the rest of the suite tests) and the CPU torch wheel
from the machine's wheel folder (`PIP_FIND_LINKS`, as pip would); nothing else of the workspace is
visible: examples run from a temporary directory with `PYTHONPATH` unset, and the test checks that every
`agrpo_*` module comes from the venv. Examples that start a `VLLMServer` attach to the session's
`training_server` through `AGRPO_VLLM_URL`, so the file costs no extra server start-up: about 3 minutes
on 2 cores, most of it the trainer's example (three optimizer steps) and the imports of torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["agrpo-rollout", "agrpo-packing", "agrpo-attention", "agrpo-sync", "agrpo-trainer"]
EXAMPLE_TIMEOUT_S = 600

# What each README promises its example prints (the workspace's test_readme.py files check the same).
PRINTS = {
    "agrpo-rollout": r"^[1-9]\d* dict_keys\(\[.*'input_ids'.*'advantages'",
    "agrpo-packing": r"packing ratio [0-9.]+\nrank 0: .*\nrank 1: ",
    "agrpo-attention": r"^reference\n.*\(\[\d+, 4\]\)",
    "agrpo-sync": r"^1 \{.*'perf/weight_sync_s'.*\n2 \{.*'perf/weight_sync_s'",
    "agrpo-trainer": r"^1 [^\n]*\n2 [^\n]*\n3 [^\n]*\s*\Z",
}


def _version(package: str) -> str:
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]["version"]


def _dist_name(package: str) -> str:
    return package.replace("-", "_")


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, argv))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="session")
def uv() -> str:
    found = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    assert Path(found).exists(), "the wheel tests need uv (`python3 -m pip install uv`)"
    return found


@pytest.fixture(scope="session")
def dists(uv, tmp_path_factory) -> Path:
    """A folder with one wheel and one sdist per package, built from the working tree."""
    out = tmp_path_factory.mktemp("dist")
    _run([uv, "build", "--all-packages", "--out-dir", str(out), "--quiet"], cwd=ROOT)
    return out


def _constraints(uv: str, folder: Path) -> Path:
    """The workspace lock's versions as a constraints file; torch by version, its wheel found by find-links."""
    exported = _run(
        [uv, "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--no-dev", "--all-packages"], cwd=ROOT
    ).stdout
    lines = []
    for line in exported.splitlines():
        local = re.match(r"file://\S*/torch-([^-]+)-", line)
        if local:
            lines.append(f"torch=={local.group(1)}")
        elif line and not line.startswith(("#", " ", "file:")):
            lines.append(line)
    path = folder / "constraints.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass(frozen=True, slots=True)
class WheelEnv:
    """A fresh venv with the five wheels installed, and a directory outside the workspace to run in."""

    python: Path
    workdir: Path

    def environ(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env["PATH"] = f"{self.python.parent}{os.pathsep}{env.get('PATH', '')}"
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)
        return env


@pytest.fixture(scope="session")
def wheel_env(uv, dists, tmp_path_factory) -> WheelEnv:
    folder = tmp_path_factory.mktemp("wheel-env")
    venv = folder / "venv"
    _run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], cwd=folder)
    find_links = [
        arg for d in os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split() for arg in ("--find-links", d)
    ]
    wheels = sorted(str(w) for w in dists.glob("*.whl"))
    _run(
        [uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
         "-c", str(_constraints(uv, folder)), *find_links, *wheels],
        cwd=folder,
    )  # fmt: skip
    workdir = folder / "run"
    workdir.mkdir()
    return WheelEnv(python=venv / "bin" / "python", workdir=workdir)


@pytest.mark.parametrize("package", PACKAGES)
def test_package_builds_a_wheel_and_an_sdist_with_its_own_version(dists, package):
    name, version = _dist_name(package), _version(package)
    wheel = dists / f"{name}-{version}-py3-none-any.whl"
    sdist = dists / f"{name}-{version}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in dists.iterdir())
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(f"{name}-{version}.dist-info/METADATA").decode()
    assert {n.split("/")[0] for n in names} == {name, f"{name}-{version}.dist-info"}, "only the package ships"
    assert f"\nVersion: {version}\n" in metadata
    requirements = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    local = [r for r in requirements if "@" in r or "file:" in r or "/" in r]
    assert not local, f"{package} depends on a path or URL: {local}"
    with tarfile.open(sdist) as archive:
        members = {m.name.split("/", 1)[1] for m in archive.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "README.md", f"src/{name}/__init__.py"} <= members


def test_the_venv_imports_every_package_from_its_wheel_not_the_workspace(wheel_env):
    probe = (
        "import json, sys, agrpo_rollout, agrpo_packing, agrpo_attention, agrpo_sync, agrpo_trainer\n"
        "import agrpo_rollout.testing, agrpo_attention.testing, agrpo_packing.testing\n"
        "mods = [agrpo_rollout, agrpo_packing, agrpo_attention, agrpo_sync, agrpo_trainer]\n"
        "print(json.dumps({'files': {m.__name__: m.__file__ for m in mods},"
        " 'versions': {m.__name__: m.__version__ for m in mods}, 'path': sys.path}))\n"
    )
    done = _run([str(wheel_env.python), "-c", probe], cwd=wheel_env.workdir, env=wheel_env.environ())
    seen = json.loads(done.stdout)
    site = wheel_env.python.parents[1]
    for module, file in seen["files"].items():
        assert Path(file).is_relative_to(site), f"{module} imported from {file}, not the venv {site}"
        assert seen["versions"][module] == _version(module.replace("_", "-"))
    assert not [p for p in seen["path"] if p and Path(p).resolve().is_relative_to(ROOT)], seen["path"]
    cli = _run(["agrpo-rollout", "eval", "--help"], cwd=wheel_env.workdir, env=wheel_env.environ())
    assert "--base-url" in cli.stdout


def _example(package: str) -> str:
    """The block `conftest.readme_example` runs: the first Python block under `## Example`."""
    readme = (ROOT / "packages" / package / "README.md").read_text()
    return re.search(r"## Example.*?```python\n(.*?)```", readme, re.DOTALL).group(1)


@pytest.mark.parametrize("package", PACKAGES)
def test_readme_example_runs_from_the_installed_wheels(wheel_env, package, request):
    code = _example(package)
    extra = {}
    if "VLLMServer(" in code:  # one shared server for the examples: AGRPO_VLLM_URL
        extra["AGRPO_VLLM_URL"] = request.getfixturevalue("training_server").url
    script = wheel_env.workdir / f"example_{_dist_name(package)}.py"
    script.write_text(code)
    done = subprocess.run(
        [str(wheel_env.python), script.name], cwd=wheel_env.workdir, env=wheel_env.environ(**extra),
        capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, f"{package}'s README example failed from the wheels:\n{done.stderr[-4000:]}"
    assert re.search(PRINTS[package], done.stdout, re.MULTILINE), done.stdout[-3000:]

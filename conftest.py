"""Session fixtures shared by every test in the workspace: tiny offline models and one real vLLM server.

The server is started once per test session (start-up takes 25-90 s on 2 cores) and every test that
needs a generation server uses it. Tests that change the server's weights or adapters restore them
before they return, so test order never matters. `readme_example` runs a package README's example
the way a reader would, so every README's example is also a test; an example that starts a `VLLMServer`
attaches to the session's `training_server` instead (`AGRPO_VLLM_URL`), a start-up saved per example.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from agrpo_attention.testing import TinyModelSpec, build_tokenizer, save_tiny_model
from agrpo_rollout.testing import ATTACH_URL_ENV, VLLMServer


def pytest_configure(config) -> None:
    """Every test starts the servers it needs: an `AGRPO_VLLM_URL` left in the shell must not redirect them
    (`readme_example` and the wheel test set it themselves, for the examples only)."""
    os.environ.pop(ATTACH_URL_ENV, None)


@dataclass(frozen=True, slots=True)
class ReadmeRun:
    """What running a README's example left behind: its printed lines and its global names."""

    stdout: str
    names: dict


def readme_example_code(readme: Path) -> str:
    """The first Python block under the README's `## Example` heading."""
    return re.search(r"## Example.*?```python\n(.*?)```", readme.read_text(), re.DOTALL).group(1)


def run_readme_example(readme: Path) -> ReadmeRun:
    """Run the first Python block under the README's `## Example` heading, as a reader would paste it."""
    code = readme_example_code(readme)
    names: dict = {"__name__": "readme"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(readme), "exec"), names)
    return ReadmeRun(stdout=out.getvalue(), names=names)


@pytest.fixture
def readme_example(request, monkeypatch) -> ReadmeRun:
    """The example of the README of the package whose test asks for it; one that starts a `VLLMServer`
    gets the session's `training_server` (its models are tiny untied Qwen3s of the same shape)."""
    readme = Path(request.path).resolve().parents[1] / "README.md"
    if "VLLMServer(" in readme_example_code(readme):
        monkeypatch.setenv(ATTACH_URL_ENV, request.getfixturevalue("training_server").url)
    return run_readme_example(readme)


SERVER_MAX_LORAS = 4
SERVER_MAX_LORA_RANK = 8


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """A tiny dense Qwen3-style model with the tool-calling chat template."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), TinyModelSpec(kind="qwen3"))


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory) -> Path:
    """A tiny Gated DeltaNet hybrid (transformers' qwen3_5 text model): 3 linear-attention layers, 1 full."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-hybrid"), TinyModelSpec(kind="hybrid", num_layers=4))


@pytest.fixture(scope="session")
def tool_tokenizer():
    """The tool-calling tokenizer of `tiny_qwen3_dir` (same vocabulary, built in memory)."""
    return build_tokenizer(template="tools")


@pytest.fixture(scope="session")
def rewrite_tokenizer():
    """Same vocabulary as `tool_tokenizer`; its template strips <think> from earlier assistant turns."""
    return build_tokenizer(template="history_rewrite")


@pytest.fixture(scope="session")
def vllm_server(tiny_qwen3_dir):
    """One real CPU vLLM server for the whole session, serving `tiny_qwen3_dir` with runtime LoRA on."""
    server = VLLMServer(
        model_dir=tiny_qwen3_dir,
        attach_url=None,  # always its own server: the LoRA flags below
        extra_args=[
            "--enable-lora",
            "--max-lora-rank", str(SERVER_MAX_LORA_RANK),
            "--max-loras", str(SERVER_MAX_LORAS),
        ],
    )  # fmt: skip
    with server:
        yield server


@pytest.fixture(scope="session")
def untied_qwen3_dir(tmp_path_factory) -> Path:
    """A tiny dense Qwen3-style model whose LM head has its own weights: training reaches every parameter of a
    CPU server (vLLM's CPU backend never refreshes a tied head on reload)."""
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3-untied"), TinyModelSpec(kind="qwen3", tie_word_embeddings=False)
    )


@pytest.fixture(scope="session")
def training_server(untied_qwen3_dir):
    """One real CPU vLLM server for the trainer's tests, serving `untied_qwen3_dir`; tests that train on it
    push weights, so each starts by pushing its own (the trainer's first sync)."""
    with VLLMServer(model_dir=untied_qwen3_dir, max_model_len=1024, attach_url=None) as server:
        yield server

"""Session fixtures shared by every test in the workspace: tiny offline models and one real vLLM server.

The server is started once per test session (start-up takes 25-90 s on 2 cores) and every test that
needs a generation server uses it. Tests that change the server's weights or adapters restore them
before they return, so test order never matters. `readme_example` runs a package README's example
the way a reader would, so every README's example is also a test.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tools.dev_server import VLLMServer
from tools.tiny_models import TinyModelSpec, build_tokenizer, save_tiny_model


@dataclass(frozen=True, slots=True)
class ReadmeRun:
    """What running a README's example left behind: its printed lines and its global names."""

    stdout: str
    names: dict


def run_readme_example(readme: Path) -> ReadmeRun:
    """Run the first Python block under the README's `## Example` heading, as a reader would paste it."""
    code = re.search(r"## Example.*?```python\n(.*?)```", readme.read_text(), re.DOTALL).group(1)
    names: dict = {"__name__": "readme"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(readme), "exec"), names)
    return ReadmeRun(stdout=out.getvalue(), names=names)


@pytest.fixture
def readme_example(request) -> ReadmeRun:
    """The example of the README of the package whose test asks for it."""
    return run_readme_example(Path(request.path).resolve().parents[1] / "README.md")


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
    with VLLMServer(model_dir=untied_qwen3_dir, max_model_len=1024) as server:
        yield server

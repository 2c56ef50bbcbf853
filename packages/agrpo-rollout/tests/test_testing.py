"""`agrpo_rollout.testing`: the local CPU vLLM server (own or attached) and its isolated environment.

Starting a server of its own is what the session fixtures of the root conftest do (every server test
depends on it); these tests cover what they do not: the frozen surface, no torch on its import path,
the verified-install marker, and attaching to a running server instead of starting one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

import agrpo_rollout.testing
from agrpo_rollout import TopLogprobs, TurnRecord, _vllm_env
from agrpo_rollout.testing import (
    ATTACH_URL_ENV,
    VLLM_REQUIREMENT,
    DevServerError,
    VLLMServer,
    ensure_vllm_env,
    free_port,
    scripted_turn,
)

EXPORTED = [
    "ATTACH_URL_ENV",
    "DEFAULT_ENV_DIR",
    "DevServerError",
    "VLLMServer",
    "VLLM_REQUIREMENT",
    "ensure_vllm_env",
    "free_port",
    "scripted_turn",
]


def test_exports_are_frozen_and_import_no_torch():
    assert agrpo_rollout.testing.__all__ == EXPORTED
    code = "import sys, agrpo_rollout.testing; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_verified_environment_is_reused_without_probing_vllm(tmp_path):
    """The marker written after a verified install short-cuts the 8 s import probe (and any reinstall)."""
    env_dir = tmp_path / "vllm-env"
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").symlink_to(sys.executable)  # cannot import vllm: a probe would reinstall
    (env_dir / ".agrpo-verified").write_text(_vllm_env._marker_text())
    start = time.monotonic()
    assert ensure_vllm_env(env_dir) == env_dir / "bin" / "python"
    assert time.monotonic() - start < 1.0
    assert (tmp_path / "vllm-env.lock").exists(), "concurrent sessions serialise on this lock"


def test_the_environment_is_the_pinned_list_installed_with_uv_and_reinstalled_when_the_pins_change(
    tmp_path, monkeypatch
):
    pinned = _vllm_env.PINNED_REQUIREMENTS.read_text().splitlines()
    assert f"{VLLM_REQUIREMENT}" in pinned and "torch==2.13.0+cpu" in pinned
    assert not [line for line in pinned if line.startswith(("torchvision", "torchaudio", "torchcodec"))]
    assert all(line.startswith("#") or line.count("==") == 1 for line in pinned), "every package pinned"
    env_dir = tmp_path / "vllm-env"
    monkeypatch.setenv("UV", "/opt/uv")
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    venv, install = _vllm_env._install_steps(env_dir, env_dir / "bin" / "python")
    assert venv[:2] == ["/opt/uv", "venv"] and install[:3] == ["/opt/uv", "pip", "install"]
    assert "--find-links=/opt/wheels" in install and install[-3:] == [
        "--no-deps",
        "-r",
        str(_vllm_env.PINNED_REQUIREMENTS),
    ]
    installs = []
    monkeypatch.setattr(_vllm_env, "_install", lambda *args: installs.append(args))
    monkeypatch.setattr(_vllm_env, "_imports_vllm", lambda python: True)
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").symlink_to(sys.executable)
    (env_dir / ".agrpo-verified").write_text(VLLM_REQUIREMENT)  # an environment of the old, unpinned install
    ensure_vllm_env(env_dir)
    assert len(installs) == 1 and (env_dir / ".agrpo-verified").read_text() == _vllm_env._marker_text()
    ensure_vllm_env(env_dir)
    assert len(installs) == 1


def test_attach_url_defaults_to_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(ATTACH_URL_ENV, "http://10.0.0.7:8000/")
    server = VLLMServer(model_dir=tmp_path)
    assert server.attach_url == "http://10.0.0.7:8000/" and server.url == "http://10.0.0.7:8000"
    monkeypatch.delenv(ATTACH_URL_ENV)
    assert VLLMServer(model_dir=tmp_path).attach_url is None


def test_a_qwen3_5_hybrid_is_refused_before_start_up_naming_why_and_what_to_do(monkeypatch, tmp_path):
    monkeypatch.delenv(ATTACH_URL_ENV, raising=False)
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3_5ForCausalLM"]}')
    with pytest.raises(DevServerError, match="torchvision.*libtorch_cuda.*GPU vLLM server"):
        VLLMServer(model_dir=tmp_path).start(python=tmp_path / "no-python")  # refused before anything runs


def test_a_qwen3_next_in_float32_is_refused_before_start_up_naming_the_dtype(monkeypatch, tmp_path):
    monkeypatch.delenv(ATTACH_URL_ENV, raising=False)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_next"}')
    with pytest.raises(DevServerError, match=r"bfloat16 only.*dtype='float32'.*dtype='bfloat16'"):
        VLLMServer(model_dir=tmp_path).start(python=tmp_path / "no-python")
    command = VLLMServer(model_dir=tmp_path, dtype="bfloat16").command(tmp_path)
    assert command[command.index("--dtype") + 1] == "bfloat16"


def test_attaching_uses_the_running_server_and_leaves_it_running(vllm_server, tiny_qwen3_dir):
    with VLLMServer(model_dir=tiny_qwen3_dir, attach_url=vllm_server.url, max_model_len=64) as server:
        assert server.process is None and server.url == vllm_server.url
        assert server.model_name == vllm_server.model_name
        assert server.max_model_len == vllm_server.max_model_len, "the attached server's own context length"
    assert httpx.get(f"{vllm_server.url}/health", timeout=10).status_code == 200


def test_attaching_to_a_server_of_another_shape_or_none_fails_naming_the_variable(
    vllm_server, tiny_hybrid_dir, tiny_qwen3_dir
):
    with pytest.raises(DevServerError, match=rf"{ATTACH_URL_ENV}=.* serves .*shaped.*unset {ATTACH_URL_ENV}"):
        VLLMServer(model_dir=tiny_hybrid_dir, attach_url=vllm_server.url).start()
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(DevServerError, match=r"did not answer /health in 2 s; start that server, or unset"):
        VLLMServer(model_dir=tiny_qwen3_dir, attach_url=dead, startup_timeout_s=2).start()


def test_the_command_line_needs_a_model():
    done = subprocess.run(
        [sys.executable, "-m", "agrpo_rollout.testing"], capture_output=True, text=True,
        env={**os.environ, ATTACH_URL_ENV: ""},
    )  # fmt: skip
    assert done.returncode == 2 and "--model" in done.stderr
    assert (
        "python -m agrpo_attention.testing"
        in subprocess.run(
            [sys.executable, "-m", "agrpo_rollout.testing", "--help"], capture_output=True, text=True
        ).stdout
    )


def test_a_scripted_turn_trains_only_the_plain_real_tokens_and_ends_with_the_script(tool_tokenizer):
    real_ids = tool_tokenizer.encode("ok{<", add_special_tokens=False)
    real = TurnRecord(
        prompt_ids=[1, 2], output_ids=real_ids, output_log_probs=np.full(len(real_ids), -0.5, np.float32),
        output_sampler_logprobs=TopLogprobs(ids=np.zeros((len(real_ids), 2), np.int64),
                                            logprobs=np.full((len(real_ids), 2), -1.0, np.float32)),
        finish_reason="length",
    )  # fmt: skip
    turn = scripted_turn(tool_tokenizer, real, "<tool_call>x</tool_call>")
    script = tool_tokenizer.encode("<tool_call>x</tool_call>", add_special_tokens=False)
    kept = [t for t in real_ids if tool_tokenizer.decode([t]).isalnum()]
    assert turn.output_ids.tolist() == kept + script + [tool_tokenizer.eos_token_id]
    assert turn.output_mask.tolist() == [True] * len(kept) + [False] * (len(script) + 1)
    assert (turn.output_log_probs[len(kept) :] == 0).all() and turn.finish_reason == "stop"
    assert (turn.output_sampler_logprobs.ids[len(kept) :] == -1).all()

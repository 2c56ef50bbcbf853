"""`WeightSync`: backend choice, timings, two FSDP2 ranks where only rank 0 talks to the server, the
pre-flight manifest check, one sync at a time, and the start-up warnings (real CPU server where marked)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_sync import (
    ManifestMismatchError,
    ServerControl,
    ServerInfo,
    SyncSetupError,
    WeightSync,
    WeightSyncConfig,
    WeightSyncError,
)
from agrpo_sync._param_stream import plain_entries
from agrpo_sync._start_checks import choose_backend, has_tied_embedding, kept_on_cpu_server

ROOT = Path(__file__).resolve().parents[3]
RANK_SCRIPT = Path(__file__).with_name("fsdp_sync_rank.py")


def _info(**overrides) -> ServerInfo:
    fields = dict(
        version="0.32.0", dtype="bfloat16", device="cuda", model_root="m", data_parallel_size=1, lora_enabled=True,
        max_lora_rank=16, max_loras=4, runtime_lora_updating=True, weight_transfer_backend="nccl",
    )  # fmt: skip
    return ServerInfo(**{**fields, **overrides})


def _config(**overrides) -> WeightSyncConfig:
    return WeightSyncConfig(
        base_url="http://server:8000", output_dir="/tmp/run", max_staleness=2, **overrides
    )


def test_backend_choice_for_plain_and_lora_models(tiny_model):
    plain = tiny_model()
    peft = get_peft_model(tiny_model(), LoraConfig(r=8, target_modules=["q_proj"]))
    assert choose_backend(_config(), plain, [_info()]) == "nccl"
    assert choose_backend(_config(backend="disk"), plain, [_info()]) == "disk"
    assert choose_backend(_config(), peft, [_info()]) == "lora"
    assert choose_backend(_config(lora_sync="merged"), peft, [_info()]) == "nccl"
    assert choose_backend(_config(), peft, [_info(lora_enabled=False)]) == "nccl"  # auto falls back to merged
    assert choose_backend(_config(), peft, [_info(data_parallel_size=2)]) == "nccl"
    with pytest.raises(SyncSetupError, match="--max-loras 4"):
        choose_backend(_config(lora_sync="adapter"), peft, [_info(max_loras=3)])
    # several servers take one backend: one that cannot serve adapters makes them all take merged weights
    assert choose_backend(_config(), peft, [_info(), _info()]) == "lora"
    assert choose_backend(_config(), peft, [_info(), _info(lora_enabled=False)]) == "nccl"
    with pytest.raises(SyncSetupError, match="--enable-lora"):
        choose_backend(_config(lora_sync="adapter"), peft, [_info(), _info(lora_enabled=False)])


def test_routed_experts_stay_on_a_cpu_server_frozen_and_are_refused_trainable():
    """vLLM 0.32's CPU reload overwrites its packed routed experts unpacked (the server then computes garbage): a
    full-weight sync to a CPU server leaves frozen experts out and refuses trainable ones, naming the fix; routers
    and shared experts are sent. LoRA is refused there both ways (merged weights carry the experts; with
    --enable-lora the CPU engine's MoE layers need Triton). GPU servers take the model as it is."""
    model = build_model(TinyModelSpec(kind="qwen3_next", num_layers=4), build_tokenizer())
    cpu, gpu = [_info(device="cpu")], [_info(device="cuda")]
    with pytest.raises(
        SyncSetupError, match=r"experts would be sent \(model.layers.0.mlp.experts.*requires_grad_"
    ):
        kept_on_cpu_server(model, cpu, "full")
    assert kept_on_cpu_server(model, gpu, "full") == kept_on_cpu_server(model, gpu, "adapter") == frozenset()
    with pytest.raises(SyncSetupError, match="engine dies at the first adapter request.*without peft_config"):
        kept_on_cpu_server(model, cpu, "adapter")
    for layer in model.model.layers:
        layer.mlp.experts.requires_grad_(False)
    kept = kept_on_cpu_server(model, cpu, "full")
    assert kept == {n for n, _ in model.named_parameters() if ".mlp.experts." in n} and len(kept) == 8
    sent = {e.meta.name for e in plain_entries(model, None, (), kept)}
    assert not sent & kept and "model.layers.0.mlp.shared_expert.up_proj.weight" in sent
    assert "model.layers.0.mlp.gate.weight" in sent
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(SyncSetupError, match="merged LoRA weights"):
        kept_on_cpu_server(peft, cpu, "full")
    assert kept_on_cpu_server(build_model(TinyModelSpec(), build_tokenizer()), cpu, "full") == frozenset()


def test_gpt_oss_experts_and_sinks_stay_on_a_cpu_server_frozen_and_are_refused_trainable():
    """gpt-oss's loader copies its routed experts (router `router`, not `gate`) and attention sinks into the
    parameters without a weight loader, so vLLM 0.32's in-place reload on a CPU server keeps their start-up values
    (measured): frozen ones are left out of the sync, trainable ones refused naming the fix."""
    model = build_model(
        TinyModelSpec(kind="gpt_oss", num_layers=2, tie_word_embeddings=False), build_tokenizer()
    )
    cpu = [_info(device="cpu")]
    with pytest.raises(
        SyncSetupError, match=r"experts and attention sinks would be sent.*sinks.requires_grad_"
    ):
        kept_on_cpu_server(model, cpu, "full")
    for layer in model.model.layers:
        layer.mlp.experts.requires_grad_(False)
    with pytest.raises(SyncSetupError, match=r"would be sent \(model.layers.0.self_attn.sinks"):
        kept_on_cpu_server(model, cpu, "full")
    for layer in model.model.layers:
        layer.self_attn.sinks.requires_grad_(False)
    kept = kept_on_cpu_server(model, cpu, "full")
    assert kept == {n for n, _ in model.named_parameters() if ".mlp.experts." in n or n.endswith(".sinks")}
    assert len(kept) == 2 * (4 + 1)  # per layer: gate_up_proj, down_proj and their biases; sinks
    sent = {e.meta.name for e in plain_entries(model, None, (), kept)}
    assert not sent & kept and {"model.layers.0.mlp.router.weight", "lm_head.weight"} <= sent
    assert kept_on_cpu_server(model, [_info(device="cuda")], "full") == frozenset()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_ranks_gather_in_buckets_and_only_rank_0_talks(stub_worker, tmp_path, tiny_model):
    port, env = str(_free_port()), {**os.environ, "PYTHONPATH": str(ROOT)}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), str(r), port, stub_worker.url, str(tmp_path)],
            env=env,
            cwd=ROOT,
        )
        for r in (0, 1)
    ]
    assert [p.wait(timeout=300) for p in ranks] == [0, 0]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    expected = tiny_model()
    with torch.no_grad():
        for param in expected.parameters():
            param.mul_(1.5)
    assert stub_worker.state["version"] == "2"  # the second sync was re-sent once; the third failed twice
    for name, param in expected.named_parameters():
        torch.testing.assert_close(stub_worker.weights[name], param.detach(), rtol=0, atol=0)
    total = sum(p.nbytes for p in expected.parameters())
    assert [r["num_bytes"] for r in results] == [total, 0]
    assert [r["has_backend"] for r in results] == [True, False]
    largest = max(p.nbytes for p in expected.parameters())
    assert all(r["peak_gather_bytes"] <= max(40_000, largest) for r in results)
    assert all(r["peak_gather_bytes"] < total / 2 for r in results)  # never the whole model at once
    assert [r["second_retries"] for r in results] == [1, 1]  # both ranks gathered again for the re-send
    assert all("the retry failed too" in r["third"] for r in results)  # both ranks see the failure
    assert all("generation stays paused" in r["third"] for r in results)
    assert stub_worker.state["paused"] is True  # left paused: its layers mix versions 2 and 3


def _disk(url: str, tmp_path, **overrides) -> WeightSyncConfig:
    return WeightSyncConfig(base_url=url, output_dir=str(tmp_path), backend="disk", **overrides)


@pytest.mark.server
@pytest.mark.usefixtures("restore_server")
def test_a_missing_tensor_is_refused_before_pausing(vllm_server, tmp_path, tiny_model, perturb, logprobs):
    model = tiny_model()
    perturb(model, 1)
    sync = WeightSync.start(_disk(vllm_server.url, tmp_path, non_text_modules=("mlp",)), model)
    sync.sync(model, 1)
    served = logprobs.server(vllm_server.model_name)
    perturb(model, 2)
    model.model.layers[1].mlp.requires_grad_(False)  # now taken for a frozen tower: not sent
    pauses = []
    sync.control.pause = lambda *args: pauses.append(args)
    with pytest.raises(
        ManifestMismatchError, match="3 missing: model.layers.1.mlp.down_proj.weight"
    ) as refused:
        sync.sync(model, 2)  # vLLM would reload the rest and serve a mix of versions 1 and 2
    assert "the first sync (version 1)" in str(refused.value) and pauses == []
    assert ServerControl(vllm_server.url).weight_version() == "1"
    assert torch.allclose(logprobs.server(vllm_server.model_name), served, atol=1e-4)


@pytest.mark.server
@pytest.mark.usefixtures("restore_server")
def test_a_second_thread_is_refused_while_a_sync_runs(vllm_server, tmp_path, tiny_model, perturb, logprobs):
    model = tiny_model()
    perturb(model, 1)
    sync = WeightSync.start(_disk(vllm_server.url, tmp_path), model)
    inside, release, outcome = threading.Event(), threading.Event(), {}
    reload = sync.control.reload_weights

    def held_reload(path):
        inside.set()
        release.wait(60)
        reload(path)

    sync.control.reload_weights = held_reload
    first = threading.Thread(target=lambda: outcome.update(first=sync.sync(model, 1)))
    first.start()
    assert inside.wait(60)
    with pytest.raises(
        WeightSyncError, match=r"sync\(version=2\) was called while sync\(version=1\) is running"
    ):
        sync.sync(model, 2)
    release.set()
    first.join(60)
    assert outcome["first"].retries == 0
    assert ServerControl(vllm_server.url).weight_version() == "1"
    assert torch.allclose(logprobs.server(vllm_server.model_name), logprobs.trainer(model), atol=1e-4)
    assert sorted(p.name for p in (tmp_path / ".vllm_weights").iterdir()) == ["v1"]
    sync.control.reload_weights = reload
    sync.sync(model, 2)  # after the first returned, the next sync runs as usual


def test_tied_embeddings_are_recognised(tiny_model):
    assert has_tied_embedding(tiny_model())
    untied = build_model(TinyModelSpec(tie_word_embeddings=False), build_tokenizer())
    assert not has_tied_embedding(untied)
    assert has_tied_embedding(get_peft_model(tiny_model(), LoraConfig(r=8, target_modules=["q_proj"])))


@pytest.mark.server
def test_a_tied_embedding_on_a_cpu_server_is_warned_about_at_start(vllm_server, tmp_path, tiny_model, caplog):
    with caplog.at_level(logging.WARNING, logger="agrpo_sync"):
        WeightSync.start(_disk(vllm_server.url, tmp_path), tiny_model()).close()
    tied = [r.getMessage() for r in caplog.records if "ties its output head" in r.getMessage()]
    assert len(tied) == 1 and "tie_word_embeddings=False" in tied[0]
    caplog.clear()
    untied = build_model(TinyModelSpec(tie_word_embeddings=False), build_tokenizer())
    with caplog.at_level(logging.WARNING, logger="agrpo_sync"):
        WeightSync.start(_disk(vllm_server.url, tmp_path), untied).close()
    assert not [r for r in caplog.records if "ties its output head" in r.getMessage()]


def test_versions_that_cannot_name_a_directory_are_refused():
    sync = WeightSync(config=_config(), backend_name="disk", backend=None, controls=[], rank=0, world_size=1)
    for version in (-1, "../x", 1.5, True):
        with pytest.raises(ValueError, match="version="):
            sync.sync(None, version)

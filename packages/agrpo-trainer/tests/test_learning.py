"""It learns, for real, on this CPU machine: the main job's setup (`agrpo-trainer demo`) against the real CPU vLLM
server with disk weight sync. A tiny random model learns to write digits; after every sync the server scores
the parity probe exactly as the trainer does; `reward` is logged on every optimizer step; a healthy server
needs no retried request; the main job's own settings raise no warning; train() leaves no process behind
and writes its report. The same task trains a Gated DeltaNet hybrid (Qwen3-Next's layout) against a bf16 CPU
server of its own, and a tiny Gemma 3 and gpt-oss (sliding windows, learned sinks) against fp32 servers of
their own."""

from __future__ import annotations

import copy
import os
import statistics
import warnings

import httpx
import numpy as np
import psutil
import pytest
import torch
from report_reader import read_curves
from safetensors import safe_open
from transformers import AutoModelForCausalLM, TrainerCallback

from agrpo_attention.testing import TinyModelSpec, save_tiny_model
from agrpo_rollout.testing import VLLMServer
from agrpo_trainer import AsyncGRPOTrainer
from agrpo_trainer._demo import PROMPTS, closing_line, demo_config, run_demo
from agrpo_trainer._parity_probe import ParityProbe
from agrpo_trainer.rewards import CharacterFractionReward

STEPS = 40


@pytest.mark.server
def test_a_tiny_model_learns_against_the_real_server_and_every_sync_lands(
    training_server, untied_qwen3_dir, tmp_path
):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the demo does: the CPU server's worker holds one of the two cores
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = run_demo(training_server, untied_qwen3_dir, str(tmp_path / "run"), STEPS)
    finally:
        torch.set_num_threads(threads)
    ours = [w for w in caught if issubclass(w.category, FutureWarning | DeprecationWarning | RuntimeWarning)]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    history = trainer.state.log_history
    rewards = [h["reward"] for h in history if "reward" in h]
    assert len(rewards) == STEPS, "the trained reward on every optimizer step"
    assert sum(h.get("rollout/vllm_retry_total", 0) for h in history) == 0, "a healthy server: no retry"
    assert sum(h.get("perf/weight_sync_retries", 0) for h in history) == 0
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert last > 2 * first and last > first + 0.05, (
        f"mean reward of the first 10 steps {first:.3f}, last 10 {last:.3f}"
    )

    gaps = [h["sync/logprob_max_abs_diff"] for h in history if "sync/logprob_max_abs_diff" in h]
    assert (
        len(gaps) == STEPS
    )  # one push per optimizer step (the first push, at train begin, logs with step 1)
    assert max(gaps) < 1e-4, f"the server's log-probs left the trainer's after a sync: {max(gaps):.2e}"
    assert all(h.get("sample/staleness_max", 0) <= 2 for h in history)
    assert read_curves(tmp_path / "run" / "report.html")["reward"][1] == rewards
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before
    (runtime,) = [h["train_runtime"] for h in history if "train_runtime" in h]
    line = closing_line(trainer)  # the demo's last line tells the progress bar's own time
    assert line.startswith(f"trained {STEPS} steps in {runtime:.1f} s:"), line


# A Gated DeltaNet hybrid against the real CPU server: Qwen3-Next's layout (fused Gated DeltaNet projections, gated
# attention, MoE blocks with a shared expert), which vLLM's CPU build serves in bfloat16 only. Its routed experts are
# frozen: the CPU server's in-place reload corrupts them (vLLM 0.32 packs them at start-up only; agrpo-sync refuses
# trainable ones and leaves frozen ones out of every sync); routers, shared experts and everything else train. The
# server runs bf16 and the trainer fp32, so the parity probe's gap is read against the version before's.
HYBRID_STEPS = 20
"""Seen at step 20 over four runs: 0.19 to 0.88. Not many more: near 1 every rollout of a group writes only digits,
such groups have no reward spread and are dropped, and the trainer waits for samples (one run sat at step 29 of 30
with reward 0.995; it now stops after max_groups_dropped_in_a_row such groups, test_group_guard.py)."""
HYBRID_LEARNING_RATE = 2e-2
"""The demo's 5e-3 moves this hybrid's reward too slowly for a short test (0.03 -> 0.06 in 24 steps, seen)."""
LANDED_GAP_SHARE = 0.5
"""A sync landed when the server's log-probs for the parity probe sit nearer the trainer's new weights than the
weights of the version before: mean |server - new| under this share of mean |server - before|. Absolute bounds do
not hold for a bf16 server scored against an fp32 trainer: the gap grows as training sharpens the policy and
depends on the CPU's bf16 kernels (seen: means of 1e-3 to 0.014 and a largest token gap of 0.11 on this machine;
means up to 0.059 and a largest token gap of 1.7 nats on CI's). A sync that did not land leaves the server on the
version before (seen: mean |new - before| 0.14 to 0.76 per step at this learning rate), so its share is many
times 1; a half-landed one about 1."""


@pytest.fixture(scope="module")
def qwen3_next_server(tmp_path_factory):
    """A bf16 CPU server of a tiny Qwen3-Next of this test alone, its engine on the last core (beside the
    session's servers on core 0)."""
    model_dir = save_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3-next"),
        TinyModelSpec(kind="qwen3_next", num_layers=4, tie_word_embeddings=False),
    )
    env = {"VLLM_CPU_OMP_THREADS_BIND": str((os.cpu_count() or 1) - 1)}
    server = VLLMServer(model_dir=model_dir, dtype="bfloat16", max_model_len=1024, attach_url=None, env=env)
    with server.start(wait=False):
        yield server


class ProbeWitness:
    """Beside the trainer's own parity probe (it runs as it would), keeps for every sync the server's log-probs, the
    trainer's, and those the weights of the version before give the same continuation."""

    def __init__(self, monkeypatch) -> None:
        self.server: list[np.ndarray] = []
        self.trained: list[np.ndarray] = []
        self.before: list[np.ndarray | None] = []
        self._weights: dict[str, torch.Tensor] | None = None
        self.previous_weights: dict[str, torch.Tensor] | None = None
        """The weights of the version before the last one probed (what a sync that did not land would leave)."""
        server_sample, trainer_logprobs = ParityProbe.server_sample, ParityProbe.trainer_logprobs

        def sampled(probe, model_name):
            ids, logprobs = server_sample(probe, model_name)
            self.server.append(logprobs)
            return ids, logprobs

        def scored(probe, model, continuation):
            ours = trainer_logprobs(probe, model, continuation)
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            before = None
            if self._weights is not None:
                twin = copy.deepcopy(model)
                twin.load_state_dict(self._weights)
                before = trainer_logprobs(probe, twin, continuation)
            self.trained.append(ours)
            self.before.append(before)
            self.previous_weights, self._weights = self._weights, weights
            return ours

        monkeypatch.setattr(ParityProbe, "server_sample", sampled)
        monkeypatch.setattr(ParityProbe, "trainer_logprobs", scored)

    def landed_shares(self) -> list[float]:
        """Per sync after the first: mean |server - new weights| / mean |server - weights before|."""
        assert len(self.server) == len(self.trained) == len(self.before)
        return [
            float(np.abs(server - trained).mean() / np.abs(server - before).mean())
            for server, trained, before in zip(self.server, self.trained, self.before, strict=True)
            if before is not None
        ]


def _server_and_trainer_logprobs(server: VLLMServer, model) -> tuple[list[float], list[float]]:
    """A fresh continuation sampled on the server and the trainer model's log-probs of the same tokens."""
    prompt = list(range(40, 72))
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": 24, "logprobs": 0, "temperature": 1.0,
            "return_token_ids": True, "ignore_eos": True, "seed": 7}  # fmt: skip
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    ids = torch.tensor([prompt + choice["token_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].double()
    ours = logits.log_softmax(-1).gather(1, ids[0, len(prompt) :, None])[:, 0].tolist()
    return choice["logprobs"]["token_logprobs"], ours


SOLVED_REWARD = 0.9
"""A step whose trained reward reaches this ends the run: past it nearly every group has no reward spread and is
dropped, and a run that learned fast (the async interleaving varies with the machine's load) stops with
`NothingTrainedError` before its last step (seen: gpt-oss at 0.97 by step 18 of 24 under load)."""


class _StopWhenSolved(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and logs.get("reward", 0.0) >= SOLVED_REWARD:
            control.should_training_stop = True


def _train_with_witness(server, policy, steps, learning_rate, tmp_path, monkeypatch):
    """The demo's task and settings at `learning_rate` for up to `steps` steps on `policy` against `server` (one
    trainer thread: the server's worker holds a core), with a `ProbeWitness`, ending early once solved
    (`SOLVED_REWARD`); the reward must rise: the last 6 steps' mean (a half of a shorter run) above twice the first
    6's and 0.05 above it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = demo_config(str(tmp_path / "run"), server.url, steps)
        args.learning_rate = learning_rate
        trainer = AsyncGRPOTrainer(
            policy, CharacterFractionReward(), args=args, train_dataset=PROMPTS, callbacks=[_StopWhenSolved()]
        )
        witness = ProbeWitness(monkeypatch)
        server.wait_healthy()
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert len(rewards) == trainer.state.global_step and (
        len(rewards) == steps or rewards[-1] >= SOLVED_REWARD
    )
    first, last = _first_and_last_mean(rewards)
    assert last > 2 * first and last > first + 0.05, (
        f"mean reward of the first 6 steps {first:.3f}, last 6 {last:.3f}"
    )
    return trainer, witness


def _first_and_last_mean(rewards: list[float]) -> tuple[float, float]:
    """Mean reward of the first and the last 6 steps (of each half of a run shorter than 12)."""
    k = min(6, len(rewards) // 2)
    return statistics.mean(rewards[:k]), statistics.mean(rewards[-k:])


@pytest.mark.server
def test_a_gated_deltanet_hybrid_learns_against_the_real_server_and_every_sync_lands(
    qwen3_next_server, tmp_path, monkeypatch
):
    """Qwen3-Next's layout trained on tree rows by `AsyncGRPOTrainer`, end to end: the reward rises, every sync's
    parity probe finds the server nearer the new weights than the version before, and after the run the server
    scores a fresh continuation as the trained weights do, read as the probe reads it (`LANDED_GAP_SHARE` of its
    gap to the weights of the version before: a bf16 server's absolute gap to an fp32 trainer grows with training,
    a mean of 0.034 nats seen after one run where another gave 1.1e-3) and unlike the weights it started from (over
    1 nat). About 2 minutes (server start-up overlapped)."""
    model_dir = str(qwen3_next_server.model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in policy.model.layers:
        layer.mlp.experts.requires_grad_(False)
    trainer, witness = _train_with_witness(
        qwen3_next_server, policy, HYBRID_STEPS, HYBRID_LEARNING_RATE, tmp_path, monkeypatch
    )
    history = trainer.state.log_history
    gaps = [h["sync/logprob_max_abs_diff"] for h in history if "sync/logprob_max_abs_diff" in h]
    means = [h["sync/logprob_mean_abs_diff"] for h in history if "sync/logprob_mean_abs_diff" in h]
    shares = witness.landed_shares()
    print(f"parity probe after each sync: max {max(gaps):.3g}, largest mean {max(means):.3g}; "
          f"server nearer the new weights than the old: largest share {max(shares):.3g}")  # fmt: skip
    steps = trainer.state.global_step
    assert len(gaps) == len(means) == steps, "one parity probe per sync"
    assert len(shares) == len(witness.server) - 1 == steps, "a push at train begin, then one per step"
    assert max(shares) < LANDED_GAP_SHARE, (
        f"a sync did not land: shares {shares}, max gaps {gaps}, means {means}"
    )
    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stock = copy.deepcopy(start)  # the trained weights in a stock (not tree-enabled) model
    stock.load_state_dict(trainer.model.state_dict())
    before = copy.deepcopy(start)
    before.load_state_dict(witness.previous_weights)
    served, trained = _server_and_trainer_logprobs(qwen3_next_server, stock)
    _, previous = _server_and_trainer_logprobs(qwen3_next_server, before)
    _, initial = _server_and_trainer_logprobs(qwen3_next_server, start)
    gap, gap_before, moved = (
        statistics.mean(abs(a - b) for a, b in zip(served, ours, strict=True))
        for ours in (trained, previous, initial)
    )
    print(f"after the run: mean |server - trained| {gap:.3g}, - the version before {gap_before:.3g}, "
          f"- the start {moved:.3g}")  # fmt: skip
    # seen: 1.1e-3 and 0.034 against the trained weights, 5.9 and 3.2 against the start
    assert gap < LANDED_GAP_SHARE * gap_before and moved > 1.0, (
        f"mean |server - trainer| log-prob: trained {gap:.3g}, the version before {gap_before:.3g}, "
        f"initial weights {moved:.3g}"
    )


# Sliding windows and learned attention sinks against the real CPU server, in fp32 on both sides: a tiny Gemma 3
# (sliding, sliding, global, sliding) and a tiny gpt-oss (sliding and global layers alternating, learned sinks, 4
# routed experts), each with a window of 8 keys, well under the demo's ~30-token prompts + 24-token completions and
# the parity probe's 64 tokens, so the windows shape every score. gpt-oss's routed experts and sinks are frozen: vLLM
# 0.32's gpt-oss loader copies them without a weight loader, so the CPU server's in-place reload keeps its start-up
# values (agrpo-sync refuses trainable ones and leaves frozen ones out of every sync).
WINDOW = 8
WINDOWED_STEPS = 24
"""The reward's rise starts anywhere from step 7 to 15 (seen at this learning rate; at 16 steps one Gemma 3 run of
three stayed at 0.04). Not many more: by step 24 one run of each sat near its ceiling (0.99; gpt-oss collapsed onto
one completion at 0.68), where groups without reward spread are dropped and a step takes up to 15 s."""
WINDOWED_LEARNING_RATE = 3e-2
"""4e-2 sent one gpt-oss run of four off (the KL to the sampler reached 8, the reward stayed at 0.03)."""
WINDOWED_MAX_GAP = {"gemma3": 1e-3, "gpt_oss": 0.25}
"""The largest token gap of the parity probe after any sync, and after the run, fp32 on both sides. Seen: Gemma 3
up to 3.8e-6; gpt-oss up to 3.6e-4 (typically 1e-5, growing as the policy sharpens). gpt-oss's bound leaves room
for a router tie that the two sides break differently: it swaps one expert of one token (forced on the start
weights: 0.006 to 0.11 nats; not seen in about 11 runs). Whether a sync landed is the landed share's test: a sync
that did not land is off by 0.2 to 3.7 nats on average."""


@pytest.fixture(scope="module", params=["gemma3", "gpt_oss"])
def windowed_server(request, tmp_path_factory):
    """An fp32 CPU server of a tiny windowed model of this test alone (one at a time), its engine on the last
    core."""
    spec = TinyModelSpec(kind=request.param, num_layers=4, tie_word_embeddings=False, sliding_window=WINDOW)
    model_dir = save_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), spec)
    env = {"VLLM_CPU_OMP_THREADS_BIND": str((os.cpu_count() or 1) - 1)}
    server = VLLMServer(model_dir=model_dir, dtype="float32", max_model_len=1024, attach_url=None, env=env)
    with server.start(wait=False):
        yield request.param, server


def _frozen_on_cpu_server(model) -> dict[str, torch.Tensor]:
    """gpt-oss's routed experts and attention sinks, frozen (copies of their values); nothing for other models."""
    for layer in model.model.layers:
        for part in (getattr(layer.mlp, "experts", None), getattr(layer.self_attn, "sinks", None)):
            if part is not None:
                part.requires_grad_(False)
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.server
def test_windowed_models_learn_against_the_real_server_and_every_sync_lands(
    windowed_server, tmp_path, monkeypatch
):
    """Gemma 3 and gpt-oss, sliding windows shorter than every sequence, trained on tree rows by
    `AsyncGRPOTrainer` against an fp32 CPU server: the reward rises, every sync's parity probe finds the server
    on the new weights (largest token gap under WINDOWED_MAX_GAP, and far nearer them than the version before),
    gpt-oss's experts and sinks stay out of every sync and unchanged, and after the run the server scores a
    fresh continuation as the trained weights do and unlike the start. About 55 to 85 s each (server start-up
    overlapped)."""
    kind, server = windowed_server
    model_dir = str(server.model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    frozen = _frozen_on_cpu_server(policy)
    trainer, witness = _train_with_witness(
        server, policy, WINDOWED_STEPS, WINDOWED_LEARNING_RATE, tmp_path, monkeypatch
    )
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    first, last = _first_and_last_mean(rewards)
    gaps = [float(np.abs(s - t).max()) for s, t in zip(witness.server, witness.trained, strict=True)]
    shares = witness.landed_shares()
    print(f"{policy.config.model_type}: reward {first:.3f} -> {last:.3f}; parity probe after each sync: max "
          f"{max(gaps):.3g}; largest landed share {max(shares):.3g}")  # fmt: skip
    assert len(shares) == len(gaps) - 1 == trainer.state.global_step, "a probe per push"
    assert max(gaps) < WINDOWED_MAX_GAP[kind], f"the server left the trainer after a sync: {gaps}"
    assert max(shares) < LANDED_GAP_SHARE, f"a sync did not land: shares {shares}, max gaps {gaps}"
    (last_sent,) = {f for f in (tmp_path / "run").rglob("*.safetensors") if ".vllm_weights" in f.parts}
    with safe_open(last_sent, "pt") as sent:  # gpt-oss's experts and sinks: left out, and unchanged
        assert set(sent.keys()) == {n for n, _ in policy.named_parameters()} - frozen.keys()
    # per gpt-oss layer: the experts' 2 weights and 2 biases, the sinks
    assert len(frozen) == (4 * (4 + 1) if kind == "gpt_oss" else 0), sorted(frozen)
    trained_params = dict(trainer.model.named_parameters())
    assert all(torch.equal(trained_params[n].detach(), value) for n, value in frozen.items())
    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stock = copy.deepcopy(start)  # the trained weights in a stock (not tree-enabled) model
    stock.load_state_dict(trainer.model.state_dict())
    served, trained = _server_and_trainer_logprobs(server, stock)
    _, initial = _server_and_trainer_logprobs(server, start)
    gap = max(abs(a - b) for a, b in zip(served, trained, strict=True))
    moved = statistics.mean(abs(a - b) for a, b in zip(served, initial, strict=True))
    print(f"after the run: max |server - trained| {gap:.3g}, mean |server - start| {moved:.3g}")
    assert gap < WINDOWED_MAX_GAP[kind] and moved > 0.5, (gap, moved)  # seen: 1.5e-7 to 5.2e-6; 3.8 to 6.3

"""Servers that die under a training run, through `AsyncGRPOTrainer.train()` against real CPU vLLM servers
(issue 13, points 1 and 2): the server's whole process group is SIGKILLed between two optimizer steps and a
new process is started on the same port from the original weights, as a crashed or pre-empted server that
a supervisor restarts.

What must hold: training waits instead of failing (the rollout side retries with backoff, bounded by
`vllm_server_timeout`), sees the new process, has the trainer re-sync it before it takes a group, and goes
on; no trained sample claims a policy version that no server served; every drawn prompt has exactly one
group outcome and every sample of a kept group is trained exactly once; the restarted server ends on the
trainer's weights. With two servers, the other one carries the run meanwhile and the restarted one is
rejoined, then generates again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch
from fault_doubles import text_length
from prometheus_client.parser import text_string_to_metric_families
from run_recorders import (
    EventRecorder,
    PushRecorder,
    StepRecorder,
    model_logprobs,
    rollout_totals,
    server_logprobs,
)
from transformers import AutoModelForCausalLM, TrainerCallback

from agrpo_rollout.testing import VLLMServer
from agrpo_sync import ServerControl
from agrpo_trainer import AsyncGRPOConfig, AsyncGRPOTrainer

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def restartable_server(untied_qwen3_dir, tmp_path_factory):
    """A server of these tests alone (they kill it); it keeps its port across restarts. Its engine runs on the
    last core: vLLM's CPU build binds every server's engine to core 0 by default, and a server starting there
    beside a busy one barely gets the core (seen: no start within 300 s on two cores)."""
    log = tmp_path_factory.mktemp("restartable") / "vllm-server.log"
    env = {"VLLM_CPU_OMP_THREADS_BIND": str((os.cpu_count() or 1) - 1)}
    with VLLMServer(
        model_dir=untied_qwen3_dir, max_model_len=1024, attach_url=None, log_path=log, env=env
    ) as server:
        yield server


class RecordingTrainer(PushRecorder, EventRecorder, AsyncGRPOTrainer):
    pass


class KillAndRestart(TrainerCallback):
    """At the end of optimizer step `step`: SIGKILL `server`, then start it again on its port in a thread
    (a vLLM start takes tens of seconds, during which the port refuses connections)."""

    def __init__(self, server: VLLMServer, step: int) -> None:
        self.server, self.step = server, step
        self.thread: threading.Thread | None = None
        self.version_at_kill: int | None = None
        self.errors: list[BaseException] = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.thread is None:
            self.server.kill()
            self.thread = threading.Thread(target=self._restart, daemon=True)
            self.thread.start()

    def _restart(self) -> None:
        try:
            self.server.start()
        except BaseException as error:  # noqa: BLE001 - the test reports it
            self.errors.append(error)


def _prompts(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Tell me about item {i}."}]} for i in range(n)]


def _config(tmp_path: Path, urls, **overrides) -> AsyncGRPOConfig:
    """A small CPU run over one epoch: fp32 on both sides, disk sync every step, rows of 8 samples; samples
    are never dropped as stale, so every kept one must be trained."""
    settings = dict(
        output_dir=str(tmp_path / "run"), vllm_server_base_url=urls, weight_sync_backend="disk", bf16=False,
        use_cpu=True, learning_rate=1e-4, num_generations=4, max_completion_length=8,
        per_device_train_batch_size=8, token_budget=0, save_strategy="no", report_to="none", max_steps=-1,
        num_train_epochs=1, activation_checkpointing=False, disable_tqdm=True, rollout_worker_timeout=60.0,
        max_concurrent_rollouts=8, queue_maxsize=8, max_staleness=1000, vllm_server_timeout=300.0,
    )  # fmt: skip
    settings.update(overrides)
    return AsyncGRPOConfig(**settings)


def _check_nothing_lost(trainer, recorder: StepRecorder, num_prompts: int) -> None:
    draws = [value for kind, value in trainer.events if kind == "draw"]
    outcomes = {(o.epoch, o.row_index): o for kind, o in trainer.events if kind == "group"}
    expected = [(0, row) for row in range(num_prompts)]
    assert sorted(draws) == sorted(outcomes) == expected, "every prompt drawn once, one outcome each"
    trained = Counter((s.epoch, s.row_index) for step in recorder.steps for s in step)
    assert {key: o.num_samples for key, o in outcomes.items()} == {key: trained[key] for key in outcomes}


def _check_versions(trainer, recorder: StepRecorder, kill_step: int) -> int:
    """No trained sample claims a version pushed while no server was up; returns the re-sync's version."""
    unserved = {version for version, members in trainer.pushes if not members}
    versions = {s.policy_version for step in recorder.steps for s in step}
    assert not versions & unserved, f"samples claim versions {versions & unserved} that no server served"
    after_kill = [version for version, members in trainer.pushes[kill_step - 1 :] if members]  # [0]: step 1's
    assert after_kill, "no push reached a server after the restart"
    resync = after_kill[0]
    late = [s.policy_version for step in recorder.steps[kill_step:] for s in step]
    assert max(late) >= resync, "nothing generated by the restarted server was trained"
    return resync


def _check_serves_trainer_weights(trainer, server: VLLMServer, model_dir: Path) -> None:
    control = ServerControl(server.url)
    assert control.weight_version() == str(trainer.pushes[-1][0]) and control.is_paused() is False
    control.close()
    plain = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    )  # the trainer's runs tree attention
    plain.load_state_dict(trainer.model.state_dict())
    ids = trainer.processing_class.encode("What is 12 + 30? The answer is 42. The weather is hot")
    served = server_logprobs(server.url, server.model_name, ids)
    assert (served - model_logprobs(plain, ids)).abs().max() < 1e-3, "not the trainer's weights"


def _successful_requests(url: str) -> float:
    """`vllm:request_success_total` of the process serving `url` now (a new process starts at 0)."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
    return sum(
        s.value
        for f in families
        if f.name == "vllm:request_success"
        for s in f.samples
        if s.name.endswith("_total")
    )


def test_a_server_killed_mid_run_and_restarted_on_its_port_is_re_synced_and_training_goes_on(
    restartable_server, untied_qwen3_dir, tmp_path
):
    # The rollout side runs ahead by up to ~110 samples (its score queue of 16 groups, the sample queue, the
    # packing thread's prefetch), so with 64 prompts (256 samples) and the kill after step 1 most prompts are
    # generated after the restart.
    server, num_prompts, kill_step = restartable_server, 64, 1
    restart = KillAndRestart(server, kill_step)
    args = _config(tmp_path, server.url, max_concurrent_rollouts=4, queue_maxsize=4)
    trainer = RecordingTrainer(str(untied_qwen3_dir), text_length, args=args,
                               train_dataset=_prompts(num_prompts), callbacks=[restart])  # fmt: skip
    trainer.events, trainer.pushes = [], []
    recorder = StepRecorder(trainer)
    trainer.train()
    restart.thread.join(timeout=300)
    assert not restart.errors, restart.errors
    assert len(recorder.steps) > kill_step + 1
    _check_nothing_lost(trainer, recorder, num_prompts)
    _check_versions(trainer, recorder, kill_step)
    totals = rollout_totals(trainer.events)
    assert totals["rollout/server_restarts_total"] == 1
    states = [event.state for kind, event in trainer.events if kind == "server"]
    assert states[:1] == ["down"] and "resync" in states and states[-1] == "serving", states
    _check_serves_trainer_weights(trainer, server, untied_qwen3_dir)


class StopAfterRejoin(TrainerCallback):
    """Ends the run two steps after the restarted server generated again (so the run outlasts its start)."""

    def __init__(self, restart: KillAndRestart, trainer) -> None:
        self.restart, self.trainer, self.stop_at = restart, trainer, None
        self.requests_after_rejoin = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        if self.restart.errors:  # the server did not come back: the test reports why
            control.should_training_stop = True
            return
        back = self.restart.thread is not None and not self.restart.thread.is_alive()
        if back and self.stop_at is None:
            self.requests_after_rejoin = _successful_requests(self.restart.server.url)
            if self.requests_after_rejoin >= self.trainer.args.num_generations:  # a whole group, at least
                self.stop_at = state.global_step + 2
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True


def test_with_two_servers_one_killed_mid_run_the_other_carries_it_and_the_restarted_one_rejoins(
    training_server, restartable_server, untied_qwen3_dir, tmp_path, caplog
):
    a, b, kill_step = training_server, restartable_server, 2
    restart = KillAndRestart(b, kill_step)
    args = _config(tmp_path, [a.url, b.url], num_train_epochs=1000, sync_parity_probe_tokens=0)
    trainer = RecordingTrainer(str(untied_qwen3_dir), text_length, args=args,
                               train_dataset=_prompts(8), callbacks=[restart])  # fmt: skip
    trainer.events, trainer.pushes = [], []
    stop = StopAfterRejoin(restart, trainer)
    trainer.add_callback(stop)
    recorder = StepRecorder(trainer)
    with caplog.at_level(logging.WARNING, logger="agrpo_sync"):
        trainer.train()
    assert not restart.errors, restart.errors
    assert stop.stop_at is not None, "the run ended before the restarted server generated again"
    # With the probe off, every completion B's new process served came from the rollout loop, and the loop
    # sends B a group only once its weight label shows the published version: B rejoined after a re-sync.
    assert stop.requests_after_rejoin >= args.num_generations
    served_by = [members for _, members in trainer.pushes]
    assert served_by[0] == [0, 1] and [0] in served_by and served_by[-1] == [0, 1], served_by
    killed_at = served_by.index([0])
    assert all(members == [0] for members in served_by[killed_at : served_by.index([0, 1], killed_at)])
    totals = rollout_totals(trainer.events)
    assert totals["rollout/server_restarts_total"] == 1
    # B is rejoined by whichever comes first: the next regular push (it reads B's label `default` and sends B
    # every weight) or, when the rollout side reads the label first, a push brought forward (`resync`).
    events = [(event.index, event.state) for kind, event in trainer.events if kind == "server"]
    assert events[0] == (1, "down") and events[-1] == (1, "serving"), events
    assert set(events[1:-1]) <= {(1, "resync")}, events
    # (the roster names the rejoin whether it read B's new label or, B still starting, none)
    assert "rejoining it, and this sync sends it every weight" in caplog.text or (1, "resync") in events
    assert all(index == 1 for index, _ in events), "server A never left rotation"
    steps_while_down = len(recorder.steps) - kill_step
    assert steps_while_down > 2, "A carried the run while B was down"
    for server in (a, b):
        _check_serves_trainer_weights(trainer, server, untied_qwen3_dir)

"""The rollout process (SPEC F-PROC), against the real CPU vLLM server: what crosses the boundary is checked
at train(), a worker that raises, is killed or goes silent stops training within a bounded time with its
traceback or exit code, and train() leaves no child process behind either way."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import psutil
import pytest
from datasets import Dataset
from rollout_doubles import BlockingLoop, EnvironmentReportingLoop, exploding_reward, put_and_flush

from agrpo_trainer import AsyncGRPOConfig, AsyncGRPOTrainer, RolloutWorkerError
from agrpo_trainer.rewards import CharacterFractionReward

PROMPTS = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(16)])


def config(tmp_path, url="http://127.0.0.1:9", **overrides) -> AsyncGRPOConfig:
    """A small CPU run: fp32 on both sides, disk sync, fixed-count rows of 8 samples."""
    settings = dict(
        output_dir=str(tmp_path / "run"), vllm_server_base_url=url, weight_sync_backend="disk", bf16=False,
        use_cpu=True, learning_rate=1e-3, num_generations=4, max_completion_length=12,
        per_device_train_batch_size=8, token_budget=0, save_strategy="no", report_to="none", max_steps=3,
        activation_checkpointing=False, disable_tqdm=True, rollout_worker_timeout=60.0,
    )  # fmt: skip
    settings.update(overrides)
    return AsyncGRPOConfig(**settings)


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def outer_helper(text: str) -> str:
    """A module-level function is fine as a tool."""
    return text


def test_lambdas_and_closures_fail_at_train_naming_the_object_and_the_fix(untied_qwen3_dir, tmp_path):
    before = children()
    scale = 2.0

    def closure_tool(x: int) -> int:
        """Doubles x.

        Args:
            x: a number
        """
        return int(x * scale)

    cases = [
        ({"reward_funcs": lambda completions, **kw: [0.0] * len(completions)}, r"reward_funcs\[0\] '.*<lambda>'"),
        ({"reward_funcs": CharacterFractionReward(), "tools": [outer_helper, closure_tool]}, r"tools\[1\] '.*closure_tool'"),
        ({"reward_funcs": CharacterFractionReward(), "environment_factory": lambda: None}, "environment_factory '.*<lambda>'"),
    ]  # fmt: skip
    for kwargs, name in cases:
        trainer = AsyncGRPOTrainer(untied_qwen3_dir, args=config(tmp_path), train_dataset=PROMPTS, **kwargs)
        with pytest.raises(TypeError, match=name + r".*(module level|module-level)"):
            trainer.train()
    assert children() == before


def _train_expecting_failure(trainer) -> tuple[RolloutWorkerError, float]:
    start = time.monotonic()
    with pytest.raises(RolloutWorkerError) as error:
        trainer.train()
    return error.value, time.monotonic() - start


@pytest.mark.server
def test_a_reward_function_that_raises_stops_training_with_its_traceback(
    training_server, untied_qwen3_dir, tmp_path
):
    before = children()
    args = config(tmp_path, training_server.url)
    trainer = AsyncGRPOTrainer(untied_qwen3_dir, exploding_reward, args=args, train_dataset=PROMPTS)
    error, _ = _train_expecting_failure(trainer)
    assert "exploding_reward: the reward function itself failed on purpose" in str(error)
    assert "Traceback" in str(error)
    assert children() == before


@pytest.mark.server
def test_a_worker_killed_mid_run_stops_training_within_seconds(training_server, untied_qwen3_dir, tmp_path):
    before = children()
    args = config(tmp_path, training_server.url, max_steps=1000)
    trainer = AsyncGRPOTrainer(untied_qwen3_dir, CharacterFractionReward(), args=args, train_dataset=PROMPTS)
    killed_at = []

    def kill_after_two_steps():
        while trainer.state.global_step < 2 or trainer._pipeline is None:
            time.sleep(0.1)
        os.kill(trainer._pipeline.source.process.pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    threading.Thread(target=kill_after_two_steps, daemon=True).start()
    with pytest.raises(RolloutWorkerError, match="killed by signal 9"):
        trainer.train()
    assert killed_at and time.monotonic() - killed_at[0] < 30
    assert children() == before


@pytest.mark.server
def test_a_worker_whose_event_loop_blocks_times_out(training_server, untied_qwen3_dir, tmp_path):
    class BlockingTrainer(AsyncGRPOTrainer):
        loop_cls = BlockingLoop

    before = children()
    args = config(tmp_path, training_server.url, rollout_worker_timeout=4.0)
    trainer = BlockingTrainer(untied_qwen3_dir, CharacterFractionReward(), args=args, train_dataset=PROMPTS)
    error, elapsed = _train_expecting_failure(trainer)
    assert "no heartbeat from the rollout process" in str(error) and "rollout_worker_timeout=4" in str(error)
    assert elapsed < 120
    assert children() == before


@pytest.mark.server
def test_the_worker_sees_no_gpu_and_no_distributed_rank(
    training_server, untied_qwen3_dir, tmp_path, monkeypatch
):
    class ReportingTrainer(AsyncGRPOTrainer):
        loop_cls = EnvironmentReportingLoop

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "parent-run")
    monkeypatch.setenv("MASTER_PORT", "29999")
    args = config(tmp_path, training_server.url)
    trainer = ReportingTrainer(untied_qwen3_dir, CharacterFractionReward(), args=args, train_dataset=PROMPTS)
    error, _ = _train_expecting_failure(trainer)
    assert "'CUDA_VISIBLE_DEVICES': ''" in str(error)
    assert "'MASTER_PORT': None" in str(error) and "'TORCHELASTIC_RUN_ID': None" in str(error)
    assert os.environ["MASTER_PORT"] == "29999"  # the parent's own environment is untouched


def test_a_worker_flushes_its_queues_at_exit_only_while_its_trainer_listens():
    """A worker's exit hands what is queued to the pipe, but gives up once `stop` is set: multiprocessing
    joins a queue's feeder without a limit, and a feeder blocked on a full pipe whose reader was SIGKILLed
    never returns (a killed run's worker outlived its trainer that way, in test_resume under load)."""
    ctx = multiprocessing.get_context("spawn")
    for trainer_reads in (True, False):
        channel, stop = ctx.Queue(), ctx.Event()
        worker = ctx.Process(target=put_and_flush, args=(channel, stop, 1 << 20), daemon=True)
        worker.start()  # it queues more than a pipe holds
        try:
            if trainer_reads:
                assert len(channel.get(timeout=60)) == 1 << 20
            else:
                worker.join(2.0)
                assert worker.is_alive()  # waiting for a reader, as a worker whose trainer is busy must
                stop.set()  # what `watch_parent` does once the trainer is gone
            worker.join(30)
            assert worker.exitcode == 0, f"trainer reads: {trainer_reads}, exit code {worker.exitcode}"
        finally:
            worker.kill()
            channel.close()

"""What a run logs (SPEC F-MET) and where it goes, from one short real training against the CPU vLLM server.

The run calls a tool of an environment on every rollout (`ToolCallingLoop`, `Counter`), so the `tools/`
and `env/` metrics exist too; it reports to tensorboard, trackio and wandb (offline), prints completions,
saves a checkpoint and carries a recording callback. Each test reads one thing back from it:

- every metric the reference lists is logged under its name, and the names beyond the reference are
  exactly the ones listed here (growing the set is a reviewed decision);
- the numbers mean what the reference says (steps are optimizer steps; the batch hierarchy adds up);
- the tensorboard event file, the local trackio store and the offline wandb run hold the logged values;
- `TrainerCallback`s see `on_step_end`, `on_log` and `on_save` as under transformers;
- `log_completions` printed a table per logging step; `report.html` holds the logged curves.
"""

from __future__ import annotations

import io
import json
import math
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from report_reader import read_curves
from rich.console import Console
from rollout_doubles import Counter, ToolCallingTrainer, rank_reward
from transformers import TrainerCallback
from wandb_reader import read_history

from agrpo_trainer import AsyncGRPOConfig
from agrpo_trainer._completions import CompletionLog

# The reference's metric tables ("記録されたメトリクス"), as data. <name>: each tool; <func>: each reward source.
REFERENCE_METRICS = (
    "rollout/duration_s", "rollout/generated_tok_s", "rollout/concurrency", "rollout/turns_mean",
    "rollout/turns_max", "rollout/samples_per_rollout", "rollout/fork_frac", "rollout/drift_tokens_mean",
    "rollout/drift_tokens_max", "rollout/score_queue_size", "rollout/score_s", "rollout/score_wait_s",
    "rollout/score_block_s", "rollout/vllm_retry_total", "rollout/backpressure_s", "rollout/concurrency_cap",
    "rollout/kv_cache_usage", "rollout/vllm_running_requests", "rollout/vllm_queued_requests",
    "rollout/vllm_preemptions_total", "rollout/window_frac_reward_zero_std", "rollout/window_reward_kept", "reward",
    "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
    "tools/call_frequency", "tools/failure_frequency", "tools/latency_s", "tools/<name>/latency_s",
    "tools/<name>/call_total", "tools/<name>/failure_total", "tools/unknown_name_total",
    "tools/parallel_calls_mean", "tools/loop_exhausted_frac",
    "env/reset_s", "env/reward_s",
    "sample/forwarded_tokens_mean", "sample/forwarded_tokens_max", "sample/trained_tokens_mean",
    "sample/rollout_queue_size", "sample/time_in_queue_s", "sample/staleness_mean", "sample/staleness_max",
    "sample/dropped_stale_total",
    "reward_group_std", "rewards/<func>/mean", "rewards/<func>/group_std",
    "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/max", "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max", "num_tokens", "sampling/masked_mean", "sampling/sampler_mass",
    "batch/forwarded_tokens_per_step", "batch/trained_tokens_per_step", "batch/samples_per_step",
    "batch/groups_per_step", "batch/microbatches_per_step", "batch/masked_token_frac", "batch/samples_per_row",
    "batch/row_tokens_mean", "batch/row_tokens_max", "batch/row_fill_frac", "batch/row_imbalance",
    "batch/packing_ratio", "batch/pad_frac", "batch/dropped_oversize_total",
    "perf/step_s", "perf/fwd_bwd_s", "perf/fwd_s", "perf/optimizer_s", "perf/rollout_wait_s",
    "perf/weight_sync_s", "perf/weight_sync_pause_s", "perf/weight_sync_barrier_s", "perf/weight_sync_transfer_s",
    "perf/forwarded_tok_s_fwd_bwd", "perf/forwarded_tok_s_wall_clock", "perf/trained_tok_s_wall_clock",
    "perf/mfu_fwd_bwd", "perf/mfu_wall_clock",
)  # fmt: skip

# Logged beyond the reference, each for a reason the package README gives.
BEYOND_REFERENCE = {
    "loss", "grad_norm", "learning_rate", "epoch",  # the Trainer's own
    "rollout/window_reward",  # the reference's `reward` (every scored group of the rollout window)
    "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",  # GRPO's loss statistics
    "sync/logprob_max_abs_diff", "sync/logprob_mean_abs_diff",  # the post-sync parity probe
    "perf/weight_sync_stage_s", "perf/weight_sync_generation_paused_s", "perf/weight_sync_retries",
    "perf/pack_s", "perf/pack_overlap_frac",  # the packing thread, and how much of it forward+backward hides
    "rollout/prompt_too_long_total", "rollout/groups_stale_total", "rollout/rewards_nonfinite_total",
    "tools/parse_failure_total", "batch/row_tokens_min",
    "rollout/servers_serving", "rollout/server_restarts_total", "rollout/groups_redispatched_total",  # restarts
    "rollout/server_paused_s",  # a server held by /pause (a killed trainer's sync), named within seconds
    "sample/wasted_token_frac",  # generated tokens dropped untrained (stale, oversize) per trained token
    "rollout/groups_cancelled_total",  # in-flight groups aborted once they could no longer be trained
}  # fmt: skip
# Deliberate differences from the reference: `reward` is the mean reward of the rollouts each optimizer step
# trained, so it is logged every step; the rollout side's window values (the reference's `reward`,
# `reward_kept`, `frac_reward_zero_std`) are `rollout/window_*`, since they arrive on their own clock; `perf/mfu_*` are logged here because the run gives
# `device_peak_flops` (a CPU has no known peak: without it they are left out, as the reference says);
# every `*_total` is a count within its logging window (the reference's wording for preemptions).

TOOL, REWARD_SOURCES = "increment", ("rank_reward", "Counter")
STEPS, SAVE_STEPS, SHOWN = 3, 2, 2
PROMPTS = [{"prompt": [{"role": "user", "content": f"Count item {i}."}]} for i in range(8)]


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.events: list[tuple[str, int, dict]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step, {}))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", state.global_step, dict(logs or {})))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step, {}))


@dataclass
class LoggedRun:
    history: list[dict]
    """`log_history` without the Trainer's closing summary."""
    recorder: Recorder
    printed: str
    out: Path
    args: AsyncGRPOConfig


@pytest.fixture(scope="module")
def run(training_server, untied_qwen3_dir, tmp_path_factory) -> LoggedRun:
    out = tmp_path_factory.mktemp("logged")
    args = AsyncGRPOConfig(
        output_dir=str(out / "run"), run_name="logged", vllm_server_base_url=training_server.url,
        weight_sync_backend="disk", use_cpu=True, bf16=False, activation_checkpointing=False, learning_rate=1e-4,
        num_generations=4, max_completion_length=48, per_device_train_batch_size=8, token_budget=0,
        max_steps=STEPS, save_steps=SAVE_STEPS, report_to=["tensorboard", "trackio", "wandb"], disable_tqdm=True,
        log_completions=True, num_completions_to_print=SHOWN, device_peak_flops=1e12, rollout_worker_timeout=12,
    )  # fmt: skip
    recorder, printed = Recorder(), io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the demo does: the CPU server's worker holds one of the two cores
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRACKIO_DIR", str(out / "trackio"))
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_DIR", str(out))
        env.setenv("WANDB_SILENT", "true")
        trainer = ToolCallingTrainer(str(untied_qwen3_dir), rank_reward, args=args, train_dataset=PROMPTS,
                                     environment_factory=Counter, callbacks=[recorder])  # fmt: skip
        log = next(c for c in trainer.callback_handler.callbacks if isinstance(c, CompletionLog))
        log.console = Console(file=printed, width=200)
        trainer.train()
        import wandb

        wandb.finish()  # what a script's exit does; the Trainer's callback leaves the run open
    torch.set_num_threads(threads)
    history = [h for h in trainer.state.log_history if "train_runtime" not in h]
    return LoggedRun(history, recorder, printed.getvalue(), out, args)


def _expand(name: str) -> list[str]:
    if "<name>" in name:
        return [name.replace("<name>", TOOL)]
    if "<func>" in name:
        return [name.replace("<func>", source) for source in REWARD_SOURCES]
    return [name]


def _series(run: LoggedRun, name: str) -> list[float]:
    return [h[name] for h in run.history if name in h]


@pytest.mark.server
def test_every_reference_metric_is_logged_and_the_extras_are_named(run):
    logged = {k for h in run.history for k in h} - {"step"}
    expected = {n for name in REFERENCE_METRICS for n in _expand(name)}
    assert not expected - logged, f"reference metrics not logged: {sorted(expected - logged)}"
    assert logged - expected == BEYOND_REFERENCE, (
        f"unlisted names: {sorted(logged - expected - BEYOND_REFERENCE)}"
    )
    assert [h["step"] for h in run.history] == list(range(1, STEPS + 1)), "one log per optimizer step"
    assert all("reward" in h for h in run.history), "the trained reward on every optimizer step"


@pytest.mark.server
def test_the_numbers_mean_what_the_reference_says(run):
    for h in run.history:
        assert h["batch/microbatches_per_step"] == run.args.gradient_accumulation_steps, "counted, per step"
        row_slots = run.args.gradient_accumulation_steps * 1  # x world_size
        assert h["batch/samples_per_step"] == pytest.approx(row_slots * h["batch/samples_per_row"])
        assert h["batch/forwarded_tokens_per_step"] == pytest.approx(row_slots * h["batch/row_tokens_mean"])
        assert h["perf/fwd_s"] < h["perf/fwd_bwd_s"] < h["perf/step_s"]
        assert 0 < h["perf/mfu_wall_clock"] < h["perf/mfu_fwd_bwd"] < 1
        assert h["sample/staleness_max"] <= run.args.max_staleness
    tokens = _series(run, "batch/forwarded_tokens_per_step")
    assert _series(run, "num_tokens") == [sum(tokens[: i + 1]) for i in range(len(tokens))], (
        "since training began"
    )
    assert all(v == 7.0 for v in _series(run, "rewards/Counter/mean")), "4 + the tool's increment of 3"
    assert all(v == 1.0 for v in _series(run, "tools/call_frequency")), "one call per rollout"
    calls = _series(run, f"tools/{TOOL}/call_total")
    assert calls and all(v >= 0 for v in calls) and sum(calls) > 0, "calls counted within each window"


@pytest.mark.server
def test_tensorboard_event_file_holds_the_logged_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (run.out / "run" / "runs").rglob("events.out.tfevents.*")
    board = EventAccumulator(str(events)).Reload()
    for name in ("reward", "kl", "rollout/concurrency_cap", "perf/mfu_fwd_bwd", "rewards/rank_reward/mean"):
        scalars = board.Scalars(f"train/{name}")
        assert [s.step for s in scalars] == [h["step"] for h in run.history if name in h]
        assert [s.value for s in scalars] == pytest.approx(_series(run, name), rel=1e-6)


@pytest.mark.server
def test_the_local_trackio_store_holds_the_run(run):
    (database,) = (run.out / "trackio").rglob("*.db")
    with sqlite3.connect(database) as db:
        rows = [json.loads(metrics) for (metrics,) in db.execute("SELECT metrics FROM metrics ORDER BY id")]
    _check_logged_rows(run, rows)


def _check_logged_rows(run: LoggedRun, rows: list[dict]) -> None:
    """A logger's rows (keys `train/<name>`, `train/global_step`) hold each optimizer step's values."""
    logged = {row["train/global_step"]: row for row in rows if "train/loss" in row}
    assert sorted(logged) == [h["step"] for h in run.history]
    for h in run.history:
        for name in ("loss", "sample/staleness_max", "perf/mfu_fwd_bwd", "reward"):
            assert logged[h["step"]].get(f"train/{name}") == (pytest.approx(h[name]) if name in h else None)


@pytest.mark.server
def test_the_offline_wandb_run_holds_the_logged_rows(run):
    (run_dir,) = (run.out / "wandb").glob("offline-run-*")
    _check_logged_rows(run, read_history(run_dir))


@pytest.mark.server
def test_callbacks_receive_step_end_log_and_save_as_in_transformers(run):
    events = run.recorder.events
    assert [s for kind, s, _ in events if kind == "step_end"] == list(range(1, STEPS + 1))
    assert [s for kind, s, _ in events if kind == "save"] == [2, 3], "every save_steps, and at the last step"
    assert (run.out / "run" / f"checkpoint-{SAVE_STEPS}" / "rollout_state.json").exists()
    logs = [(s, logs) for kind, s, logs in events if kind == "log" and "loss" in logs]
    assert [s for s, _ in logs] == list(range(1, STEPS + 1)), "on_log once per optimizer step"
    assert all(math.isfinite(logs["perf/step_s"]) and "batch/samples_per_step" in logs for _, logs in logs)
    assert any("rollout/window_reward" in logs and "rollout/concurrency_cap" in logs for _, logs in logs), "rollout side too"


@pytest.mark.server
def test_log_completions_prints_a_table_per_log_with_reward_and_advantage(run):
    tables = run.printed.split("completions")[1:]
    assert len(tables) == STEPS, run.printed[-2000:]
    for table in tables:
        assert "reward" in table and "advantage" in table and "Count item" in table
        assert sum(line.startswith("├") for line in table.splitlines()) == SHOWN - 1, "a rule between rows"


@pytest.mark.server
def test_the_report_holds_the_logged_curves(run):
    curves = read_curves(run.out / "run" / "report.html")
    for name in ("reward", "reward_group_std", "kl", "sampling/importance_sampling_ratio/max",
                 "perf/forwarded_tok_s_wall_clock", "rollout/concurrency_cap", "rollout/kv_cache_usage",
                 "perf/weight_sync_s"):  # fmt: skip
        steps, values = curves[name]
        assert steps == [h["step"] for h in run.history if name in h]
        assert values == pytest.approx(_series(run, name))

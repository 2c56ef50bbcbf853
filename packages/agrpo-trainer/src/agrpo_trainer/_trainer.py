"""`AsyncGRPOTrainer`: `transformers.Trainer` whose batches are packed GRPO rows streamed from a rollout process.

The flow of one run, as the reference describes it (every arrow names its module):

    train()                      resume point from rollout_state.json (_checkpoint)
    on_train_begin               PolicySync.start + first push (_policy_sync); AsyncPipeline.start (_pipeline):
                                 RolloutProcess (spawned, CPU) -> MicroBatchStream (packing thread)
    get_batch_samples            the step's micro-batches from rank 0's pipeline, one PackedRow per rank,
                                 and the step's trained-token count N (_step normalises by it); a re-sync first
    compute_loss                 the row and its tree plan on the device (_device_row: pinned, non-blocking
                                 copies); micro_batch_loss: tree-attention scores -> grpo_loss (_loss) -> sum / N
    (Trainer)                    backward, clipping, optimizer and scheduler from TrainingArguments
    on_step_end                  settle the step's prompts (_prompt_ledger), every weight_sync_steps a push
                                 whose version the rollout process sees only once it is served, epoch stop
    _save_checkpoint             rollout_state.json beside the Trainer's own files

Owns the wiring and the Trainer overrides; the mechanisms live in the modules named above. Ranks: rank 0
owns the rollout process and the packing thread and scatters each rank its row; every rank joins weight
sync (FSDP2 gathers) and the parity probe's forward.
A server that restarted (reported `resync` by the rollout side, checked by rank 0, decided with the
step's rows) is re-synced by a push brought forward: every rank pushes the next version to every server.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch
from transformers import PreTrainedModel, Trainer
from transformers.trainer_callback import ProgressCallback

from agrpo_rollout import AsyncRolloutLoop

from ._checkpoint import (
    noted_save_failure,
    read_rollout_state,
    resolve_checkpoint,
    save_dtype_state_dict,
    write_rollout_state,
)
from ._completions import CompletionLog
from ._config import AsyncGRPOConfig, check_inputs, dataset_size
from ._device_row import prepare_device_row
from ._dispatch_hold import DispatchHold
from ._flops import ModelFlops, flop_counting
from ._layer_region import LayerRegions
from ._loss import LossStats
from ._metrics import MetricWindow
from ._micro_batch_stream import PackedMicroBatch, empty_micro_batch
from ._model import check_server_routes, enable_tree, prepare_policy, router_aux_loss_coef
from ._parity_probe import probe_token_ids
from ._pipeline import AsyncPipeline, ResumePoint
from ._policy_sync import PolicySync, served_max_model_len
from ._progress import TrainingProgress
from ._ranks import rank_world, scatter, share
from ._report import RunReport
from ._rollout_handoff import LoopSettings, RolloutHandoff, pickle_handoff
from ._rollout_process import RolloutProcess, warn_cpu_rewards
from ._step import StepSettings, micro_batch_loss
from ._step_guard import EmptyStepGuard
from ._step_metrics import StepClock, all_ranks, step_metrics

logger = logging.getLogger("agrpo_trainer")


class _Loader:
    """What the Trainer iterates: nothing; `get_batch_samples` reads the pipeline instead."""

    def __iter__(self):
        while True:
            yield None


class _PipelineCallback:
    """Hooks the pipeline into the Trainer's loop (a duck-typed TrainerCallback)."""

    def __init__(self, trainer: AsyncGRPOTrainer) -> None:
        self.trainer = trainer

    def __getattr__(self, name: str):  # every other event: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._start_pipeline()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._clock.optimizer_started()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._clock.optimizer_finished()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._finish_step(control)


class AsyncGRPOTrainer(Trainer):
    """Asynchronous GRPO (SPEC F-API): the reference's constructor; `loop_cls` customises the rollout loop."""

    loop_cls: type = AsyncRolloutLoop

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Any = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
        tools: list | None = None,
        environment_factory: Any = None,
    ) -> None:
        args = args if args is not None else AsyncGRPOConfig(output_dir=f"{_short_name(model)}-AsyncGRPO")
        check_inputs(args, train_dataset, environment_factory)
        policy, tokenizer, self.attention_backend = prepare_policy(model, args, peft_config, processing_class)
        self.reward_funcs = _as_list(reward_funcs)
        self.tools, self.environment_factory = list(tools or []), environment_factory
        self.prompt_dataset = train_dataset
        super().__init__(
            model=policy, args=args, processing_class=tokenizer, callbacks=callbacks, optimizers=optimizers
        )
        self.loss_is_scaled_for_ga = self.model_accepts_loss_kwargs = True  # _step normalises by step tokens
        self.step_settings = _step_settings(args, policy)
        self._install_callbacks()
        self._pipeline: AsyncPipeline | None = None
        self._policy_sync: PolicySync | None = None
        self._resume, self._clock, self._window = ResumePoint(), StepClock(), MetricWindow()
        self._step_batches: list[PackedMicroBatch] = []
        self._step_stats = LossStats.empty()
        self._empty_steps = EmptyStepGuard()
        self.last_step_samples: list = []
        """The `RolloutSample`s the last optimizer step trained (rank 0), for callbacks."""
        self.last_step_prompts: list[tuple[int, int]] = []
        """Their prompts as run-wide (epoch, row_index) keys, resumes included (rank 0)."""

    def _install_callbacks(self) -> None:
        """The live bar, the end-of-run report, the pipeline hooks, then the completions table (reads theirs)."""
        if not self.args.disable_tqdm:
            self.remove_callback(ProgressCallback)
            self.add_callback(TrainingProgress())
        self.add_callback(RunReport())
        self.add_callback(_PipelineCallback(self))
        self._layer_regions = LayerRegions.for_trainer(self)  # compiled layers; checkpointing_mode="auto"
        if self.args.log_completions:
            self.add_callback(CompletionLog(self))

    # ---- the pipeline ------------------------------------------------------------------------

    def _handoff(self, *, model_name: str | None, num_processes: int) -> RolloutHandoff:
        args = self.args
        remaining = None if args.max_steps > 0 or self.prompt_dataset is None else (
            max(math.ceil(args.num_train_epochs) - self._resume.base_epoch, 1)
        )  # fmt: skip
        rollout = args.rollout_config(num_processes=num_processes, model_name=model_name, policy=self.model)
        settings = LoopSettings(rollout, args)
        return RolloutHandoff(
            loop_cls=self.loop_cls,
            settings=settings,
            tokenizer=self.processing_class,
            dataset=self.prompt_dataset,
            reward_funcs=self.reward_funcs,
            tools=self.tools,
            environment_factory=self.environment_factory,
            start_index=self._resume.start_index,
            max_epochs=remaining,
            skip_prompts=self._resume.loop_skip(),
            sync_journal=str(self._policy_sync.weight_sync.journal.path) if self._policy_sync else None,
        )

    def _make_sample_source(self, num_processes: int) -> Any:
        """The spawned rollout process (rank 0). Tests replace it with a replay of fixed samples."""
        handoff = self._handoff(model_name=self._served_model_template(), num_processes=num_processes)
        return RolloutProcess(
            handoff, queue_maxsize=self.args.queue_maxsize, worker_timeout_s=self.args.rollout_worker_timeout
        )

    def _served_model_template(self) -> str | None:
        """Under LoRA adapter sync each version is its own adapter: requests name their group's version."""
        sync = self._policy_sync
        if sync is None or sync.weight_sync.backend_name != "lora":
            return None
        return f"{sync.weight_sync.config.lora_name}-v{{version}}"

    def _start_policy_sync(self) -> PolicySync | None:
        """Weight sync to the servers (every rank). Tests without a server return None."""
        args = self.args
        tokens = args.sync_parity_probe_tokens
        return PolicySync.start(
            args.sync_config(), self.model, threshold=args.sync_parity_threshold,
            probe_ids=probe_token_ids(self.processing_class, tokens) if tokens else None,
            probe_timeout_s=min(args.vllm_server_timeout, 120.0),
        )  # fmt: skip

    def _max_model_len(self) -> int | None:
        """The server's context length, for `token_budget=None` (rank 0)."""
        return served_max_model_len(self.args.server_urls[0]) if self.args.token_budget is None else None

    def _start_pipeline(self) -> None:
        rank, world = rank_world()
        policy = self.accelerator.unwrap_model(self.model)
        self.attention_backend = enable_tree(policy, self.args.attention_backend)  # on its device now
        self._layer_regions.install(policy, router_logits=self.step_settings.router_aux_loss_coef > 0)
        self._clock.flop_model, self._clock.peak_flops = flop_counting(policy, self.args)
        check_server_routes(self.args, policy, rank, world)  # before any push: no routes, refused
        self._policy_sync = self._start_policy_sync()
        version = 0
        if self._policy_sync is not None:  # the server may hold other weights (a resume, a given model)
            self._window.add(self._policy_sync.push(self.model))
            version = self._policy_sync.version
        if rank != 0:
            return
        packing = self.args.packing_config(max_model_len=self._max_model_len(), num_ranks=world)
        self._pipeline = AsyncPipeline(
            self._make_sample_source(world),
            packing,
            max_staleness=self.args.max_staleness,
            prefetch=self.args.gradient_accumulation_steps + 1,
            resume=self._resume,
            hold=DispatchHold.for_run(self.args, world),
            max_groups_dropped_in_a_row=self.args.max_groups_dropped_in_a_row,
        )
        self._pipeline.start(version)

    def _stop_pipeline(self) -> None:
        try:
            if self._pipeline is not None:
                self._pipeline.stop()
        finally:
            self._pipeline = None
            if self._policy_sync is not None:
                self._policy_sync.close()
                self._policy_sync = None

    # ---- Trainer overrides -------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """Train until `max_steps`, or until `num_train_epochs` passes over the prompts are consumed."""
        checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        self._resume = ResumePoint.from_state(read_rollout_state(checkpoint))
        if self.is_world_process_zero():  # lambdas fail here, before any setup (SPEC F-PROC)
            pickle_handoff(self._handoff(model_name=None, num_processes=1))
            if torch.cuda.is_available():
                warn_cpu_rewards(self.reward_funcs)
        try:
            return super().train(resume_from_checkpoint=checkpoint, **kwargs)
        finally:
            self._stop_pipeline()

    def get_train_dataloader(self) -> _Loader:
        return _Loader()

    def set_initial_training_values(self, args, dataloader):
        """One Trainer "epoch" that ends when we stop it; max_steps, or a ceiling when epochs decide."""
        world = self.accelerator.num_processes
        if args.max_steps > 0:
            max_steps = args.max_steps
        else:  # a safety ceiling only: at most 32 samples per rollout, at least one sample per micro-batch
            size = len(self.prompt_dataset)
            max_steps = math.ceil(
                args.num_train_epochs * size * args.num_generations * 32 / args.gradient_accumulation_steps
            )
        batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
        return (
            1,
            max_steps,
            max_steps * batch,
            max_steps * batch,
            batch,
            max_steps * args.gradient_accumulation_steps,
            max_steps,
        )

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches: rank 0 takes them from the pipeline and scatters one row per rank; a
        re-sync a server waits for comes first (every rank pushes), then the collection goes on."""
        rank, world = rank_world()
        while True:
            payloads = self._step_payloads(num_batches, world) if rank == 0 else None
            rows, tokens, ended, resync = scatter(payloads)
            if not resync:
                break
            self._window.add(self._push())
        if ended:
            self.control.should_training_stop = True
            return [], None
        self._clock.step_started()
        return [{"row": row} for row in rows], tokens

    def _step_payloads(self, num_batches: int, world: int) -> list[tuple]:
        """Rank 0: (rows, tokens, ended, resync) per rank; only `resync` while a server must be re-synced."""
        sync = self._policy_sync
        batches = self._pipeline.take_step(num_batches, behind=sync.needs_resync if sync else lambda _: False)
        if batches is None:
            return [([], 0, False, True)] * world
        ended = not batches
        batches += [empty_micro_batch(world) for _ in range(num_batches - len(batches))] if batches else []
        self._step_batches = batches
        tokens = sum(b.num_loss_terms for b in batches)
        return [([b.rows[r] for b in batches], tokens, ended, False) for r in range(world)]

    def training_step(self, model, inputs, num_items_in_batch=None):
        with self._clock.fwd_bwd():
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        prepared = prepare_device_row(inputs["row"], model)
        with self._clock.forward():
            loss, stats = micro_batch_loss(
                model,
                prepared.row,
                self.step_settings,
                step_trained_tokens=int(num_items_in_batch or 0),
                world_size=self.accelerator.num_processes,
                micro_batches_per_step=max(self.current_gradient_accumulation_steps, 1),
                plan=prepared.plan,
            )
        self._step_stats = self._step_stats.merge(stats)
        self._clock.add_tokens(inputs["row"])
        return (loss, {}) if return_outputs else loss

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The Trainer's `total_flos`: the count `perf/mfu_*` uses (`_flops`)."""
        flops = self._clock.flop_model or ModelFlops.of(self.model)
        return int(flops.row_flops(inputs["row"]))

    def _finish_step(self, control) -> None:
        """After the optimizer step: settle prompts, sync weights, gather metrics, stop after the epochs."""
        rank, world = rank_world()
        stats = all_ranks(self._step_stats)
        metrics = step_metrics(self._step_batches, stats, self._clock)
        self._step_stats = LossStats.empty()
        self._empty_steps.check(
            stats.metrics(), self.state.global_step
        )  # every rank's terms: all raise together
        if rank == 0:
            self._pipeline.settle(self._step_batches)
            if dataset_size(self.prompt_dataset):  # epochs are passes over the prompts, not over batches
                self.state.epoch = self._pipeline.ledger.num_consumed / dataset_size(self.prompt_dataset)
            self.last_step_samples = [s for b in self._step_batches for s in b.samples]
            key = self._pipeline.ledger.key
            self.last_step_prompts = sorted({key(s.epoch, s.row_index) for s in self.last_step_samples})
            metrics.update(self._pipeline.take_metrics())
            metrics["perf/pack_overlap_frac"] = self._clock.overlap(self._pipeline.pack_intervals())
        if self._policy_sync is not None and self.state.global_step % self.args.weight_sync_steps == 0:
            metrics.update(self._push())
        self._window.add(metrics)
        done = rank == 0 and self._pipeline.ledger.num_consumed >= self.args.target_prompts(
            dataset_size(self.prompt_dataset)
        )
        if share(done):
            control.should_training_stop = True

    def _push(self) -> dict[str, float]:
        """The next version to every server (every rank), published to the rollout side once served."""
        metrics = self._policy_sync.push(self.model)
        if rank_world()[0] == 0:
            self._pipeline.set_version(self._policy_sync.version)
        return metrics

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log({**self._window.reduce(), **logs}, start_time)

    def _save_checkpoint(self, model, trial) -> None:
        with noted_save_failure(self.args.output_dir, self.state.global_step):  # names what a failure left
            if self.is_world_process_zero() and self._pipeline is not None:
                self._pipeline.poll()  # outcomes of groups whose samples this step trained may still be queued
                write_rollout_state(
                    self.args.output_dir, self.state.global_step, self._pipeline.ledger.resume_state()
                )
            super()._save_checkpoint(model, trial)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, save_dtype_state_dict(self, state_dict))


def _as_list(reward_funcs: Any) -> list:
    return reward_funcs if isinstance(reward_funcs, list) else [f for f in [reward_funcs] if f]


def _short_name(model: Any) -> str:
    if isinstance(model, str | os.PathLike):
        name = os.fspath(model)
    else:
        name = str(getattr(model, "name_or_path", "") or "model")
    return name.rstrip("/").split("/")[-1]


def _step_settings(args: AsyncGRPOConfig, policy: torch.nn.Module) -> StepSettings:
    return StepSettings(
        loss=args.loss_settings(),
        temperature=args.temperature,
        router_aux_loss_coef=router_aux_loss_coef(policy, args.router_aux_loss_coef),
        truncated_sampling=args.top_k > 0 or args.top_p < 1.0 or bool(args.min_p),
    )

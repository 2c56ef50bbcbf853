"""`AsyncGRPOConfig`: every setting of the trainer, as `transformers.TrainingArguments` plus the reference's fields.

Owns the fields, their defaults (the reference's, including its changed `TrainingArguments` defaults: SPEC
F-API), the checks that fail at construction with the field to change, and the translation into the
four libraries' own configs (`rollout_config`, `packing_config`, `sync_config`, `loss_settings`), which
it builds and never rewrites. Does not know the server (values that need it, such as `max_model_len`,
are passed in) nor how many processes run (`num_processes` is passed in).

Beyond the reference, agrpo adds a few fields, grouped last and marked "agrpo:": the weight-sync
backend (`disk` for CPU servers and shared filesystems), the tree-attention backend, the post-sync
parity probe (SPEC F-BEYOND), a tool-call timeout, the device peak that MFU divides by where the
device table lacks it, and the activation checkpointing mode. `torch_compile` (TrainingArguments')
compiles per decoder layer when on (opt-in for now, see its help). `vllm_server_base_url` (the reference's) also takes a
list of servers (SPEC F-BEYOND); on the command line, `--vllm_server_base_url URL [URL ...]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from transformers import TrainingArguments

from agrpo_packing import PackingConfig
from agrpo_rollout import RolloutConfig
from agrpo_sync import WeightSyncConfig

from ._layer_region import (
    check_checkpointing_mode,
    checkpointing_on,
    default_torch_compile,
    fsdp_compile_notice,
)
from ._loss import LossSettings

# Decaying schedules need a known horizon; forks make the number of steps per epoch unknown (reference).
_HORIZON_FREE_SCHEDULES = ("constant", "constant_with_warmup")
WEIGHT_SYNC_BACKENDS = ("nccl", "disk")


def default_bf16(*, fp16: bool) -> bool:
    """The reference's bf16 default (True unless fp16), on machines whose GPU runs bf16. Elsewhere (a CPU-only
    machine) False: transformers refuses bf16 there without use_cpu, and CPU vLLM servers serve float32."""
    return not fp16 and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class AsyncGRPOConfig(TrainingArguments):
    """Settings of `AsyncGRPOTrainer`: `TrainingArguments` with the reference's changed defaults and fields."""

    # ---- TrainingArguments defaults the reference changes ----
    logging_steps: float = field(default=1, metadata=_help("Log every X optimizer steps (reference: 1)."))
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata=_help(
            "Recompute activations in backward as needed to fit (checkpointing_mode); None: True."
        ),
    )
    torch_compile: bool | None = field(
        default=None,
        metadata=_help(
            "Compile each decoder layer (torch_compile_backend/_mode; the rest stays eager): 1.67-1.74x the "
            "trained tokens/s at packing ratios 1-8 on an H200, gradients as close to fp32 as eager's "
            "(docs/benchmarks.md). None: False for now (True when a backend or mode is named): the trainer's own "
            "compiled step failed gradient parity on a GPU (docs/benchmarks.md, 2026-12-05); the first step pays "
            "the compile (about 2 min for a 1.7B model), announced on stderr."
        ),
    )
    bf16: bool | None = field(
        default=None,
        metadata=_help(
            "bf16 mixed precision; None: True unless fp16 is set or no bf16-capable GPU is present."
        ),
    )
    learning_rate: float = field(default=1e-6, metadata=_help("Peak learning rate (reference: 1e-6)."))
    lr_scheduler_type: str = field(
        default="constant",
        metadata=_help(
            "LR schedule; decaying ones need an explicit max_steps (the step count is not known ahead)."
        ),
    )
    ignore_data_skip: bool = field(
        default=True,
        metadata=_help("Always True in effect: resume uses rollout_state.json, not batch replay."),
    )

    # ---- model ----
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata=_help("Keyword arguments of from_pretrained when `model` is a path or hub id.")
    )
    dtype: str = field(
        default="float32",
        metadata=_help(
            "dtype the weights load in: auto, bfloat16, float16 or float32; model_init_kwargs['dtype'] wins."
        ),
    )
    trust_remote_code: bool = field(
        default=False, metadata=_help("Allow custom model/tokenizer code from the hub.")
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata=_help(
            "MoE load-balancing loss weight; None: the model config's; 0 disables; error on non-MoE models."
        ),
    )
    routing_replay: bool = field(
        default=False,
        metadata=_help(
            "MoE routing replay: each token trains on the experts the sampler routed it to (rows carrying the "
            "server's routed experts; gate weights from the live router, which keeps its gradient; tokens "
            "without a route route live); error on dense models. moe/route_agreement is logged either way."
        ),
    )
    return_routed_experts: bool | None = field(
        default=None,
        metadata=_help(
            "Ask the server for each token's routed experts (vLLM started with --enable-return-routed-experts, "
            "checked at start); None: routing_replay. True with routing_replay=False logs moe/route_agreement only."
        ),
    )

    # ---- generation ----
    num_generations: int = field(default=8, metadata=_help("Rollouts per prompt (the GRPO group), >= 2."))
    max_completion_length: int = field(
        default=2048, metadata=_help("Generated tokens per rollout, summed over its turns, >= 1.")
    )
    temperature: float = field(default=1.0, metadata=_help("Sampling temperature, > 0."))
    top_p: float = field(default=1.0, metadata=_help("Nucleus mass in (0, 1]; < 1 needs top_k > 0."))
    top_k: int = field(default=0, metadata=_help("Top-k filter; 0 disables."))
    min_p: float | None = field(
        default=None, metadata=_help("Minimum relative probability in [0, 1]; needs top_k.")
    )
    repetition_penalty: float = field(
        default=1.0, metadata=_help("vLLM repetition penalty, > 0; 1 disables.")
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata=_help("Extra keyword arguments of apply_chat_template.")
    )
    max_tool_calling_iterations: int | None = field(
        default=None, metadata=_help("Most tool-calling rounds per rollout; None: no limit.")
    )

    # ---- vLLM server ----
    vllm_server_base_url: str | list[str] = field(
        default="http://localhost:8000",
        metadata=_help(
            "Root URL of the vLLM server used for generation, or several serving the same model (a flag takes "
            "them space-separated): each group goes to one, balanced by their live concurrency caps, and every "
            "weight sync goes to all."
        ),
    )
    vllm_server_timeout: float = field(
        default=1800.0,
        metadata=_help(
            "Seconds for server readiness, one generation request, one sync call, and how long the run waits "
            "while no server serves (a restart)."
        ),
    )

    # ---- training ----
    epsilon: float = field(
        default=0.2, metadata=_help("Clip low: ratios below 1 - epsilon are clipped, > 0.")
    )
    epsilon_high: float | None = field(
        default=None, metadata=_help("Clip high: ratios above 1 + epsilon_high are clipped; None: epsilon.")
    )
    score_centering: bool = field(
        default=True, metadata=_help("Subtract the score's expectation under the sampler (top-N estimate).")
    )
    vllm_importance_sampling_clip_min: float = field(
        default=0.5, metadata=_help("Tokens with policy/sampler ratio below this are excluded, in (0, 1].")
    )
    vllm_importance_sampling_clip_max: float = field(
        default=5.0, metadata=_help("Tokens with policy/sampler ratio above this are excluded, >= 1.")
    )
    num_sampler_logprobs: int = field(
        default=8,
        metadata=_help("Sampler top log-probs per generated token (score centering), <= --max-logprobs."),
    )
    token_budget: int | None = field(
        default=None,
        metadata=_help(
            "Unique tokens per row; None: the server's max_model_len; <= 0: fixed sample count per row."
        ),
    )

    # ---- async pipeline ----
    max_concurrent_rollouts: int | None = field(
        default=None,
        metadata=_help(
            "Upper bound on rollouts in flight; None: max(max_staleness, 1) * batch * accumulation * processes."
        ),
    )
    max_staleness: int = field(
        default=4, metadata=_help("Weight syncs a sample may lag the policy before it is dropped, >= 0.")
    )
    queue_maxsize: int = field(default=1024, metadata=_help("Samples buffered between the processes, >= 1."))
    weight_sync_steps: int = field(default=1, metadata=_help("Optimizer steps between weight syncs, >= 1."))
    rollout_worker_timeout: float = field(
        default=300.0, metadata=_help("Seconds without a rollout-process heartbeat before training aborts.")
    )

    # ---- logging ----
    log_completions: bool = field(default=False, metadata=_help("Log sample completions every logging step."))
    num_completions_to_print: int | None = field(
        default=None, metadata=_help("Completions printed per log; None: all of the window.")
    )

    # ---- agrpo: beyond the reference ----
    weight_sync_backend: str = field(
        default="nccl",
        metadata=_help("Full-weight sync: nccl (GPU servers) or disk (CPU servers, shared filesystems)."),
    )
    lora_sync: str = field(
        default="auto", metadata=_help("PEFT models: auto, merged or adapter (server with --enable-lora).")
    )
    attention_backend: str = field(
        default="auto",
        metadata=_help("Tree attention backend of agrpo-attention: auto, reference, flex, varlen, ..."),
    )
    sync_parity_probe_tokens: int = field(
        default=64,
        metadata=_help(
            "After each sync, the server continues a fixed prompt (this many tokens in all) and the trainer "
            "scores the same tokens; 0 disables."
        ),
    )
    sync_parity_threshold: float = field(
        default=0.5,
        metadata=_help("Warn when the probe's max |server - trainer| log-prob exceeds this (nats)."),
    )
    tool_timeout_s: float | None = field(
        default=300.0,
        metadata=_help(
            "Seconds one tool call may take before it becomes an error message to the model; None: no limit."
        ),
    )
    checkpointing_mode: str = field(
        default="auto",
        metadata=_help(
            "With gradient checkpointing: auto (full on step 1, then the least recompute its measured memory "
            "predicts to fit: none, selective or full), full, or selective (recompute the norms and the MLP, "
            "keep attention)."
        ),
    )
    device_peak_flops: float | None = field(
        default=None,
        metadata=_help(
            "Peak FLOP/s of one training device in the training precision, for perf/mfu_*; None: looked up by "
            "device name (A100, H100, H200, B200, MI300X, ...); MFU is left out when unknown (a CPU)."
        ),
    )
    max_groups_dropped_in_a_row: int = field(
        default=256,
        metadata=_help(
            "Groups in a row dropped for equal or unscorable rewards (none reaches the trainer) before the run "
            "stops with NothingTrainedError; 0: never."
        ),
    )

    def __post_init__(self) -> None:
        if self.return_routed_experts is None:
            self.return_routed_experts = self.routing_replay
        if self.routing_replay and not self.return_routed_experts:
            raise ValueError(
                "routing_replay=True replays the routes the server returns: leave return_routed_experts unset "
                "(or True)"
            )
        if self.bf16 is None:
            self.bf16 = default_bf16(fp16=self.fp16)
        if self.torch_compile is None:
            named = bool(self.torch_compile_backend or self.torch_compile_mode)
            self.torch_compile = default_torch_compile(
                use_cpu=self.use_cpu, fsdp=bool(self.fsdp), named=named
            )
            fsdp_compile_notice(use_cpu=self.use_cpu, fsdp=bool(self.fsdp), named=named)
        if self.gradient_checkpointing is None and getattr(self, "activation_checkpointing", None) is None:
            if any(f.name == "activation_checkpointing" for f in fields(self)):
                self.activation_checkpointing = True
            else:  # transformers before the activation_checkpointing rename
                self.gradient_checkpointing = True
        self._check_unsupported()  # before TrainingArguments tries to set DeepSpeed up
        super().__post_init__()
        self._check()

    # ---- checks ------------------------------------------------------------------------------

    def _check(self) -> None:
        self._check_positive()
        if not 0.0 < self.vllm_importance_sampling_clip_min <= 1.0 <= self.vllm_importance_sampling_clip_max:
            raise ValueError(
                f"vllm_importance_sampling_clip_min={self.vllm_importance_sampling_clip_min}, "
                f"vllm_importance_sampling_clip_max={self.vllm_importance_sampling_clip_max}; expected "
                "0 < min <= 1 <= max (e.g. 0.5 and 5.0)"
            )
        if self.score_centering and self.num_sampler_logprobs == 0:
            raise ValueError(
                "score_centering=True needs the sampler's top log-probs; set num_sampler_logprobs > 0 "
                "(e.g. 8) or score_centering=False"
            )
        if str(self.lr_scheduler_type.value if hasattr(self.lr_scheduler_type, "value") else self.lr_scheduler_type) \
                not in _HORIZON_FREE_SCHEDULES and self.max_steps <= 0:  # fmt: skip
            raise ValueError(
                f"lr_scheduler_type={self.lr_scheduler_type!s} decays over max_steps, but max_steps={self.max_steps}: "
                "the number of steps per epoch is not known ahead (forks). Set max_steps, or use "
                "lr_scheduler_type='constant' / 'constant_with_warmup'"
            )
        if self.weight_sync_backend not in WEIGHT_SYNC_BACKENDS:
            raise ValueError(
                f"weight_sync_backend={self.weight_sync_backend!r}; expected one of {list(WEIGHT_SYNC_BACKENDS)}"
            )
        self.rollout_config(num_processes=1)  # the sampling checks of agrpo-rollout, named by the same fields
        check_checkpointing_mode(self.checkpointing_mode, bool(checkpointing_on(self)))

    def _check_unsupported(self) -> None:
        if self.deepspeed:
            raise ValueError(
                "DeepSpeed is not supported by AsyncGRPOTrainer; remove `deepspeed` and use FSDP2: "
                "fsdp='full_shard' with fsdp_config={'fsdp_version': 2} (or accelerate's FSDP2 plugin)"
            )
        version = (self.fsdp_config or {}).get("fsdp_version", (self.fsdp_config or {}).get("version"))
        if self.fsdp and version is not None and int(version) != 2:
            raise ValueError(
                f"fsdp_config fsdp_version={version}; AsyncGRPOTrainer supports FSDP2 only: set fsdp_version=2"
            )
        parallel = self.parallelism_config
        if parallel is not None and (
            getattr(parallel, "cp_size", 1) > 1 or getattr(parallel, "sp_size", 1) > 1
        ):
            raise ValueError(
                "context/sequence parallelism is not supported (packed rows are not split); set cp_size=1 and sp_size=1"
            )

    def _check_positive(self) -> None:
        at_least = {
            "num_generations": (self.num_generations, 2),
            "max_completion_length": (self.max_completion_length, 1),
            "queue_maxsize": (self.queue_maxsize, 1),
            "weight_sync_steps": (self.weight_sync_steps, 1),
            "max_staleness": (self.max_staleness, 0),
            "num_sampler_logprobs": (self.num_sampler_logprobs, 0),
            "sync_parity_probe_tokens": (self.sync_parity_probe_tokens, 0),
            "max_groups_dropped_in_a_row": (self.max_groups_dropped_in_a_row, 0),
        }
        if self.max_concurrent_rollouts is not None:
            at_least["max_concurrent_rollouts"] = (self.max_concurrent_rollouts, 1)
        for name, (value, low) in at_least.items():
            if value < low:
                why = " (GRPO standardises rewards within a group)" if name == "num_generations" else ""
                raise ValueError(f"{name}={value}; it must be >= {low}{why}")
        positive = {
            "epsilon": self.epsilon,
            "temperature": self.temperature,
            "rollout_worker_timeout": self.rollout_worker_timeout,
            "vllm_server_timeout": self.vllm_server_timeout,
        }
        for name in ("epsilon_high", "device_peak_flops"):
            if getattr(self, name) is not None:
                positive[name] = getattr(self, name)
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name}={value}; it must be > 0")

    # ---- what the four libraries get ---------------------------------------------------------

    @property
    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def concurrency_bound(self, num_processes: int) -> int:
        """`max_concurrent_rollouts`, or the reference's formula: the samples the trainer can consume before
        they go stale."""
        if self.max_concurrent_rollouts is not None:
            return self.max_concurrent_rollouts
        accumulation = self.gradient_accumulation_steps
        return max(self.max_staleness, 1) * self.per_device_train_batch_size * accumulation * num_processes

    def rollout_config(
        self, *, num_processes: int, model_name: str | None = None, policy=None
    ) -> RolloutConfig:
        """The rollout loop's settings; with `return_routed_experts`, routes are asked for once the trainer hands
        its `policy`, whose config the route shapes are checked against."""
        model_config = (
            routes_model_config(policy) if policy is not None and self.return_routed_experts else None
        )
        template_kwargs = self.chat_template_kwargs if isinstance(self.chat_template_kwargs, dict) else None
        return RolloutConfig(
            vllm_server_base_url=self.vllm_server_base_url,
            model_name=model_name,
            num_generations=self.num_generations,
            max_completion_length=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            chat_template_kwargs=template_kwargs,
            max_tool_calling_iterations=self.max_tool_calling_iterations,
            num_sampler_logprobs=self.num_sampler_logprobs,
            max_concurrent_rollouts=self.concurrency_bound(num_processes),
            vllm_server_timeout=self.vllm_server_timeout,
            tool_timeout_s=self.tool_timeout_s,
            # Heartbeats ride on metric pushes: several per worker timeout.
            metrics_interval_s=max(min(5.0, self.rollout_worker_timeout / 4), 0.05),
            return_routed_experts=bool(self.return_routed_experts and model_config is not None),
            model_config=model_config if self.return_routed_experts else None,
        )

    @property
    def server_urls(self) -> tuple[str, ...]:
        """`vllm_server_base_url` as a tuple of roots (one entry for one server)."""
        return self.rollout_config(num_processes=1).server_urls

    def packing_config(self, *, max_model_len: int | None, num_ranks: int) -> PackingConfig:
        return PackingConfig(
            token_budget=self.token_budget,
            num_ranks=num_ranks,
            max_model_len=max_model_len,
            per_device_train_batch_size=self.per_device_train_batch_size,
        )

    def sync_config(self, *, lora_name: str = "agrpo-policy") -> WeightSyncConfig:
        return WeightSyncConfig(
            base_url=self.vllm_server_base_url,
            output_dir=self.output_dir,
            backend=self.weight_sync_backend,
            lora_sync=self.lora_sync,
            lora_name=lora_name,
            max_staleness=self.max_staleness,
            http_timeout_s=min(60.0, self.vllm_server_timeout),
            transfer_timeout_s=self.vllm_server_timeout,
        )

    def loss_settings(self) -> LossSettings:
        return LossSettings(
            epsilon=self.epsilon,
            epsilon_high=self.resolved_epsilon_high,
            is_clip_min=self.vllm_importance_sampling_clip_min,
            is_clip_max=self.vllm_importance_sampling_clip_max,
            score_centering=self.score_centering,
        )

    def target_prompts(self, dataset_size: int | None) -> float:
        """Distinct prompts to consume for `num_train_epochs`; inf when `max_steps` decides or size is unknown."""
        if self.max_steps > 0 or not dataset_size:
            return math.inf
        return self.num_train_epochs * dataset_size


def dataset_size(dataset: Any) -> int | None:
    return len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None


def check_inputs(args: Any, train_dataset: Any, environment_factory: Any) -> None:
    """The trainer's arguments: a config of this class, and prompts it can count epochs over."""
    if not isinstance(args, AsyncGRPOConfig):
        raise TypeError(f"args is a {type(args).__name__}; pass an AsyncGRPOConfig (or a subclass)")
    if train_dataset is None and environment_factory is None:
        raise ValueError(
            "train_dataset is None: pass a dataset with a `prompt` column, or an environment_factory"
        )
    if dataset_size(train_dataset) is None and args.max_steps <= 0:
        raise ValueError(
            "num_train_epochs needs the dataset's size, and this dataset has none (an IterableDataset, or prompts "
            "from environment_factory); set max_steps"
        )


def routes_model_config(policy) -> dict:
    """The policy's (text) config as a dict, which the server's routed experts must fit (a LoRA wrapper looked
    through)."""
    inner = policy.module if isinstance(getattr(policy, "module", None), torch.nn.Module) else policy  # DDP
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return base.config.get_text_config().to_dict()

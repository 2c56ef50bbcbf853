"""AsyncGRPOConfig: the reference's fields and defaults, its changed TrainingArguments defaults, and the
combinations refused at construction with a message that names the fix."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers import TrainingArguments

from agrpo_trainer import AsyncGRPOConfig
from agrpo_trainer._config import default_bf16

# The reference's AsyncGRPOConfig signature (async-grpo-reference.ja.txt), field -> default, as data.
REFERENCE_DEFAULTS = {
    "output_dir": None, "per_device_train_batch_size": 8, "num_train_epochs": 3.0, "max_steps": -1,
    "learning_rate": 1e-06, "lr_scheduler_type": "constant", "lr_scheduler_kwargs": None, "warmup_steps": 0,
    "optim": "adamw_torch_fused", "optim_args": None, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
    "adam_epsilon": 1e-08, "optim_target_modules": None, "gradient_accumulation_steps": 1,
    "average_tokens_across_devices": True, "max_grad_norm": 1.0, "label_smoothing_factor": 0.0, "bf16": None,
    "fp16": False, "bf16_full_eval": False, "fp16_full_eval": False, "tf32": None, "gradient_checkpointing": True,
    "gradient_checkpointing_kwargs": None, "torch_compile": False, "torch_compile_backend": None,
    "torch_compile_mode": None, "use_liger_kernel": False, "liger_kernel_config": None, "use_cache": False,
    "neftune_noise_alpha": None, "torch_empty_cache_steps": None, "auto_find_batch_size": False,
    "logging_strategy": "steps", "logging_steps": 1, "logging_first_step": False, "log_on_each_node": True,
    "logging_nan_inf_filter": True, "include_num_input_tokens_seen": "no", "log_level": "passive",
    "log_level_replica": "warning", "disable_tqdm": None, "report_to": "none", "run_name": None,
    "project": "huggingface", "trackio_space_id": None, "trackio_bucket_id": None, "trackio_static_space_id": None,
    "eval_strategy": "no", "eval_steps": None, "eval_delay": 0, "per_device_eval_batch_size": 8,
    "prediction_loss_only": False, "eval_on_start": False, "eval_do_concat_batches": True,
    "eval_use_gather_object": False, "eval_accumulation_steps": None, "batch_eval_metrics": False,
    "save_only_model": False, "save_strategy": "steps", "save_steps": 500, "save_on_each_node": False,
    "save_total_limit": None, "enable_jit_checkpoint": False, "push_to_hub": False, "hub_token": None,
    "hub_private_repo": None, "hub_model_id": None, "hub_strategy": "every_save", "hub_always_push": False,
    "hub_revision": None, "load_best_model_at_end": False, "metric_for_best_model": None,
    "greater_is_better": None, "ignore_data_skip": True, "restore_callback_states_from_checkpoint": False,
    "full_determinism": False, "seed": 42, "data_seed": None, "use_cpu": False, "accelerator_config": None,
    "parallelism_config": None, "dataloader_drop_last": False, "dataloader_num_workers": 0,
    "dataloader_pin_memory": True, "dataloader_persistent_workers": False, "dataloader_prefetch_factor": None,
    "dataloader_multiprocessing_context": None, "dataloader_in_order": True, "remove_unused_columns": True,
    "label_names": None, "train_sampling_strategy": "random", "length_column_name": "length",
    "ddp_find_unused_parameters": None, "ddp_bucket_cap_mb": None, "ddp_broadcast_buffers": None,
    "ddp_static_graph": None, "ddp_backend": None, "ddp_timeout": 1800, "fsdp": None, "fsdp_config": None,
    "deepspeed": None, "debug": "", "skip_memory_metrics": True, "do_train": False, "do_eval": False,
    "do_predict": False, "resume_from_checkpoint": None, "local_rank": -1,
    "model_init_kwargs": None, "dtype": "float32", "trust_remote_code": False, "router_aux_loss_coef": None,
    "num_generations": 8, "max_completion_length": 2048, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
    "min_p": None, "repetition_penalty": 1.0, "chat_template_kwargs": None, "max_tool_calling_iterations": None,
    "vllm_server_base_url": "http://localhost:8000", "vllm_server_timeout": 1800.0, "epsilon": 0.2,
    "epsilon_high": None, "score_centering": True, "vllm_importance_sampling_clip_min": 0.5,
    "vllm_importance_sampling_clip_max": 5.0, "num_sampler_logprobs": 8, "token_budget": None,
    "max_concurrent_rollouts": None, "max_staleness": 4, "queue_maxsize": 1024, "weight_sync_steps": 1,
    "rollout_worker_timeout": 300.0, "log_completions": False, "num_completions_to_print": None,
}  # fmt: skip

# Declared defaults that differ on purpose: None means "resolved at construction" (checked below).
RESOLVED_AT_CONSTRUCTION = {"gradient_checkpointing", "torch_compile"}

# Fields agrpo adds beyond the reference (SPEC F-BEYOND); freezing them makes growing the surface a decision.
AGRPO_FIELDS = {
    "weight_sync_backend": "nccl",
    "lora_sync": "auto",
    "attention_backend": "auto",
    "sync_parity_probe_tokens": 64,
    "sync_parity_threshold": 0.5,
    "tool_timeout_s": 300.0,
    "checkpointing_mode": "auto",
    "device_peak_flops": None,
    "routing_replay": False,
    "return_routed_experts": None,
    "max_groups_dropped_in_a_row": 256,
}


def _declared_defaults() -> dict:
    out = {}
    for f in dataclasses.fields(AsyncGRPOConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = "<factory>"
    return out


def _plain(value):
    return getattr(value, "value", value)


def test_every_reference_field_exists_with_the_reference_default():
    declared = _declared_defaults()
    missing = sorted(set(REFERENCE_DEFAULTS) - set(declared))
    assert not missing, f"fields of the reference missing from AsyncGRPOConfig: {missing}"
    wrong = {
        name: (declared[name], expected)
        for name, expected in REFERENCE_DEFAULTS.items()
        if name not in RESOLVED_AT_CONSTRUCTION and _plain(declared[name]) != expected
    }
    assert not wrong, f"defaults that differ from the reference (ours, reference): {wrong}"


def test_the_surface_beyond_the_reference_is_frozen():
    ours = set(_declared_defaults()) - {f.name for f in dataclasses.fields(TrainingArguments)}
    reference_own = set(REFERENCE_DEFAULTS) - {f.name for f in dataclasses.fields(TrainingArguments)}
    assert ours - reference_own == set(AGRPO_FIELDS)
    declared = _declared_defaults()
    assert {name: declared[name] for name in AGRPO_FIELDS} == AGRPO_FIELDS


def test_bf16_defaults_on_where_a_gpu_runs_it_and_off_elsewhere(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert default_bf16(fp16=False) is True and default_bf16(fp16=True) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_bf16(fp16=False) is False


def test_changed_training_arguments_defaults_resolve_as_the_reference_says(tmp_path):
    config = AsyncGRPOConfig(output_dir=str(tmp_path))
    assert config.bf16 is default_bf16(fp16=False) and config.gradient_checkpointing is True
    assert AsyncGRPOConfig(output_dir=str(tmp_path), bf16=True, use_cpu=True).bf16 is True
    assert config.logging_steps == 1 and config.learning_rate == 1e-6 and config.ignore_data_skip is True
    assert _plain(config.lr_scheduler_type) == "constant" and config.dtype == "float32"
    assert (
        AsyncGRPOConfig(output_dir=str(tmp_path), gradient_checkpointing=False).gradient_checkpointing
        is False
    )
    assert config.resolved_epsilon_high == 0.2


def test_concurrency_bound_is_the_reference_formula(tmp_path):
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=3
    )
    assert config.concurrency_bound(num_processes=2) == 4 * 4 * 3 * 2
    assert AsyncGRPOConfig(output_dir=str(tmp_path), max_staleness=0).concurrency_bound(1) == 8  # max(0, 1)
    assert AsyncGRPOConfig(output_dir=str(tmp_path), max_concurrent_rollouts=5).concurrency_bound(8) == 5
    assert config.rollout_config(num_processes=2).max_concurrent_rollouts == 96


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        ({"top_p": 0.9}, "Set top_k"),
        ({"epsilon": 0.0}, "epsilon=0.0; it must be > 0"),
        ({"deepspeed": {"zero_optimization": {"stage": 2}}}, "use FSDP2"),
        ({"num_generations": 1}, "num_generations=1; it must be >= 2"),
        ({"vllm_importance_sampling_clip_min": 1.5}, "0 < min <= 1 <= max"),
        ({"score_centering": True, "num_sampler_logprobs": 0}, "score_centering=False"),
        ({"lr_scheduler_type": "cosine"}, "Set max_steps"),
        ({"weight_sync_backend": "ipc"}, "expected one of"),
        ({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 1}}, "fsdp_version=2"),
        ({"min_p": 0.1}, "set top_k or min_p=None"),
        ({"temperature": 0.0}, "temperature=0.0"),
    ],
)
def test_invalid_combinations_fail_at_construction_naming_the_fix(tmp_path, overrides, fix):
    with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        AsyncGRPOConfig(output_dir=str(tmp_path), **overrides)


def test_a_decaying_schedule_is_fine_with_an_explicit_max_steps(tmp_path):
    config = AsyncGRPOConfig(output_dir=str(tmp_path), lr_scheduler_type="cosine", max_steps=100)
    assert config.target_prompts(1000) == float("inf")
    assert AsyncGRPOConfig(output_dir=str(tmp_path), num_train_epochs=1.5).target_prompts(10) == 15


def test_config_subclasses_add_fields_the_loop_can_read(tmp_path):
    @dataclasses.dataclass
    class CurriculumConfig(AsyncGRPOConfig):
        pass_rate_cap: float = 0.9

    config = CurriculumConfig(output_dir=str(tmp_path))
    assert config.pass_rate_cap == 0.9 and config.num_generations == 8


def test_several_servers_come_as_a_list_from_python_a_flag_or_a_config_file(tmp_path):
    from agrpo_trainer._cli import parse_train_args

    urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8002/"]
    args = AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=urls)
    assert args.server_urls == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert args.rollout_config(num_processes=1).server_urls == args.server_urls
    assert args.sync_config().server_urls == args.server_urls
    assert AsyncGRPOConfig(output_dir=str(tmp_path)).server_urls == ("http://localhost:8000",)
    common = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path)]
    _, parsed = parse_train_args([*common, "--vllm_server_base_url", *urls])
    assert parsed.server_urls == args.server_urls
    _, one = parse_train_args([*common, "--vllm_server_base_url", urls[0]])
    assert one.server_urls == (urls[0],)
    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {tmp_path}\nvllm_server_base_url: [{urls[0]}, {urls[1]}]\n")
    _, from_file = parse_train_args([str(config), "--model_name_or_path", "m", "--dataset_name", "d"])
    assert from_file.server_urls == args.server_urls
    with pytest.raises(ValueError, match="names a server twice"):
        AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=[urls[0], urls[0]])
    with pytest.raises(ValueError, match="ends in /v1"):
        AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=[urls[0], "http://h:8000/v1"])


def test_torch_compile_defaults_to_per_layer_compilation_on_cuda_only(tmp_path, monkeypatch, caplog):
    from agrpo_trainer import _layer_region
    from agrpo_trainer._layer_region import default_torch_compile

    assert _layer_region.COMPILE_BY_DEFAULT is False, "off until the trainer's own compiled step passes parity"
    assert default_torch_compile(use_cpu=False, fsdp=False, named=False) is False
    monkeypatch.setattr(_layer_region, "COMPILE_BY_DEFAULT", True)  # the rule once it is switched on
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_torch_compile(use_cpu=False, fsdp=False, named=False) is True
    assert (
        default_torch_compile(use_cpu=False, fsdp=True, named=False) is False
    )  # FSDP2 + regions: unmeasured
    with caplog.at_level(logging.WARNING, logger="agrpo_trainer"):
        _layer_region.fsdp_compile_notice(use_cpu=False, fsdp=True, named=False)
        _layer_region.fsdp_compile_notice(use_cpu=False, fsdp=True, named=True)  # asked for by name: no word
    assert [r.getMessage() for r in caplog.records if "stays off under FSDP" in r.getMessage()] != []
    assert len(caplog.records) == 1
    assert default_torch_compile(use_cpu=True, fsdp=False, named=False) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_torch_compile(use_cpu=False, fsdp=False, named=False) is False
    assert AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True).torch_compile is False
    named = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, torch_compile_backend="aot_eager")
    assert named.torch_compile is True and named.torch_compile_backend == "aot_eager"


def test_checkpointing_mode_is_checked_and_warned_about_without_checkpointing(tmp_path, caplog):
    with pytest.raises(ValueError, match="checkpointing_mode='partial'"):
        AsyncGRPOConfig(output_dir=str(tmp_path), checkpointing_mode="partial")
    with caplog.at_level("WARNING", logger="agrpo_trainer"):
        AsyncGRPOConfig(
            output_dir=str(tmp_path), gradient_checkpointing=False, checkpointing_mode="selective"
        )
    assert "checkpointing_mode='selective' has no effect" in caplog.text

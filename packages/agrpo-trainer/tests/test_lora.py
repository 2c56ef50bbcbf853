"""LoRA against real CPU vLLM servers (SPEC F-LORA): merged full weights to a server without --enable-lora,
adapters to one with it (requests then name their group's version's adapter); after every sync the server
scores the parity probe as the trainer's PEFT model does. And a dtype mismatch with the server is warned."""

from __future__ import annotations

import logging

import pytest
from datasets import Dataset
from peft import LoraConfig

from agrpo_trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from agrpo_trainer.rewards import CharacterFractionReward

PROMPTS = Dataset.from_list(
    [{"prompt": [{"role": "user", "content": f"List {i} colours."}]} for i in range(8)]
)
LORA = LoraConfig(
    r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], lora_dropout=0.0
)


def _args(tmp_path, url: str, **overrides) -> AsyncGRPOConfig:
    settings = dict(
        output_dir=str(tmp_path / "run"), vllm_server_base_url=url, weight_sync_backend="disk", bf16=False,
        use_cpu=True, learning_rate=5e-3, num_generations=4, max_completion_length=12, per_device_train_batch_size=8,
        token_budget=0, save_strategy="no", report_to="none", max_steps=3, activation_checkpointing=False,
        disable_tqdm=True, max_staleness=1,
    )  # fmt: skip
    settings.update(overrides)
    return AsyncGRPOConfig(**settings)


def _parity(trainer) -> list[float]:
    return [
        h["sync/logprob_max_abs_diff"] for h in trainer.state.log_history if "sync/logprob_max_abs_diff" in h
    ]


@pytest.mark.server
def test_lora_pushes_merged_weights_to_a_server_without_lora(training_server, untied_qwen3_dir, tmp_path):
    args = _args(tmp_path, training_server.url)
    trainer = AsyncGRPOTrainer(untied_qwen3_dir, CharacterFractionReward(), args=args, train_dataset=PROMPTS,
                               peft_config=LORA)  # fmt: skip
    trainer.train()
    assert trainer._policy_sync is None  # closed
    gaps = _parity(trainer)
    assert len(gaps) == 3 and max(gaps) < 1e-4


@pytest.mark.server
def test_lora_pushes_adapters_to_a_server_with_lora_and_requests_name_their_version(
    vllm_server, tiny_qwen3_dir, tmp_path
):
    args = _args(tmp_path, vllm_server.url)
    trainer = AsyncGRPOTrainer(tiny_qwen3_dir, CharacterFractionReward(), args=args, train_dataset=PROMPTS,
                               peft_config=LORA)  # fmt: skip
    seen = []
    original = trainer._start_pipeline

    def start_and_record():
        original()
        seen.append((trainer._policy_sync.weight_sync.backend_name, trainer._served_model_template()))

    trainer._start_pipeline = start_and_record
    trainer.train()
    assert seen == [("lora", "agrpo-policy-v{version}")]
    gaps = _parity(trainer)
    assert len(gaps) == 3 and max(gaps) < 1e-4  # the probe runs against the newest adapter
    assert all(h.get("sample/staleness_max", 0) <= 1 for h in trainer.state.log_history)


@pytest.mark.server
def test_a_dtype_mismatch_with_the_server_is_warned_once(training_server, untied_qwen3_dir, tmp_path, caplog):
    args = _args(tmp_path, training_server.url, dtype="bfloat16", max_steps=1, sync_parity_probe_tokens=0)
    trainer = AsyncGRPOTrainer(untied_qwen3_dir, CharacterFractionReward(), args=args, train_dataset=PROMPTS)
    with caplog.at_level(logging.WARNING, logger="agrpo_sync"):
        trainer.train()
    warnings = [r for r in caplog.records if "the server runs" in r.getMessage()]
    assert len(warnings) == 1 and "bfloat16" in warnings[0].getMessage()

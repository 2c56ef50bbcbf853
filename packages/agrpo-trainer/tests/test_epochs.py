"""num_train_epochs counts distinct prompts consumed (SPEC F-Q), forks once; max_steps > 0 wins."""

from __future__ import annotations

import pytest
from rollout_doubles import fixed_samples

from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_trainer import AsyncGRPOConfig
from agrpo_trainer.testing import ReplayTrainer


@pytest.fixture(scope="module")
def samples():
    return fixed_samples(build_model(TinyModelSpec(seed=4), build_tokenizer()), num_prompts=4)


def _train(tmp_path, samples, **overrides) -> ReplayTrainer:
    settings = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, learning_rate=1e-3,
        per_device_train_batch_size=4, token_budget=0, save_strategy="no", report_to="none", disable_tqdm=True,
        activation_checkpointing=False,
    )  # fmt: skip
    settings.update(overrides)
    ReplayTrainer.replay_samples = samples
    tokenizer = build_tokenizer()
    trainer = ReplayTrainer(build_model(TinyModelSpec(seed=4), tokenizer), None, args=AsyncGRPOConfig(**settings),
                            train_dataset=[{"prompt": "p"}] * 4, processing_class=tokenizer)  # fmt: skip
    trainer.train()
    return trainer


def test_half_an_epoch_stops_after_half_the_prompts_however_many_samples_they_forked(tmp_path, samples):
    trainer = _train(tmp_path, samples, num_train_epochs=0.5)
    trained = {s.row_index for h in [trainer.last_step_samples] for s in h}
    assert trainer.state.global_step < len(samples) // 4
    assert trainer.state.log_history[-2]["epoch"] >= 0.5 and len(trained) >= 1


def test_one_epoch_trains_every_sample_once_and_max_steps_wins(tmp_path, samples):
    trainer = _train(tmp_path, samples, num_train_epochs=1)
    assert trainer.state.log_history[-2]["epoch"] == 1.0
    assert sum(h.get("batch/samples_per_step", 0) for h in trainer.state.log_history) == len(samples)
    capped = _train(tmp_path / "capped", samples, num_train_epochs=1, max_steps=2)
    assert capped.state.global_step == 2

"""top_k / top_p against the real CPU vLLM server, which has no sampling masks (SPEC F-TOPK, F-LOSS): each token's
candidate set is read from the server's processed top log-probs, so the trainer renormalises over the very set
the sampler used. On-policy steps then have importance ratios ~1 and a real gradient, with no warning; and a
run whose steps exclude every loss term stops instead of training on nothing."""

from __future__ import annotations

import warnings

import pytest
import torch

from agrpo_trainer import AsyncGRPOConfig, AsyncGRPOTrainer, NothingTrainedError
from agrpo_trainer._step_guard import EmptyStepGuard
from agrpo_trainer.rewards import CharacterFractionReward

PROMPTS = [{"prompt": [{"role": "user", "content": f"Say something about {i}."}]} for i in range(16)]


class MaskRecorder(AsyncGRPOTrainer):
    """Keeps, per micro-batch, whether its row carried candidate sets and their sizes."""

    rows: list

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        row = inputs["row"]
        sizes = None if row.sampling_mask_offsets is None else torch.diff(row.sampling_mask_offsets).tolist()
        self.rows.append(sizes)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.server
def test_top_k_on_a_server_without_sampling_masks_trains_on_policy_with_ratios_near_1(
    training_server, untied_qwen3_dir, tmp_path
):
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "run"), vllm_server_base_url=training_server.url, weight_sync_backend="disk",
        bf16=False, use_cpu=True, learning_rate=1e-3, num_generations=4, max_completion_length=12,
        per_device_train_batch_size=8, token_budget=0, save_strategy="no", report_to="none", max_steps=3,
        activation_checkpointing=False, disable_tqdm=True, temperature=0.8, top_k=10, top_p=0.9,
        max_staleness=0,  # every trained sample comes from the weights the step starts from: on-policy
    )  # fmt: skip
    MaskRecorder.rows = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = MaskRecorder(
            str(untied_qwen3_dir), CharacterFractionReward(), args=args, train_dataset=PROMPTS
        )
        trainer.train()
    ours = [w for w in caught if "top_k" in str(w.message) or "candidate" in str(w.message)]
    assert len(ours) <= 1, [str(w.message) for w in ours]
    assert MaskRecorder.rows and all(
        sizes and min(sizes) >= 1 and max(sizes) <= 10 for sizes in MaskRecorder.rows
    )
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert len(history) == 3
    for h in history:
        assert h["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=0.02), h
        assert h["sampling/masked_mean"] < 0.05 and h["grad_norm"] > 0, h


def test_steps_that_exclude_every_loss_term_stop_the_run_naming_the_causes():
    guard = EmptyStepGuard(limit=3)
    empty = {"num_terms": 40.0, "sampling/masked_mean": 1.0, "sampling/importance_sampling_ratio/mean": 0.05}
    guard.check(empty, 1)
    guard.check({**empty, "sampling/masked_mean": 0.5}, 2)  # a step that trained something resets the count
    guard.check({"num_terms": 0.0}, 3)  # a step with no loss terms (a padded last step) is not empty
    guard.check(empty, 4)
    guard.check(empty, 5)
    with pytest.raises(NothingTrainedError, match=r"steps 4-6 .*mean ratio 0\.05.*processed_logprobs"):
        guard.check(empty, 6)

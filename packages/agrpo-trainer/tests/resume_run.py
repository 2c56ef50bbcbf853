"""Run by `test_resume.py` in its own process (which the test kills): trains against the real server and
appends one JSON line per optimizer step: the step and the prompts it trained, as run-wide keys.

usage: python resume_run.py URL MODEL_DIR OUTPUT_DIR RECORD_FILE MAX_STEPS [--resume]
"""

from __future__ import annotations

import json
import os
import sys

import torch
from rollout_doubles import rank_reward
from transformers import TrainerCallback

from agrpo_trainer import AsyncGRPOConfig, AsyncGRPOTrainer

PROMPTS = [{"prompt": [{"role": "user", "content": f"Tell me about item {i}."}]} for i in range(12)]


class RecordTrainedPrompts(TrainerCallback):
    def __init__(self, trainer, path: str) -> None:
        self.trainer, self.path = trainer, path

    def on_step_end(self, args, state, control, **kwargs):
        process = self.trainer._pipeline.source.process
        line = {
            "step": state.global_step,
            "prompts": self.trainer.last_step_prompts,
            "worker_pid": process.pid,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())


def main() -> None:
    url, model_dir, output_dir, record, max_steps = sys.argv[1:6]
    torch.set_num_threads(1)
    args = AsyncGRPOConfig(
        output_dir=output_dir, vllm_server_base_url=url, weight_sync_backend="disk", bf16=False, use_cpu=True,
        learning_rate=1e-4, num_generations=4, max_completion_length=8, per_device_train_batch_size=8,
        token_budget=0, max_steps=int(max_steps), save_steps=3, report_to="none", disable_tqdm=True,
        gradient_checkpointing=False, max_staleness=1000, sync_parity_probe_tokens=0, max_concurrent_rollouts=16,
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(model_dir, rank_reward, args=args, train_dataset=PROMPTS)
    trainer.add_callback(RecordTrainedPrompts(trainer, record))
    trainer.train(resume_from_checkpoint="--resume" in sys.argv)


if __name__ == "__main__":
    main()

"""Run by `test_resume.py` in its own process (which kills itself at a chosen point): trains against the real
server and appends one JSON line per optimizer step with the prompts it trained, recovered from the packed
rows the model was given (decoded tokens), not from the trainer's or the ledger's own records.

usage: python resume_run.py URL MODEL_DIR OUTPUT_DIR RECORD_FILE KILL [--resume]

KILL is where the process SIGKILLs itself (`none` runs to the end of the epoch):
- `split-checkpoint`: right after writing a checkpoint at which a kept group is partly trained;
- `mid-step`: inside the loss computation, two or more steps after the last checkpoint;
- `half-group`: in the packing thread, once a checkpoint exists and the packer holds half of a group.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import sys
from collections import Counter

import torch
from transformers import TrainerCallback

from agrpo_trainer import AsyncGRPOConfig, AsyncGRPOTrainer

NUM_PROMPTS, NUM_GENERATIONS = 24, 4
PROMPTS = [
    {"prompt": [{"role": "user", "content": f"Tell me about item {i}."}], "item": i}
    for i in range(NUM_PROMPTS)
]
_ITEM = re.compile(r"item (\d+)\.")
# Here and in the spawned rollout process (which imports this module): SIGUSR1 prints every thread's stack to
# the log, so a worker that outlives its killed trainer shows where it waits.
faulthandler.register(signal.SIGUSR1, all_threads=True)


def dropped(item: int) -> bool:
    """Prompts whose group every run drops (equal rewards): never trained, counted as consumed."""
    return item % 7 == 0


def item_reward(completions, item, **columns) -> list[float]:
    """Spread by position in the group (nothing dropped), except the `dropped` prompts' equal rewards."""
    return [0.5 if dropped(item[0]) else i / len(completions) for i in range(len(completions))]


def trained_items(row, tokenizer) -> Counter:
    """How many samples of each prompt this packed row trains: per sample, the root-to-token path of its first
    loss term is decoded and the prompt's item number read from it."""
    first_term = {}
    for m, s in enumerate(row.sample_index.tolist()):
        first_term.setdefault(s, m)
    items = Counter()
    q_offsets = row.q_offsets.tolist()
    for m in first_term.values():
        position = int(row.token_index[m])
        segment = next(s for s in range(len(q_offsets) - 1) if q_offsets[s] <= position < q_offsets[s + 1])
        path = row.kv_index[row.kv_offsets[segment] : row.kv_offsets[segment + 1]]
        found = _ITEM.findall(tokenizer.decode(row.input_ids[path]))
        assert len(found) == 1, f"one prompt per sample path, found {found}"
        items[int(found[0])] += 1
    return items


class RecordingTrainer(AsyncGRPOTrainer):
    """Records what each optimizer step trained and kills the process at `kill`."""

    def __init__(self, *args, record: str, kill: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.record, self.kill = record, kill
        self.step_items: Counter = Counter()
        self.last_checkpoint = None
        self.add_callback(_StepRecord(self))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        step = self.state.global_step + 1  # the step being computed
        if self.kill == "mid-step" and self.last_checkpoint is not None and step - self.last_checkpoint >= 2:
            _die(self.record, "mid-step", step)
        self.step_items += trained_items(inputs["row"], self.processing_class)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _start_pipeline(self) -> None:
        super()._start_pipeline()
        if self.kill == "half-group" and self._pipeline is not None:
            source = self._pipeline.source
            read, next_message = Counter(), source.next_sample_message

            def next_sample_message(timeout):  # the packing thread's read of the rollout queue
                message = next_message(timeout)
                if message is not None and message[0] == "sample":
                    group = (message[1].epoch, message[1].row_index)
                    read[group] += 1
                    if self.last_checkpoint is not None and read[group] == NUM_GENERATIONS // 2:
                        _die(self.record, "half-group", self.state.global_step)
                return message

            source.next_sample_message = next_sample_message

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        self.last_checkpoint = self.state.global_step
        ledger = self._pipeline.ledger
        split = [k for k, p in ledger._prompts.items() if p.trained and not p.finished]
        _append(self.record, {"checkpoint": self.state.global_step, "split": split})
        if self.kill == "split-checkpoint" and split:
            _die(self.record, "split-checkpoint", self.state.global_step)


class _StepRecord(TrainerCallback):
    def __init__(self, trainer: RecordingTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        line = {
            "step": state.global_step,
            "items": {str(k): v for k, v in sorted(trainer.step_items.items())},
            "worker_pid": trainer._pipeline.source.process.pid,
        }
        trainer.step_items = Counter()
        _append(trainer.record, line)


def _append(path: str, line: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _die(path: str, where: str, step: int) -> None:
    _append(path, {"killed": where, "at_step": step})
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    url, model_dir, output_dir, record, kill = sys.argv[1:6]
    torch.set_num_threads(1)
    args = AsyncGRPOConfig(
        output_dir=output_dir, vllm_server_base_url=url, weight_sync_backend="disk", bf16=False, use_cpu=True,
        learning_rate=1e-4, num_generations=NUM_GENERATIONS, max_completion_length=8, token_budget=0,
        per_device_train_batch_size=6, num_train_epochs=1, save_steps=3, report_to="none", disable_tqdm=True,
        activation_checkpointing=False, max_staleness=1000, sync_parity_probe_tokens=0, max_concurrent_rollouts=8,
    )  # fmt: skip
    trainer = RecordingTrainer(
        model_dir, item_reward, args=args, train_dataset=PROMPTS, record=record, kill=kill
    )
    trainer.train(resume_from_checkpoint="--resume" in sys.argv)


if __name__ == "__main__":
    main()

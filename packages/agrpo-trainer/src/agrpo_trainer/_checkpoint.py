"""Checkpoints: `rollout_state.json` (the trained position) and the dtype of the saved weights (SPEC F-CKPT).

Owns the file beside the Trainer's own checkpoint files: `{"resume_from": [epoch, row_index] | null,
"done": [[epoch, row_index], ...], "prompts_consumed": n}` (see `PromptLedger.resume_state`). It is
written before the Trainer's files, so a checkpoint the Trainer considers complete always has it, and a
run killed mid-save resumes from the previous complete one. Also owns the dtype rule: with FSDP and
bf16/fp16 mixed precision, `model.safetensors` is written in that dtype (the size of the served model)
while the resume files keep fp32 master weights and optimizer state; without FSDP the checkpoint is also
the resume file and keeps the master dtype. Does not know how the position is computed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

logger = logging.getLogger("agrpo_trainer")

ROLLOUT_STATE_NAME = "rollout_state.json"


def resolve_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """`True` means the last checkpoint in `output_dir`; a path is used as given."""
    if resume_from_checkpoint is True:
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise ValueError(f"resume_from_checkpoint=True but {output_dir} holds no checkpoint-N directory")
        return last
    return resume_from_checkpoint or None


def write_rollout_state(output_dir: str, global_step: int, state: dict[str, Any]) -> Path:
    """Write the trained position into `<output_dir>/checkpoint-<global_step>/` (atomically)."""
    folder = Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{global_step}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ROLLOUT_STATE_NAME
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(state))
    os.replace(partial, path)
    return path


def read_rollout_state(checkpoint: str | None) -> dict[str, Any] | None:
    """The trained position saved with `checkpoint`, or None (fresh run, or a checkpoint without one)."""
    if checkpoint is None:
        return None
    path = Path(checkpoint) / ROLLOUT_STATE_NAME
    if not path.exists():
        logger.warning("%s has no %s: the rollout restarts at prompt 0", checkpoint, ROLLOUT_STATE_NAME)
        return None
    return json.loads(path.read_text())


def save_dtype_state_dict(trainer: Any, state_dict: dict[str, Any] | None) -> dict[str, Any] | None:
    """The state dict `Trainer._save` writes: cast to the mixed-precision dtype under FSDP, else unchanged."""
    args = trainer.args
    if state_dict is None or not trainer.is_fsdp_enabled or not (args.bf16 or args.fp16):
        return state_dict
    dtype = torch.bfloat16 if args.bf16 else torch.float16
    return {
        name: value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
        for name, value in state_dict.items()
    }

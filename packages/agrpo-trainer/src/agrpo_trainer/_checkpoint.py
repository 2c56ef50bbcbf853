"""Checkpoints: `rollout_state.json` (the trained position) and the dtype of the saved weights (SPEC F-CKPT).

Owns the file beside the Trainer's own checkpoint files: `{"resume_from": [epoch, row_index] | null,
"done": [[epoch, row_index], ...], "prompts_consumed": n}` (see `PromptLedger.resume_state`). It is
written before the Trainer's files, so a checkpoint the Trainer considers complete always has it. A
checkpoint is complete once the Trainer wrote its `trainer_state.json`, the last of its files: one whose
save failed (a full disk, a read-only directory) or was cut short (the process was killed) lacks it, and
`resume_from_checkpoint=True` skips it for the newest complete one, with a warning; a run killed mid-save
thus resumes from the previous complete checkpoint. `noted_save_failure` adds to a save's exception what it
left behind and where a resume starts. Also owns the dtype rule: with FSDP and
bf16/fp16 mixed precision, `model.safetensors` is written in that dtype (the size of the served model)
while the resume files keep fp32 master weights and optimizer state; without FSDP the checkpoint is also
the resume file and keeps the master dtype. Does not know how the position is computed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

logger = logging.getLogger("agrpo_trainer")

ROLLOUT_STATE_NAME = "rollout_state.json"


_CHECKPOINT = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")


def is_complete(checkpoint: str | os.PathLike) -> bool:
    """Whether the Trainer finished writing `checkpoint` (its `trainer_state.json`, written last, exists)."""
    return (Path(checkpoint) / TRAINER_STATE_NAME).is_file()


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest `checkpoint-N` of `output_dir` the Trainer finished writing; incomplete ones are skipped
    with a warning. None when there is none."""
    folder = Path(output_dir)
    found = [
        (int(m.group(1)), p) for p in folder.iterdir() if (m := _CHECKPOINT.fullmatch(p.name)) and p.is_dir()
    ]
    for _, path in sorted(found, reverse=True):
        if is_complete(path):
            return str(path)
        logger.warning(
            "%s is incomplete (no %s: its save failed or was cut short); resuming from an earlier checkpoint",
            path,
            TRAINER_STATE_NAME,
        )
    return None


def resolve_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """`True` means the newest complete checkpoint in `output_dir`; a path is used as given, once checked."""
    if resume_from_checkpoint is True:
        last = last_complete_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise ValueError(
                f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint-N directory"
            )
        return last
    if resume_from_checkpoint and not is_complete(resume_from_checkpoint):
        complete = last_complete_checkpoint(Path(resume_from_checkpoint).parent)
        raise ValueError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} is not a complete checkpoint (no "
            f"{TRAINER_STATE_NAME}); pass the newest complete one ({complete}) or resume_from_checkpoint=True"
        )
    return resume_from_checkpoint or None


@contextlib.contextmanager
def noted_save_failure(output_dir: str, global_step: int) -> Iterator[None]:
    """Wrap a checkpoint save: an exception leaves with a note naming the incomplete checkpoint, where
    `resume_from_checkpoint=True` will start instead, and the fix."""
    try:
        yield
    except Exception as error:
        folder = Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{global_step}"
        previous = last_complete_checkpoint(output_dir) if Path(output_dir).is_dir() else None
        error.add_note(
            f"writing {folder} failed, so it is incomplete; train(resume_from_checkpoint=True) skips it and "
            f"resumes from {previous or 'the start (no complete checkpoint yet)'}, which trains no prompt twice "
            "and skips none. Free disk space (or make the output_dir writable), then resume"
        )
        raise


def write_rollout_state(output_dir: str, global_step: int, state: dict[str, Any]) -> Path:
    """Write the trained position into `<output_dir>/checkpoint-<global_step>/` (atomically)."""
    folder = Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{int(global_step)}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ROLLOUT_STATE_NAME
    partial = path.with_suffix(".json.partial")
    try:
        partial.write_text(json.dumps(state))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
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

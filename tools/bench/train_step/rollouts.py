"""Real rollouts for the GPU machine, where no vLLM server runs: recorded once from a CPU-server run of the trainer.

`record` runs `AsyncGRPOTrainer` as the demo does (a tiny random Qwen3 learning to write digits against a local
CPU vLLM server, weights pushed after every step) with longer completions, and keeps every `RolloutSample` the
optimizer steps trained: real groups, prompts rendered by the chat template, the sampler's log-probs and top-8,
advantages from real rewards. `load` reads them back. The file is numpy's compressed npz of the samples'
arrays laid end to end (no pickle). The GPU checks (`trainer_run.py`) re-score the sampler log-probs with
their own model, since a random 1.7B-shape model is not the tiny model that sampled them.

Record (about 6 minutes on 2 cores): `uv run python -m tools.bench.train_step.rollouts --out
tools/bench/train_step/rollouts.npz`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from agrpo_rollout import RolloutSample

ROLLOUTS = Path(__file__).with_name("rollouts.npz")
"""The recorded file the GPU checks read by default."""
_PER_TOKEN = ("input_ids", "trained_mask")
_PER_TRAINED = ("advantages", "sampler_logprobs", "sampler_top_ids", "sampler_top_logprobs")
_PER_SAMPLE = ("group_id", "policy_version", "reward", "advantage", "row_index")


def save(samples: list[RolloutSample], path: Path) -> None:
    """The samples' arrays, concatenated per field, with each sample's token and trained-token counts."""
    arrays = {name: np.concatenate([getattr(s, name) for s in samples]) for name in _PER_TOKEN + _PER_TRAINED}
    arrays |= {name: arrays[name].astype(np.int32) for name in ("input_ids", "sampler_top_ids")}  # half the file
    arrays |= {name: np.array([getattr(s, name) for s in samples]) for name in _PER_SAMPLE}
    arrays["num_tokens"] = np.array([s.num_tokens for s in samples])
    arrays["num_trained"] = np.array([s.num_trained for s in samples])
    np.savez_compressed(path, **arrays)


def load(path: Path = ROLLOUTS) -> list[RolloutSample]:
    """The recorded samples, as the trainer received them (sampling masks none: the server sampled top-k off)."""
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    arrays |= {name: arrays[name].astype(np.int64) for name in ("input_ids", "sampler_top_ids")}
    tokens = np.cumsum(np.concatenate([[0], arrays["num_tokens"]]))
    trained = np.cumsum(np.concatenate([[0], arrays["num_trained"]]))
    samples = []
    for i in range(len(arrays["num_tokens"])):
        fields = {name: arrays[name][tokens[i] : tokens[i + 1]] for name in _PER_TOKEN}
        fields |= {name: arrays[name][trained[i] : trained[i + 1]] for name in _PER_TRAINED}
        fields |= {name: arrays[name][i].item() for name in _PER_SAMPLE}
        samples.append(RolloutSample(**fields))
    return samples


def record(out: Path, *, max_steps: int, completion_length: int) -> list[RolloutSample]:
    """Train the demo's tiny model for `max_steps` steps against a local CPU server, keeping what each step trained."""
    from transformers import TrainerCallback

    from agrpo_attention.testing import TinyModelSpec, save_tiny_model
    from agrpo_rollout.testing import VLLMServer
    from agrpo_trainer import AsyncGRPOTrainer
    from agrpo_trainer._demo import PROMPTS, demo_config
    from agrpo_trainer.rewards import CharacterFractionReward

    trained: list[RolloutSample] = []

    class Keep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trained.extend(trainer.last_step_samples)

    work = Path(tempfile.mkdtemp(prefix="agrpo-rollouts-"))
    model_dir = save_tiny_model(work / "model", TinyModelSpec(tie_word_embeddings=False))
    with VLLMServer(model_dir=model_dir, max_model_len=1024).start() as server:
        args = demo_config(str(work / "run"), server.url, max_steps)
        args.max_completion_length = completion_length
        trainer = AsyncGRPOTrainer(
            str(model_dir), CharacterFractionReward(), args=args, train_dataset=PROMPTS * 4
        )
        trainer.add_callback(Keep())
        trainer.train()
    save(trained, out)
    return trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROLLOUTS)
    parser.add_argument("--max-steps", type=int, default=48)
    parser.add_argument("--completion-length", type=int, default=160)
    args = parser.parse_args()
    samples = record(args.out, max_steps=args.max_steps, completion_length=args.completion_length)
    lengths = [s.num_tokens for s in samples]
    print(f"{len(samples)} samples of {min(lengths)}-{max(lengths)} tokens "
          f"({len({s.group_id for s in samples})} groups) -> {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)")  # fmt: skip


if __name__ == "__main__":
    main()

"""The main job: a short asynchronous GRPO run of a tiny model against a local CPU vLLM server (`agrpo-trainer demo`).

A tiny random Qwen3-style model (untied LM head, so every weight reaches the CPU server) learns to write
digits: the reward is the share of digit characters in its answer (`CharacterFractionReward`), which a random
model scores ~0.02 on. `AsyncGRPOTrainer` spawns the rollout process, trains on prefix-packed rows, and pushes
weights to the server through the disk backend after every optimizer step, checking after each push that the
server scores a fixed probe exactly as the trainer does (`sync/logprob_max_abs_diff`). A live bar shows reward,
KL to the sampler and tokens/s; `<output_dir>/report.html` plots the run at the end, and the demo prints its path.

Run: `agrpo-trainer demo` (or `uv run python -m tools.demo`): about a minute for the server, then ~3 minutes of
training on 2 cores. Owns the demo's settings and its closing line; the server launcher and the tiny model are
`agrpo_rollout.testing`'s and `agrpo_attention.testing`'s.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import torch

from agrpo_attention.testing import TinyModelSpec, save_tiny_model
from agrpo_rollout.testing import VLLMServer

from ._config import AsyncGRPOConfig
from ._report import REPORT_NAME
from ._trainer import AsyncGRPOTrainer
from .rewards import CharacterFractionReward

TOPICS = ["apples", "rivers", "trains", "clocks", "maps", "stars", "bridges", "songs"]
PROMPTS = [{"prompt": [{"role": "user", "content": f"Write something about {t}, part {i}."}]} for t in TOPICS for i in range(4)]  # fmt: skip


def demo_config(output_dir: str, url: str, max_steps: int) -> AsyncGRPOConfig:
    """The demo's settings; each departure from the defaults is for a tiny random model on a 2-core CPU."""
    return AsyncGRPOConfig(
        output_dir=output_dir,
        vllm_server_base_url=url,
        weight_sync_backend="disk",  # the CPU server cannot take NCCL transfers
        bf16=False,  # float32 on both sides: the parity probe is then exact
        use_cpu=True,
        activation_checkpointing=False,  # a tiny model: recomputation only costs time
        learning_rate=5e-3,  # a random model, not a pretrained one
        num_generations=8,
        max_completion_length=24,
        per_device_train_batch_size=16,  # two groups per optimizer step
        token_budget=0,  # fixed sample count per row
        max_staleness=2,
        max_steps=max_steps,
        save_strategy="no",
        report_to="none",
        seed=0,
    )


def run_demo(server: VLLMServer, model_dir: Path, output_dir: str, max_steps: int) -> AsyncGRPOTrainer:
    """Build the trainer while the server loads (started with `wait=False`), then train once it answers."""
    args = demo_config(output_dir, server.url, max_steps)
    trainer = AsyncGRPOTrainer(str(model_dir), CharacterFractionReward(), args=args, train_dataset=PROMPTS)
    server.wait_healthy()
    trainer.train()
    return trainer


def closing_line(trainer: AsyncGRPOTrainer) -> str:
    """The run in one line; its time is the Trainer's own `train_runtime` (the progress bar's closing line says
    the same), not the wall clock around it, which also holds the server's start-up and shutdown."""
    runtime = next(h["train_runtime"] for h in reversed(trainer.state.log_history) if "train_runtime" in h)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    gaps = [
        h["sync/logprob_max_abs_diff"] for h in trainer.state.log_history if "sync/logprob_max_abs_diff" in h
    ]
    head, tail = rewards[:10], rewards[-10:]
    return (
        f"trained {trainer.state.global_step} steps in {runtime:.1f} s: digit reward {sum(head) / len(head):.3f} "
        f"(first 10 steps) -> {sum(tail) / len(tail):.3f} (last 10); {len(gaps)} syncs, max |server - trainer| "
        f"log-prob {max(gaps):.1e}\nreport: {Path(trainer.args.output_dir) / REPORT_NAME}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="agrpo-trainer demo", description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--output-dir", default=None, help="default: a new temporary directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # vLLM's CPU worker pins one core; a second trainer thread would only contend
    work = Path(tempfile.mkdtemp(prefix="agrpo-demo-"))
    output_dir = args.output_dir or str(work / "run")
    model_dir = save_tiny_model(work / "model", TinyModelSpec(tie_word_embeddings=False))
    print(f"tiny Qwen3 in {model_dir}; starting the CPU vLLM server (about a minute)...", flush=True)
    with VLLMServer(model_dir=model_dir, max_model_len=1024).start(wait=False) as server:
        trainer = run_demo(server, model_dir, output_dir, args.max_steps)
    print(closing_line(trainer), flush=True)

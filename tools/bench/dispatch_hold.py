"""Generation wasted on stale samples, with the producer held at `max_staleness` (`DispatchHold`) and without it.

Run: `uv run python -m tools.bench.dispatch_hold [--steps 30]`. The demo's settings (`agrpo_trainer._demo`:
tiny untied Qwen3, 2 groups of 8 per step, `max_staleness=2`, disk sync every step) against one local CPU vLLM
server, twice side by side: `unheld` lets the producer run ahead as far as the queues allow (the trainer's
behaviour before the hold), `held` is the default. Prints, over the steps after the first two: samples dropped
stale per step, their share of the samples that reached the trainer, s/step and trained tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import tempfile
from pathlib import Path
from unittest import mock

import torch
from transformers.trainer_callback import PrinterCallback

from agrpo_attention.testing import TinyModelSpec, save_tiny_model
from agrpo_rollout.testing import VLLMServer
from agrpo_trainer import AsyncGRPOTrainer
from agrpo_trainer._demo import PROMPTS, demo_config
from agrpo_trainer.rewards import CharacterFractionReward


def producer_unheld():
    """The trainer before `DispatchHold` (the producer runs ahead as far as the queues allow), as a context."""
    return mock.patch("agrpo_trainer._trainer.DispatchHold.for_run", return_value=None)


def _run(url: str, model_dir: Path, steps: int, *, held: bool) -> dict[str, float]:
    args = demo_config(tempfile.mkdtemp(), url, steps)
    args.disable_tqdm = True
    trainer = AsyncGRPOTrainer(str(model_dir), CharacterFractionReward(), args=args, train_dataset=PROMPTS)
    trainer.remove_callback(PrinterCallback)  # one line per step of every metric: not what this prints
    with contextlib.nullcontext() if held else producer_unheld():
        trainer.train()
    logs = [h for h in trainer.state.log_history if "perf/step_s" in h][2:]
    dropped = sum(h.get("sample/dropped_stale_total", 0) for h in logs)
    trained = sum(h.get("batch/samples_per_step", 0) for h in logs)
    return {
        "dropped_per_step": dropped / len(logs),
        "wasted_frac": dropped / max(dropped + trained, 1),
        "step_s": statistics.mean(h["perf/step_s"] for h in logs),
        "trained_tok_s": statistics.mean(h["perf/trained_tok_s_wall_clock"] for h in logs),
        "staleness_mean": statistics.mean(h.get("sample/staleness_mean", 0) for h in logs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = save_tiny_model(
        Path(tempfile.mkdtemp(prefix="agrpo-hold-")) / "model", TinyModelSpec(tie_word_embeddings=False)
    )
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; the demo's settings, "
          f"{args.steps} steps each", flush=True)  # fmt: skip
    with VLLMServer(model_dir=model_dir, max_model_len=1024) as server:
        results = {
            name: _run(server.url, model_dir, args.steps, held=name == "held") for name in ("unheld", "held")
        }
    for name, r in results.items():
        print(f"{name:6s}: {r['dropped_per_step']:.1f} samples dropped stale per step ({r['wasted_frac']:.0%} of those "
              f"generated), staleness mean {r['staleness_mean']:.2f}, {r['step_s']:.2f} s/step, "
              f"{r['trained_tok_s']:.0f} trained tok/s")  # fmt: skip
    held, unheld = results["held"], results["unheld"]
    print(f"ratio held / unheld: s/step {held['step_s'] / unheld['step_s']:.2f}, trained tok/s "
          f"{held['trained_tok_s'] / unheld['trained_tok_s']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()

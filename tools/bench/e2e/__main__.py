"""Wall time per optimizer step of the async trainer against the same pipeline forced synchronous (SPEC 12).

Run: `uv run python -m tools.bench.e2e [--steps 20] [--hidden-size 256 --layers 4]`. One local CPU vLLM
server, one tiny untied Qwen3-style model, the same trainer settings twice, side by side in one run:
- sync: `LockstepRolloutLoop` generates one step's samples, then waits until they are trained and synced,
  so generate -> train -> sync alternate (a synchronous GRPO trainer);
- async: the default loop, `max_staleness` versions ahead (`--max-staleness`, default 4);
- with `--unheld`, async once more with the producer not held at `max_staleness` (the trainer before
  `DispatchHold`), for the samples generated and then dropped stale that the hold saves.
Reported per optimizer step, as means over the steps after the first two (async steps are bursty, so a
median would flatter it): wall time; in the sync run also its parts, generation (the trainer's wait for
samples) and training + sync (the rest), whose max and sum are the bounds the async time is compared with
(it should approach `max(generate, train)`, not the sum).

On a 2-core machine the two sides fight for the second core (vLLM pins its worker to core 0, but its API
server and engine processes and the rollout process float), so by default (`--pin`) the whole generation
side (server tree, rollout process) is pinned to core 0 and the trainer to core 1, in both runs: the
separate devices of a real deployment. `--no-pin` measures the contended machine as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch
from transformers.trainer_callback import PrinterCallback, TrainerCallback

from agrpo_attention.testing import TinyModelSpec, save_tiny_model
from agrpo_rollout.testing import VLLMServer
from agrpo_trainer.rewards import CharacterFractionReward
from tools.bench.dispatch_hold import producer_unheld
from tools.bench.e2e.lockstep import LockstepConfig, LockstepTrainer

GENERATION_CORE, TRAINING_CORE = 0, 1
PROMPTS = [
    {"prompt": [{"role": "user", "content": f"Describe object number {i} in a sentence."}]} for i in range(64)
]


def _config(
    output_dir: str, url: str, steps: int, *, lockstep: bool, groups: int, generations: int, max_staleness: int
) -> LockstepConfig:
    return LockstepConfig(
        output_dir=output_dir, vllm_server_base_url=url, weight_sync_backend="disk", bf16=False, use_cpu=True,
        activation_checkpointing=False, learning_rate=1e-3, num_generations=generations, max_completion_length=32,
        per_device_train_batch_size=groups * generations, token_budget=0, max_steps=steps, save_strategy="no",
        report_to="none", disable_tqdm=True, sync_parity_probe_tokens=0, samples_per_step=groups * generations,
        max_concurrent_rollouts=groups * generations, max_staleness=10_000 if lockstep else max_staleness,
        queue_maxsize=groups * generations,  # async: generation blocks one step ahead instead of going stale
    )  # fmt: skip


class _PinRolloutProcess(TrainerCallback):
    """Once the rollout process exists, move it to the generation core."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        psutil.Process(self.trainer._pipeline.source.process.pid).cpu_affinity([GENERATION_CORE])


def _pin_server(server: VLLMServer) -> None:
    root = psutil.Process(server.process.pid)
    for process in [root, *root.children(recursive=True)]:
        for thread in process.threads():  # vLLM binds its OMP threads itself: move every thread
            os.sched_setaffinity(thread.id, {GENERATION_CORE})


def _run(
    url: str, model_dir: Path, steps: int, *, lockstep: bool, groups: int, generations: int, pin: bool,
    max_staleness: int, held: bool = True,
) -> dict:  # fmt: skip
    from agrpo_trainer import AsyncGRPOTrainer

    cls = LockstepTrainer if lockstep else AsyncGRPOTrainer
    args = _config(tempfile.mkdtemp(), url, steps, lockstep=lockstep, groups=groups, generations=generations,
                   max_staleness=max_staleness)  # fmt: skip
    trainer = cls(str(model_dir), CharacterFractionReward(), args=args, train_dataset=PROMPTS)
    trainer.remove_callback(PrinterCallback)  # one line per step of every metric: not what this prints
    if pin:
        trainer.add_callback(_PinRolloutProcess(trainer))
    start = time.monotonic()
    with contextlib.nullcontext() if held else producer_unheld():
        trainer.train()
    total = time.monotonic() - start
    logs = [h for h in trainer.state.log_history if "perf/step_s" in h][2:]
    step = [h["perf/step_s"] for h in logs]
    wait = [h.get("perf/rollout_wait_s", 0.0) for h in logs]
    return {
        "step_s": statistics.mean(step),
        "generate_s": statistics.mean(wait),
        "train_s": statistics.mean(s - w for s, w in zip(step, wait, strict=True)),
        "total_s": total,
        "samples_per_step": statistics.median(h.get("batch/samples_per_step", 0) for h in logs),
        "pack_overlap": _mean(logs, "perf/pack_overlap_frac"),
        "fwd_bwd_s": _mean(logs, "perf/fwd_bwd_s"),
        "sync_s": _mean(logs, "perf/weight_sync_s"),
        "generated_tok_s": _mean(logs, "rollout/generated_tok_s"),
        "dropped_stale": sum(h.get("sample/dropped_stale_total", 0) for h in logs),
        "wasted_token_frac": logs[-1].get("sample/wasted_token_frac", float("nan")),
    }


def _mean(logs: list[dict], key: str) -> float:
    values = [h[key] for h in logs if key in h and h[key] == h[key]]
    return statistics.mean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--groups", type=int, default=2, help="groups per optimizer step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--max-staleness", type=int, default=4, help="the async runs' max_staleness")
    parser.add_argument(
        "--unheld", action="store_true",
        help="also run async with the producer not held at max_staleness (the trainer before DispatchHold)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="agrpo-e2e-"))
    spec = TinyModelSpec(hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                         num_layers=args.layers, tie_word_embeddings=False)  # fmt: skip
    model_dir = save_tiny_model(work / "model", spec)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads 1; "
          f"model hidden {args.hidden_size} x {args.layers} layers; {args.groups} groups x {args.generations} "
          f"rollouts x <= 32 tokens per step; {args.steps} steps; async max_staleness {args.max_staleness}; "
          f"pinned: {args.pin}", flush=True)  # fmt: skip
    with VLLMServer(model_dir=model_dir, max_model_len=1024) as server:
        if args.pin:
            _pin_server(server)
            os.sched_setaffinity(0, {TRAINING_CORE})
        shape = {"groups": args.groups, "generations": args.generations, "pin": args.pin,
                 "max_staleness": args.max_staleness}  # fmt: skip
        sync = _run(server.url, model_dir, args.steps, lockstep=True, **shape)
        asynchronous = _run(server.url, model_dir, args.steps, lockstep=False, **shape)
        runs = {"sync": sync, "async": asynchronous}
        if args.unheld:
            runs["async unheld"] = _run(
                server.url, model_dir, args.steps, lockstep=False, held=False, **shape
            )
    bound_max = max(sync["generate_s"], sync["train_s"])
    bound_sum = sync["generate_s"] + sync["train_s"]
    for name, r in runs.items():
        print(f"{name:5s}: {r['step_s']:.3f} s/step (mean), {r['total_s']:.1f} s total, "
              f"{r['samples_per_step']:.0f} samples/step; generate {r['generate_s']:.3f} s, rest {r['train_s']:.3f} s; "
              f"packing hidden behind forward+backward {r['pack_overlap']:.0%}")  # fmt: skip
        print(f"       forward+backward {r['fwd_bwd_s']:.3f} s, weight sync {r['sync_s']:.3f} s, generated "
              f"{r['generated_tok_s']:.0f} tok/s, {r['dropped_stale']:.0f} samples dropped stale, wasted "
              f"tokens per trained token {r['wasted_token_frac']:.3f}")  # fmt: skip
    print(f"sync parts: generate {sync['generate_s']:.3f} s + train/sync {sync['train_s']:.3f} s = {bound_sum:.3f} s; "
          f"max = {bound_max:.3f} s")  # fmt: skip
    print(f"ratio async / sync wall time per step: {asynchronous['step_s'] / sync['step_s']:.2f} "
          f"(async / max(generate, train) = {asynchronous['step_s'] / bound_max:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()

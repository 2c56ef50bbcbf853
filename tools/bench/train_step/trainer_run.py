"""The trainer's own `train()` on one GPU, compiled by default, over rollouts recorded from a CPU-server run.

What had to hold before `torch_compile=None` resolved to on for CUDA (issue 31, point 1), checked on the code
`train()` runs rather than a bench copy of the step: `agrpo_trainer.testing.ReplayTrainer` (the trainer with the
recorded samples as its sample source and no weight sync; packing, the step, compile, checkpointing and metrics
are its own) trains a random model of a benchmark shape for `--steps` optimizer steps, full fine-tuning and
LoRA, with the config defaults (bf16 autocast over fp32 weights, checkpointing `auto`, `torch_compile=None`, set
to True while `COMPILE_BY_DEFAULT` is off).
Printed per run: that compile resolved on, the graphs dynamo compiled by the end of step 2 and over the later
steps of fresh rows (0 expected), graph breaks (0), the trainer's own MFU and step times, and the step's loss
and gradients against the same regions eager and an fp32 reference (`regions.parity`, the bench's rule).

The recorded samples (`rollouts.py`) were sampled by a tiny model; their sampler log-probs (and top-8) are
re-scored here by the model being trained (bf16 autocast, no grad) so importance ratios start near 1, as
they do against a real server. Token ids stay the recorded ones (a 512-token vocabulary inside the shape's).

Run on the GPU machine: `python3 -m tools.bench.train_step.trainer_run --model qwen3-1.7b --lora both`;
`--tiny` runs it on CPU with a tiny shape (compile backend named, as CPU never compiles by default).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from dataclasses import replace

import numpy as np
import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from agrpo_attention import enable_tree_attention, token_scores
from agrpo_attention.testing import build_tokenizer
from agrpo_packing import PackSample, TreeRow
from agrpo_rollout import RolloutSample
from agrpo_trainer import AsyncGRPOConfig
from agrpo_trainer._layer_region import COMPILE_BY_DEFAULT
from agrpo_trainer.testing import ReplayTrainer

from ..tree_attention.model_shapes import build_random_model
from .compile_summary import parity_line
from .regions import LayerSetup, graph_counts, parity
from .rollouts import ROLLOUTS, load
from .step import plan_rows


def rescored(samples: list[RolloutSample], model: torch.nn.Module, *, amp: bool) -> list[RolloutSample]:
    """The samples with sampler log-probs and top-K log-probs from `model` itself, one tree row per group."""
    by_group: dict[int, list[RolloutSample]] = defaultdict(list)
    for sample in samples:
        by_group[sample.group_id].append(sample)
    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp)
    out = []
    for group in by_group.values():
        row = TreeRow(0)
        for sample in group:
            row.add(PackSample(**sample.pack_fields()))
        packed = row.pack()
        with torch.no_grad(), autocast:
            scores = token_scores(model, packed, top_ids=packed.sampler_top_ids is not None)
        logprobs = scores.logprobs.float().cpu().numpy()
        top = scores.top_logprobs.float().cpu().numpy() if scores.top_logprobs is not None else None
        index = packed.sample_index.numpy()
        for i, sample in enumerate(group):
            mine = index == i
            fields = {"sampler_logprobs": logprobs[mine].astype(np.float32)}
            if top is not None:
                fields["sampler_top_logprobs"] = top[mine].astype(np.float32)
            out.append(replace(sample, policy_version=0, **fields))
    return out


class _StepLog(TrainerCallback):
    """Per optimizer step: wall seconds and dynamo's graph counts after it."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        self.steps.append({"seconds": time.perf_counter() - self._start, **graph_counts()})


def _config(args, output_dir: str, lora: bool) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(
        output_dir=output_dir, max_steps=args.steps, learning_rate=1e-5 if lora else 1e-6,
        token_budget=args.budget, gradient_accumulation_steps=1, max_staleness=10**6, save_strategy="no",
        report_to="none", logging_steps=1, disable_tqdm=True, seed=0,
        **({"use_cpu": True, "bf16": False, "torch_compile_backend": "aot_eager"} if args.tiny else {}),
        **({} if args.tiny or COMPILE_BY_DEFAULT else {"torch_compile": True}),  # what the default would be
    )  # fmt: skip


def run(args, samples: list[RolloutSample], lora: bool) -> dict:
    """One `train()` of a fresh model over `samples`; what it compiled, how fast, and its parity."""
    device = "cpu" if args.tiny else "cuda"
    model = build_random_model(args.model, args.layers, device, torch.float32)
    amp = not args.tiny
    enable_tree_attention(model, "reference" if args.tiny else "auto")
    samples = rescored(samples, model, amp=amp)
    peft = None
    if lora:
        from peft import LoraConfig

        peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    config = _config(args, tempfile.mkdtemp(prefix="agrpo-trainer-run-"), lora)
    ReplayTrainer.replay_samples = samples
    trainer = ReplayTrainer(model, None, args=config, train_dataset=[{"prompt": "x"}], processing_class=build_tokenizer(), peft_config=peft)  # fmt: skip
    log = _StepLog()
    trainer.add_callback(log)
    trainer.remove_callback(PrinterCallback)  # the per-step dicts; this prints its own summary
    before = graph_counts()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    regions = trainer._layer_regions
    history = [h for h in trainer.state.log_history if "loss" in h]
    rows = plan_rows([PackSample(**s.pack_fields()) for s in samples[:64]], args.budget, share_prefixes=True)[
        :2
    ]
    setup = LayerSetup(checkpointing=regions.mode, compile=regions.settings.compile,
                       compile_backend=regions.settings.compile_backend)  # fmt: skip
    check = parity(trainer.model, rows, setup, regions, trainer.step_settings, amp=amp)
    after_two = log.steps[min(1, len(log.steps) - 1)]
    out = {
        "lora": lora, "torch_compile": bool(config.torch_compile), "checkpointing": regions.mode,
        "compiled_layers": sum(r.compiled for r in regions.regions), "layers": regions.num_layers,
        "steps": len(log.steps), "train_s": seconds, "first_step_s": log.steps[0]["seconds"],
        "median_step_s": float(np.median([s["seconds"] for s in log.steps[2:]] or [0.0])),
        "graphs_by_step_2": after_two["graphs"] - before["graphs"],
        "new_graphs_after_step_2": log.steps[-1]["graphs"] - after_two["graphs"],
        "graph_breaks": log.steps[-1]["graph_breaks"] - before["graph_breaks"],
        "loss_first_last": (history[0]["loss"], history[-1]["loss"]) if history else None,
        "mfu_wall_clock": [h["perf/mfu_wall_clock"] for h in history if "perf/mfu_wall_clock" in h][2:],
        "parity": check,
    }  # fmt: skip
    mfu = out["mfu_wall_clock"]
    print(
        f"{args.model} {'LoRA r=16' if lora else 'full fine-tuning'}: torch_compile resolved {out['torch_compile']}, "
        f"{out['compiled_layers']}/{out['layers']} layers compiled, checkpointing {out['checkpointing']}; "
        f"{out['steps']} steps in {seconds:.0f} s (first {out['first_step_s']:.0f} s, then median "
        f"{out['median_step_s']:.2f} s); graphs by step 2: {out['graphs_by_step_2']}, new over the later "
        f"{out['steps'] - 2} steps: {out['new_graphs_after_step_2']}, graph breaks {out['graph_breaks']}; "
        f"loss {out['loss_first_last']}; MFU (wall clock, steps 3+) median "
        f"{100 * float(np.median(mfu)) if mfu else float('nan'):.1f}%\n  parity: {parity_line(check)}",
        flush=True,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument(
        "--steps", type=int, default=22, help="optimizer steps (2 to compile, then fresh rows)"
    )
    parser.add_argument("--budget", type=int, default=4096, help="token_budget: tokens per row")
    parser.add_argument("--lora", default="both", choices=["off", "on", "both"])
    parser.add_argument("--rollouts", default=str(ROLLOUTS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shape, aot_eager, 3 steps")
    args = parser.parse_args()
    if args.tiny:
        args.model, args.steps, args.budget = "tiny-dense", min(args.steps, 3), min(args.budget, 512)
    samples = load(args.rollouts)
    lengths = [s.num_tokens for s in samples]
    print(f"{len(samples)} recorded samples of {min(lengths)}-{max(lengths)} tokens, "
          f"{len({s.group_id for s in samples})} groups; device {torch.cuda.get_device_name() if not args.tiny else 'CPU'}")  # fmt: skip
    runs = [
        run(args, samples, lora) for lora in {"off": [False], "on": [True], "both": [False, True]}[args.lora]
    ]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1, default=str)


if __name__ == "__main__":
    main()

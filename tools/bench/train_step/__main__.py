"""Complete optimizer steps of the trainer's step code on GRPO-shaped rows: trained tokens/s, MFU, memory.

Run: `uv run python -m tools.bench.train_step` (GPU) or `... --tiny` (CPU smoke test, tiny shapes). For
each model shape, gradient checkpointing off/on and packing ratio (~1, 3.4, 8), the same GRPO samples
(16 prompts x 8-16 rollouts, sampler top-8 for score centering) are planned as tree rows and as plain
padding-free rows and trained for `--steps` timed optimizer steps after one warm-up: planner -> rows ->
`micro_batch_loss` (tree attention, log-probs, loss) -> backward -> fused AdamW. Printed side by side:
trained tokens/s, MFU (FLOP model of `tools/bench/tree_attention/measure.py`: 6 x tokens x layer weights
+ LM head on loss terms + flash-attention pairs, recompute not counted, peak 989 TFLOP/s), peak memory,
the split of step time, tree/plain MFU, and (with `--idle`) the GPU's idle share of a step, profiled
once with rows prepared inline as the trainer does and once sequentially (pageable copies, also
timed). Precision `amp` is the trainer's default (fp32 master weights under bf16 autocast); `bf16` has bf16
parameters. `--head unfused` turns the fused LM head off (the model's (M, V) logits, then the chunked
log-softmax) to measure what fusing costs or saves. Hybrid shapes also print the seconds of the Gated
DeltaNet recurrence alone in the step (`delta_rule.py`). Several GPUs with FSDP2, next to one GPU, with the
loss curve and a weight sync from the sharded model: `python -m tools.bench.train_step.fsdp` (`fsdp.py`).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import agrpo_attention._token_logprobs as token_logprobs_module
from agrpo_attention import build_tree_plan, enable_tree_attention

from ..tree_attention.measure import PEAK_TFLOPS, step_flops
from ..tree_attention.model_shapes import SHAPES, build_random_model
from .data import grpo_samples
from .delta_rule import delta_rule_seconds
from .step import StepTimes, gpu_idle_profile, plan_rows, timed_step


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default="qwen3-1.7b", help=f"comma list of {sorted(SHAPES)} (tiny-* with --tiny)"
    )
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own)")
    parser.add_argument("--ratios", default="1,3.4,8", help="target packing ratios")
    parser.add_argument("--prompts", type=int, default=16, help="groups per step")
    parser.add_argument("--budget", type=int, default=16384, help="forwarded tokens per row")
    parser.add_argument("--checkpointing", default="on,off", help="gradient checkpointing settings to run")
    parser.add_argument("--precision", default="amp", choices=["amp", "bf16"])
    parser.add_argument("--backend", default="auto", help="agrpo-attention backend")
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps (median) after a warm-up")
    parser.add_argument(
        "--idle",
        action="store_true",
        help="profile one step for the GPU's idle share, inline and sequential rows",
    )
    parser.add_argument(
        "--host-ops", action="store_true", help="with --idle: the host ops behind long GPU gaps"
    )
    parser.add_argument("--head", default="fused", choices=["fused", "unfused"], help="LM head + log-softmax")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None, help="write all measurements here")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, rows and steps")
    args = parser.parse_args()
    if args.tiny:
        args.models = args.models if args.models.startswith("tiny-") else "tiny-dense"
        args.budget, args.device, args.steps, args.prompts = 256, "cpu", 1, 4
        args.backend, args.precision = "reference", "bf16"
    return args


def _model(name: str, args):
    if args.head == "unfused":  # every head counts as not fusable: token_scores takes the model's logits
        token_logprobs_module._fusable_head = lambda model: None
    dtype = torch.float32 if args.precision == "amp" else torch.bfloat16
    model = build_random_model(name, args.layers, args.device, dtype)
    enable_tree_attention(model, args.backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=args.device == "cuda")
    return model, optimizer


def _measure(model, optimizer, rows, args, checkpointing: bool) -> dict:
    amp = args.precision == "amp"
    timed_step(model, optimizer, rows, amp=amp)  # warm-up: kernels, allocator, optimizer state
    steps = [timed_step(model, optimizer, rows, amp=amp) for _ in range(args.steps)]
    median = sorted(steps, key=lambda t: t.total_s)[len(steps) // 2]
    plans = [build_tree_plan(row, model) for row in rows]
    flops = step_flops(model, rows, plans)
    trained = sum(row.num_loss_terms for row in rows)
    out = {
        "rows": len(rows), "trained_tokens": trained, "forwarded_tokens": sum(r.num_tokens for r in rows),
        "seconds": median.total_s, "trained_tok_s": trained / median.total_s,
        "mfu": flops / median.total_s / (PEAK_TFLOPS * 1e12), **{k: getattr(median, k) for k in StepTimes.__slots__},
    }  # fmt: skip
    if args.idle and args.device == "cuda":
        for key, path in (("", "inline"), ("_sequential", "sequential")):
            idle = gpu_idle_profile(lambda p=path: timed_step(model, optimizer, rows, amp=amp, path=p))
            out |= {
                f"gpu_idle_frac{key}": idle["idle_frac"],
                f"gpu_long_gap_frac{key}": idle["long_gap_frac"],
            }
        out["seconds_sequential"] = timed_step(model, optimizer, rows, amp=amp, path="sequential").total_s
        if args.host_ops:
            out["host_ops"] = gpu_idle_profile(
                lambda: timed_step(model, optimizer, rows, amp=amp), host_ops=True
            )
    if getattr(model.config, "layer_types", None) and "linear_attention" in model.config.layer_types:
        out.update(delta_rule_seconds(model, rows, checkpointing=checkpointing))
    return out


def _print_row(label: str, r: dict) -> None:
    split = " / ".join(f"{r[k]:.2f}" for k in ("forward_s", "head_s", "backward_s", "optimizer_s"))
    idle = ""
    if "gpu_idle_frac" in r:
        idle = (f"  idle {100 * r['gpu_idle_frac']:.1f}% (gaps >= 1 ms {100 * r['gpu_long_gap_frac']:.1f}%; sequential "
                f"{100 * r['gpu_idle_frac_sequential']:.1f}% / {100 * r['gpu_long_gap_frac_sequential']:.1f}%, "
                f"step {r['seconds_sequential']:.2f} s)")  # fmt: skip
    if "host_ops" in r:
        idle += f"\n    host ops behind long gaps (ms, op): {r['host_ops']}"
    if "delta_rule_step_s" in r:
        idle += f"  delta rule {r['delta_rule_step_s']:.2f} s ({100 * r['delta_rule_step_s'] / r['seconds']:.0f}%)"
    print(
        f"  {label:<6} rows {r['rows']:>3}  step {r['seconds']:7.2f} s  trained tok/s {r['trained_tok_s']:9.0f}  "
        f"MFU {100 * r['mfu']:5.1f}%  peak {r['peak_gib']:6.1f} GiB  plan {r['plan_s']:.2f} s  "
        f"fwd/head+loss/bwd/opt {split} s{idle}",
        flush=True,
    )


def main() -> None:
    args = _arguments()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"train_step on {device_name}, torch {torch.__version__}, precision {args.precision}, "
          f"budget {args.budget} tokens/row, {args.prompts} prompts/step, head {args.head}")  # fmt: skip
    results = []
    for name in args.models.split(","):
        model, optimizer = _model(name, args)
        vocab = model.config.vocab_size
        for checkpointing in args.checkpointing.split(","):
            if checkpointing == "on":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            for ratio in (float(r) for r in args.ratios.split(",")):
                samples = grpo_samples(ratio, num_prompts=args.prompts, vocab=vocab, tiny=args.tiny)
                pair = {}
                for label, share in (("tree", True), ("plain", False)):
                    start = time.perf_counter()
                    rows = plan_rows(samples, args.budget, share_prefixes=share)
                    plan_s = time.perf_counter() - start
                    pair[label] = {
                        **_measure(model, optimizer, rows, args, checkpointing == "on"),
                        "plan_s": plan_s,
                    }
                measured = pair["tree"]["forwarded_tokens"] and (
                    pair["plain"]["forwarded_tokens"] / pair["tree"]["forwarded_tokens"]
                )
                print(
                    f"{name}  checkpointing {checkpointing}  target ratio {ratio}  measured ratio {measured:.2f}"
                )
                for label in ("tree", "plain"):
                    _print_row(label, pair[label])
                mfu_ratio = pair["tree"]["mfu"] / pair["plain"]["mfu"]
                speedup = pair["plain"]["seconds"] / pair["tree"]["seconds"]
                print(f"  tree/plain MFU {mfu_ratio:.3f}x  tree speedup {speedup:.2f}x", flush=True)
                results.append(dict(model=name, checkpointing=checkpointing, ratio=ratio, measured_ratio=measured,
                                    tree=pair["tree"], plain=pair["plain"], tree_over_plain_mfu=mfu_ratio))  # fmt: skip
        del model, optimizer
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "args": vars(args), "results": results}, f, indent=1)
    print(f"median of {args.steps} timed steps; MFU counts no recompute")


if __name__ == "__main__":
    main()

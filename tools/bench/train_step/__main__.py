"""Complete optimizer steps of the trainer's step code on GRPO-shaped rows: trained tokens/s, MFU, memory.

Run: `uv run python -m tools.bench.train_step` (GPU) or `... --tiny` (CPU smoke test, tiny shapes). For
each model shape, way of running the decoder layers and packing ratio (~1, 3.4, 8), the same GRPO samples
(16 prompts x 8-16 rollouts, sampler top-8 for score centering) are planned as tree rows and as plain
padding-free rows and trained for `--steps` timed optimizer steps after one warm-up: planner -> rows ->
`micro_batch_loss` (tree attention, log-probs, loss) -> backward -> fused AdamW. Printed side by side:
trained tokens/s, MFU (FLOP model of `tools/bench/tree_attention/measure.py`: 6 x tokens x layer weights
+ LM head on loss terms + flash-attention pairs, recompute not counted, peak 989 TFLOP/s), peak memory,
the split of step time, tree/plain MFU, and (with `--idle`) the GPU's idle share of a step and its busy
time by kernel kind, profiled with rows prepared inline as the trainer does (and, with `--idle
inline,sequential`, sequentially: pageable copies, also timed). Precision `amp` is the trainer's default
(fp32 master weights under bf16 autocast); `bf16` has bf16 parameters. `--head unfused` turns the fused LM
head off (the model's (M, V) logits, then the chunked log-softmax) to measure what fusing costs or saves.

The decoder layers (`regions.py`): `--checkpointing on/off` is transformers' own gradient checkpointing,
layers eager (the step before issue 20); `full`, `selective`, `none` and `auto` run the trainer's
`LayerRegions`, with `--compile on` each layer compiled (`--compile-backend`, `--compile-mode`) and
`--cast-weights on` the bf16 weights cast once per step. Every combination of the comma lists runs. Per
setup it prints the graphs dynamo compiled and its graph breaks, with `--parity` the step loss and
gradients against the same regions run eagerly, and with `--recompile-steps N` the graphs compiled over N
more steps of fresh rows of varying sizes and ratios. Hybrid shapes also print the seconds of the Gated
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
from .compile_summary import parity_line
from .data import grpo_samples
from .delta_rule import delta_rule_seconds
from .regions import AutoHooks, LayerSetup, apply, cast_seconds, graph_counts, parity
from .step import SETTINGS, StepTimes, gpu_idle_profile, plan_rows, timed_step


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default="qwen3-1.7b", help=f"comma list of {sorted(SHAPES)} (tiny-* with --tiny)"
    )
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own)")
    parser.add_argument("--ratios", default="1,3.4,8", help="target packing ratios")
    parser.add_argument("--prompts", type=int, default=16, help="groups per step")
    parser.add_argument("--budget", type=int, default=16384, help="forwarded tokens per row")
    parser.add_argument(
        "--checkpointing", default="on,off",
        help="comma list: on/off (transformers', eager layers) or full/selective/none/auto (LayerRegions)",
    )  # fmt: skip
    parser.add_argument("--compile", default="off", help="comma list of on/off: compile each layer's region")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the regions")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode of the regions")
    parser.add_argument(
        "--cast-weights",
        default="on",
        help="comma list of on/off: eager layers' bf16 weights cast once per step (compiled ones cast in-graph)",
    )
    parser.add_argument("--kinds", default="tree,plain", help="rows to run: tree and/or plain")
    parser.add_argument("--cast-probe", action="store_true", help="time one bf16 cast of the layers' weights")
    parser.add_argument(
        "--parity", action="store_true", help="per setup: loss and gradients against eager regions"
    )
    parser.add_argument(
        "--recompile-steps", type=int, default=0, help="per setup: N more steps of fresh rows, graphs counted"
    )
    parser.add_argument(
        "--precision", default=None, choices=["amp", "bf16"], help="default amp (bf16 with --tiny)"
    )
    parser.add_argument("--backend", default="auto", help="agrpo-attention backend")
    parser.add_argument(
        "--deltanet-kernel",
        default="auto",
        help="hybrids' delta rule: auto, triton, torch or fla (agrpo-attention)",
    )
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps (median) after a warm-up")
    parser.add_argument(
        "--idle", nargs="?", const="inline,sequential", default=None,
        help="profile one step for the GPU's idle share and kernel split, rows prepared inline and/or sequentially",
    )  # fmt: skip
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
        args.backend, args.precision = "reference", args.precision or "bf16"
    args.precision = args.precision or "amp"
    return args


def _setups(args) -> list[LayerSetup]:
    """Every combination of --compile, --checkpointing and --cast-weights that means something."""
    setups = []
    for compile_ in args.compile.split(","):
        for checkpointing in args.checkpointing.split(","):
            stock = checkpointing in ("on", "off")
            if stock and compile_ == "on":
                continue  # transformers' own path is the eager reference
            for cast in args.cast_weights.split(",")[: 1 if stock else None]:
                setups.append(LayerSetup(
                    checkpointing=checkpointing, compile=compile_ == "on", compile_backend=args.compile_backend,
                    compile_mode=args.compile_mode, cast_weights=cast == "on",
                ))  # fmt: skip
    return setups


def _model(name: str, args):
    if args.head == "unfused":  # every head counts as not fusable: token_scores takes the model's logits
        token_logprobs_module._fusable_head = lambda model: None
    dtype = torch.float32 if args.precision == "amp" else torch.bfloat16
    model = build_random_model(name, args.layers, args.device, dtype)
    enable_tree_attention(model, args.backend, deltanet_kernel=args.deltanet_kernel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=args.device == "cuda")
    return model, optimizer


def _profile(model, optimizer, rows, args, amp: bool) -> dict:
    out = {}
    for path in args.idle.split(","):
        key = "" if path == "inline" else f"_{path}"
        idle = gpu_idle_profile(lambda p=path: timed_step(model, optimizer, rows, amp=amp, path=p))
        out |= {f"gpu_idle_frac{key}": idle["idle_frac"], f"gpu_long_gap_frac{key}": idle["long_gap_frac"]}
        out.setdefault("kernel_split", idle["kernel_split"])
        if path == "sequential":
            out["seconds_sequential"] = timed_step(model, optimizer, rows, amp=amp, path="sequential").total_s
    if args.host_ops:
        out["host_ops"] = gpu_idle_profile(lambda: timed_step(model, optimizer, rows, amp=amp), host_ops=True)
    return out


def _measure(model, optimizer, rows, args, setup: LayerSetup, auto: AutoHooks | None) -> dict:
    amp = args.precision == "amp"
    if auto is not None:
        auto.begin()
    timed_step(model, optimizer, rows, amp=amp, before_optimizer=auto and auto.before_optimizer)  # warm-up
    chosen = auto.end() if auto is not None else None
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
    if chosen is not None:
        out["auto_chose"] = chosen
    if args.idle and args.device == "cuda":
        out |= _profile(model, optimizer, rows, args, amp)
    if getattr(model.config, "layer_types", None) and "linear_attention" in model.config.layer_types:
        out.update(delta_rule_seconds(model, rows, checkpointing=setup.checkpointing not in ("off", "none")))
    return out


def _print_row(label: str, r: dict) -> None:
    split = " / ".join(f"{r[k]:.2f}" for k in ("forward_s", "head_s", "backward_s", "optimizer_s"))
    idle = ""
    if "gpu_idle_frac" in r:
        idle = f"  idle {100 * r['gpu_idle_frac']:.1f}% (gaps >= 1 ms {100 * r['gpu_long_gap_frac']:.1f}%)"
    if "gpu_idle_frac_sequential" in r:
        idle += (f"; sequential {100 * r['gpu_idle_frac_sequential']:.1f}% / "
                 f"{100 * r['gpu_long_gap_frac_sequential']:.1f}%, step {r['seconds_sequential']:.2f} s")  # fmt: skip
    if "kernel_split" in r:
        idle += f"\n    GPU busy by kernel kind: {r['kernel_split']['kinds']}\n    top kernels (ms): {r['kernel_split']['top_kernels_ms']}"
    if "host_ops" in r:
        idle += f"\n    host ops behind long gaps (ms, op): {r['host_ops']}"
    if "delta_rule_step_s" in r:
        idle += f"  delta rule {r['delta_rule_step_s']:.2f} s ({100 * r['delta_rule_step_s'] / r['seconds']:.0f}%)"
    if "auto_chose" in r:
        idle += f"  auto chose {r['auto_chose']}"
    print(
        f"  {label:<6} rows {r['rows']:>3}  step {r['seconds']:7.2f} s  trained tok/s {r['trained_tok_s']:9.0f}  "
        f"MFU {100 * r['mfu']:5.1f}%  peak {r['peak_gib']:6.1f} GiB  plan {r['plan_s']:.2f} s  "
        f"fwd/head+loss/bwd/opt {split} s{idle}",
        flush=True,
    )


def _ratio(model, optimizer, args, setup: LayerSetup, regions, ratio: float, first: bool) -> dict:
    """Tree and plain rows of one ratio under `setup`; on the setup's first rows the auto choice and parity."""
    samples = grpo_samples(ratio, num_prompts=args.prompts, vocab=model.config.vocab_size, tiny=args.tiny)
    pair = {}
    for label in args.kinds.split(","):
        start = time.perf_counter()
        rows = plan_rows(samples, args.budget, share_prefixes=label == "tree")
        plan_s = time.perf_counter() - start
        auto = AutoHooks(regions, args.budget) if first else None
        pair[label] = {**_measure(model, optimizer, rows, args, setup, auto), "plan_s": plan_s}
        if first and args.parity and regions is not None:  # once per setup, on its first rows
            pair["parity"] = parity(model, rows[:2], setup, regions, SETTINGS, amp=args.precision == "amp")
        first = False
    return pair


def _report_ratio(name: str, setup: LayerSetup, ratio: float, pair: dict) -> dict:
    kinds = [k for k in ("tree", "plain") if k in pair]
    measured = 0.0
    if len(kinds) == 2 and pair["tree"]["forwarded_tokens"]:
        measured = pair["plain"]["forwarded_tokens"] / pair["tree"]["forwarded_tokens"]
    print(f"{name}  {setup.label}  target ratio {ratio}  measured ratio {measured:.2f}")
    for label in kinds:
        _print_row(label, pair[label])
    out = dict(model=name, setup=setup.label, checkpointing=setup.checkpointing, compile=setup.compile,
               cast_weights=setup.cast_weights, ratio=ratio, measured_ratio=measured, **{k: pair[k] for k in kinds},
               dynamo_so_far=graph_counts())  # fmt: skip
    if len(kinds) == 2:
        out["tree_over_plain_mfu"] = pair["tree"]["mfu"] / pair["plain"]["mfu"]
        speedup = pair["plain"]["seconds"] / pair["tree"]["seconds"]
        print(f"  tree/plain MFU {out['tree_over_plain_mfu']:.3f}x  tree speedup {speedup:.2f}x", flush=True)
    if "parity" in pair:
        p = out["parity"] = pair["parity"]
        print(f"  parity vs eager regions: {parity_line(p)}", flush=True)
        if "grad_err_by_layer" in p:
            print("  distance to fp32 by layer (compiled/eager): " + ", ".join(
                f"{i}: {c:.2e}/{e:.2e}" for i, (c, e) in p["grad_err_by_layer"].items()), flush=True)  # fmt: skip
    return out


def _recompile_steps(model, optimizer, args, vocab: int) -> dict:
    """`--recompile-steps` steps of fresh rows (new samples every step, ratios and tree/plain alternating):
    the graphs dynamo compiled during them (0 when the first steps compiled every kind)."""
    before = graph_counts()
    ratios = [float(r) for r in args.ratios.split(",")]
    sizes = []
    for i in range(args.recompile_steps):
        samples = grpo_samples(ratios[i % len(ratios)], num_prompts=max(1, args.prompts // 4), vocab=vocab,
                               tiny=args.tiny, seed=1000 + i)  # fmt: skip
        rows = plan_rows(samples, args.budget, share_prefixes=i % 2 == 0)
        sizes += [row.num_tokens for row in rows]
        timed_step(model, optimizer, rows, amp=args.precision == "amp")
    after = graph_counts()
    out = {"steps": args.recompile_steps, "rows": len(sizes), "row_tokens_min": min(sizes), "row_tokens_max": max(sizes),
           "new_graphs": after["graphs"] - before["graphs"], "new_graph_breaks": after["graph_breaks"] - before["graph_breaks"]}  # fmt: skip
    print(f"  recompiles over {out['steps']} steps of fresh rows ({out['rows']} rows of {out['row_tokens_min']}-"
          f"{out['row_tokens_max']} tokens): {out['new_graphs']} new graphs, {out['new_graph_breaks']} graph breaks",
          flush=True)  # fmt: skip
    return out


def _write_json(args, device_name: str, results: list, setups: list) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": device_name, "args": vars(args), "results": results, "setups": setups}, f, indent=1
            )


def main() -> None:
    args = _arguments()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"train_step on {device_name}, torch {torch.__version__}, precision {args.precision}, "
          f"budget {args.budget} tokens/row, {args.prompts} prompts/step, head {args.head}")  # fmt: skip
    results, setups_out = [], []
    for name in args.models.split(","):
        model, optimizer = _model(name, args)
        regions = None
        if args.cast_probe:
            cast = cast_seconds(model)
            print(f"{name}: one bf16 cast of the layers' {cast['weights']} matmul weights ({cast['gib']:.1f} GiB "
                  f"moved) takes {1e3 * cast['seconds']:.2f} ms")  # fmt: skip
            setups_out.append(dict(model=name, cast_probe=cast))
        for setup in _setups(args):
            regions = apply(model, setup, regions)
            before = graph_counts()
            for index, ratio in enumerate(float(r) for r in args.ratios.split(",")):
                pair = _ratio(model, optimizer, args, setup, regions, ratio, first=index == 0)
                results.append(_report_ratio(name, setup, ratio, pair))
                _write_json(args, device_name, results, setups_out)  # as it goes: a time limit keeps what ran
            counts = {k: v - before[k] for k, v in graph_counts().items()}
            print(
                f"  {setup.label}: {counts['graphs']} graphs compiled, {counts['graph_breaks']} graph breaks"
            )
            summary = dict(model=name, setup=setup.label, **counts)
            if args.recompile_steps:
                summary["recompile"] = _recompile_steps(model, optimizer, args, model.config.vocab_size)
            setups_out.append(summary)
            _write_json(args, device_name, results, setups_out)
        if regions is not None:
            regions.uninstall()
        del model, optimizer, regions
        if args.device == "cuda":
            torch.cuda.empty_cache()
    _write_json(args, device_name, results, setups_out)
    print(f"median of {args.steps} timed steps; MFU counts no recompute")


if __name__ == "__main__":
    main()

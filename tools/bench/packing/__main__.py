"""Benchmark: plan + pack GRPO-shaped data on one pinned CPU core (issue 3, SPEC 12).

Compares, on the same samples and the same core, agrpo-packing's `Planner` + `TreeRow.pack` (tree and
plain mode) with a straightforward per-token Python trie (`baseline.py`). Prints raw tokens per second
per core (raw = sum of sample lengths, what plain packing would forward) and the packing ratio (raw /
unique forwarded tokens). The target is >= 5M raw tokens/s per core, which keeps planning under 5% of a
step when a small model's fwd+bwd consumes 100-300k tokens/s on an H200.

    uv run python -m tools.bench.packing [--prompts 64] [--rollouts 8] [--ranks 8] [--token-budget 32768]
        [--routes 48,8,128]

`--routes LAYERS,TOP_K,EXPERTS` gives every sample MoE routes (routing replay, issue 33): 2 x LAYERS x TOP_K
bytes per token, so keep `--prompts` small (64 prompts of 48 x 8 routes hold about 1.4 GB).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
import torch

from agrpo_packing import PackedRow, PackingConfig, Planner
from agrpo_packing.testing import GroupShape, random_grpo_groups

from .baseline import plan_and_pack

TARGET_TOKENS_PER_S = 5e6


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=64, help="groups (prompts)")
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts per prompt")
    parser.add_argument("--multi-turn-frac", type=float, default=0.25, help="fraction of multi-turn rollouts")
    parser.add_argument("--ranks", type=int, default=8, help="rows per micro-batch (DP ranks)")
    parser.add_argument("--token-budget", type=int, default=32768, help="unique tokens per row")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of agrpo-packing (median kept)")
    parser.add_argument("--cpu", type=int, default=0, help="core to pin to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--routes",
        type=str,
        default=None,
        help="LAYERS,TOP_K,EXPERTS: samples carry MoE routes of that shape",
    )
    return parser.parse_args()


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else platform.processor()} ({len(names)} logical cores on the machine)"


def _ratio(rows: list[PackedRow]) -> float:
    return sum(r.num_raw_tokens for r in rows) / sum(r.num_tokens for r in rows)


def _ours(samples, args, share: bool) -> tuple[float, float, float]:
    """(median seconds, plan share of it, packing ratio) of `Planner` + `pack`."""
    times, plan_times = [], []
    for _ in range(args.repeats):
        config = PackingConfig(token_budget=args.token_budget, num_ranks=args.ranks, share_prefixes=share)
        start = time.perf_counter()
        batches = Planner(config).plan(samples)
        planned = time.perf_counter()
        rows = [row for batch in batches for row in batch.pack()]
        times.append(time.perf_counter() - start)
        plan_times.append(planned - start)
    median = statistics.median(times)
    return median, statistics.median(plan_times) / median, _ratio(rows)


def _baseline(samples, args) -> tuple[float, float]:
    start = time.perf_counter()
    rows = plan_and_pack(samples, args.token_budget, args.ranks)
    return time.perf_counter() - start, _ratio(rows)


def main() -> None:
    args = _arguments()
    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    routes = tuple(int(x) for x in args.routes.split(",")) if args.routes else None
    shape = GroupShape(
        num_prompts=args.prompts,
        rollouts_per_prompt=args.rollouts,
        multi_turn_frac=args.multi_turn_frac,
        routed_experts=routes,
    )
    samples = random_grpo_groups(shape, seed=args.seed)
    raw = sum(s.num_tokens for s in samples)
    print(f"hardware: {_cpu_name()}, pinned to cpu {args.cpu}; torch threads 1")
    print(f"software: Python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}")
    print(
        f"data: {args.prompts} prompts x {args.rollouts} rollouts -> {len(samples)} samples (multi-turn forks "
        f"included), {raw:,} raw tokens; prompts {shape.prompt_tokens}, completions {shape.completion_tokens}, "
        f"multi-turn {shape.multi_turn_frac:.0%}; token_budget={args.token_budget}, ranks={args.ranks}; "
        f"MoE routes (layers, top_k, experts) {routes}"
    )
    base_s, base_ratio = _baseline(samples, args)
    tree_s, tree_plan, tree_ratio = _ours(samples, args, share=True)
    plain_s, plain_plan, plain_ratio = _ours(samples, args, share=False)
    print(f"\n{'':34}{'seconds':>9}{'raw tok/s/core':>16}{'packing ratio':>15}{'vs baseline':>13}")
    for name, seconds, ratio in (
        ("per-token Python trie (baseline)", base_s, base_ratio),
        (f"agrpo-packing tree ({tree_plan:.0%} plan)", tree_s, tree_ratio),
        (f"agrpo-packing plain ({plain_plan:.0%} plan)", plain_s, plain_ratio),
    ):
        print(f"{name:34}{seconds:9.3f}{raw / seconds / 1e6:15.2f}M{ratio:15.3f}{base_s / seconds:12.1f}x")
    verdict = "PASS" if raw / tree_s >= TARGET_TOKENS_PER_S else "FAIL"
    print(f"\ntarget >= {TARGET_TOKENS_PER_S / 1e6:.0f}M raw tokens/s per core (tree mode): {verdict}")


if __name__ == "__main__":
    main()

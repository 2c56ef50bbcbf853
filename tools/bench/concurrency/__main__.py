"""Rollout goodput under fixed concurrency caps and under the adaptive rules, side by side in one run.

Run: `uv run python -m tools.bench.concurrency [--seconds 45] [--rounds 2] [--caps 8 16 32 64 128]`. Two
CPU vLLM servers in turn, one tiny Qwen3 model: `small-kv`, whose KV cache holds only a few full-length
requests (`--small-kv-requests` x `--max-model-len` tokens), and `large-kv` (1 GiB, 2 million tokens of
this model). On each, every setting runs the same GRPO workload for the same window from a standing
start, once per round, each round in a rotated order: fixed caps (`concurrency_control="fixed"`),
`goodput` (the default rule) and `kv_usage` (the reference's), the adaptive ones under the largest cap
as their bound. Reported per setting: generated tokens/s and preemptions over its windows (the
server's own counters; see `workload.py`), rollouts finished, the cap's range and the server's mean
running and waiting requests and KV usage. The check of issue 10: `goodput` reaches at least 0.95x the
tokens/s of the best fixed cap, with at most a quarter of that cap's preemptions, on both servers.

Issue 22 adds vLLM's own admission reserve: for each `--watermarks` value the same KV size is started again
with `--watermark W` (blocks kept free when a waiting or preempted request is admitted while others run),
and `goodput` and the fixed cap at the bound run there. Each is judged against the best fixed cap of the
default server (watermark 0): the same 0.95x tokens/s with at most a quarter of its preemptions.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
from pathlib import Path

from agrpo_attention.testing import build_tokenizer, save_tiny_model
from tools.bench.concurrency.workload import Setting, SizedServer, Window, measure

KV_BYTES_PER_TOKEN = 2 * 2 * 1 * 32 * 4
"""Tiny Qwen3 (agrpo_attention.testing defaults): 2 layers x (K, V) x 1 KV head x head_dim 32 x float32."""


def _settings(caps: list[int]) -> list[Setting]:
    fixed = [Setting(name=f"fixed {cap}", control="fixed", cap=cap) for cap in caps]
    bound = max(caps)
    return [
        *fixed,
        Setting(name=f"goodput (<= {bound})", control="goodput", cap=bound),
        Setting(name=f"kv_usage (<= {bound})", control="kv_usage", cap=bound),
    ]


def _row(name: str, windows: list[Window]) -> str:
    """One setting over its rounds: tokens/s over the summed windows, summed counts, mean gauges."""
    tokens_per_s = sum(w.generated_tokens for w in windows) / sum(w.seconds for w in windows)
    per_round = "/".join(f"{w.tokens_per_s:,.0f}" for w in windows)
    caps = [c for w in windows for c in w.caps]
    cap_range = f"{min(caps):.0f}-{max(caps):.0f}" if caps else "-"
    gauges = {k: sum(w.gauges[k] for w in windows) / len(windows) for k in ("running", "waiting", "kv_usage")}
    return (
        f"| {name} | {tokens_per_s:,.0f} ({per_round}) | {sum(w.preemptions for w in windows)} | "
        f"{sum(w.completed_rollouts for w in windows)} | {cap_range} | "
        f"{gauges['running']:.1f} / {gauges['waiting']:.1f} | {gauges['kv_usage']:.2f} |"
    )


def _rate(windows: list[Window]) -> float:
    return sum(w.generated_tokens for w in windows) / sum(w.seconds for w in windows)


def mix_bound(points: list[tuple[float, float]], budget: float) -> float:
    """The most tokens/s any time-mix of the fixed caps reaches with at most `budget` preemptions: the upper
    hull of the (preemptions, tokens/s) points at `budget`. A rule that moves the cap over a stationary
    workload spends its time at some caps, so its (preemptions, tokens/s) is such a mix."""
    best = max((t for p, t in points if p <= budget), default=0.0)
    for p_low, t_low in points:
        for p_high, t_high in points:
            if p_low <= budget < p_high:
                best = max(best, t_low + (t_high - t_low) * (budget - p_low) / (p_high - p_low))
    return best


def _best_fixed(by_name: dict[str, list[Window]]) -> str:
    fixed = [n for n, ws in by_name.items() if ws[0].setting.control == "fixed"]
    return max(fixed, key=lambda n: _rate(by_name[n]))


def _judged(name: str, windows: list[Window], best: list[Window], *, same_server: bool = False) -> str:
    """`windows` against the best fixed cap's: the tokens/s ratio (and per round) and the preemption budget."""
    ratio = _rate(windows) / _rate(best)
    budget = sum(w.preemptions for w in best) / 4
    preemptions = sum(w.preemptions for w in windows)
    rounds = ", ".join(f"{g.tokens_per_s / b.tokens_per_s:.2f}" for g, b in zip(windows, best, strict=True))
    met = ratio >= 0.95 and preemptions <= budget
    caps = {c for w in windows for c in w.caps} | {float(w.setting.cap) for w in windows if not w.caps}
    same = same_server and caps == {float(best[0].setting.cap)}  # the best cap all along: one setting, twice
    return (
        f"{name}: {ratio:.2f}x its tokens/s (per round {rounds}), {preemptions} preemptions "
        f"(allowed <= {budget:g}): {'met' if met else 'NOT met'}"
        + (" (its cap equalled that fixed cap throughout: the ratio is the machine's noise)" if same else "")
    )


def _verdict(by_name: dict[str, list[Window]]) -> str:
    """Issue 10's check, plus what bounds it: the best fixed cap within the preemption budget and the best
    time-mix of fixed caps (`mix_bound`), and the per-round ratios (their spread is the machine's noise)."""
    fixed = {n: ws for n, ws in by_name.items() if ws[0].setting.control == "fixed"}
    best = _best_fixed(by_name)
    goodput = next(n for n, ws in by_name.items() if ws[0].setting.control == "goodput")
    budget = sum(w.preemptions for w in fixed[best]) / 4
    within = {n: ws for n, ws in fixed.items() if sum(w.preemptions for w in ws) <= budget}
    best_within = max(within, key=lambda n: _rate(within[n]), default=None)
    points = [(float(sum(w.preemptions for w in ws)), _rate(ws)) for ws in fixed.values()]
    bound = mix_bound(points, budget) / _rate(fixed[best])
    within_text = (
        f"{best_within} ({_rate(within[best_within]):,.0f} tok/s; goodput {_rate(by_name[goodput]) / _rate(within[best_within]):.2f}x it)"
        if best_within
        else "none"
    )
    return (
        f"best fixed: {best} ({_rate(fixed[best]):,.0f} tok/s, {sum(w.preemptions for w in fixed[best])} "
        f"preemptions); {_judged('goodput', by_name[goodput], fixed[best], same_server=True)}\n"
        f"  best fixed cap within the preemption budget: {within_text}; the best time-mix of fixed caps within "
        f"it reaches {bound:.2f}x the best cap's tokens/s"
    )


def _against_default(
    watermark: float, by_name: dict[str, list[Window]], default: dict[str, list[Window]]
) -> str:
    """Every setting run on a `--watermark` server, judged against the default server's best fixed cap."""
    best = _best_fixed(default)
    lines = [f"--watermark {watermark:g}, against the default server's {best}:"]
    lines += [f"  {_judged(name, windows, default[best])}" for name, windows in by_name.items()]
    return "\n".join(lines)


def _run_server(
    name: str, server: SizedServer, tokenizer, args: argparse.Namespace, settings: list[Setting]
) -> dict[str, list[Window]]:
    """Every setting once per round, each round in a rotated order, so a change in the machine's load (or
    anything that drifts within a round) does not favour one setting."""
    by_name: dict[str, list[Window]] = {}
    with server:
        size = server.kv_cache_bytes or server.kv_cache_gib * 2**30
        print(f"\n### {name}: KV cache {size:,} bytes ({size // KV_BYTES_PER_TOKEN:,} tokens)\n", flush=True)
        for round_index in range(args.rounds):
            numbered = list(enumerate(settings))
            shift = (
                round_index * len(numbered) // args.rounds
            )  # each round starts elsewhere: no position bias
            for index, setting in numbered[shift:] + numbered[:shift]:
                window = measure(
                    server, tokenizer, setting, seconds=args.seconds, completion_tokens=args.completion_tokens,
                    prompt_words=args.prompt_words, num_generations=args.num_generations,
                    tag=f"r{round_index:02d}s{index:02d}",
                )  # fmt: skip
                by_name.setdefault(setting.name, []).append(window)
                print(f"round {round_index}: {_row(setting.name, [window])}", flush=True)
    print(
        "\n| setting | generated tok/s (per round) | preemptions | rollouts finished | cap range | "
        "running / waiting (mean) | KV usage (mean) |"
    )
    print("|---|---|---|---|---|---|---|")
    for setting_name, windows in by_name.items():
        print(_row(setting_name, windows))
    return by_name


def main() -> None:
    parser = argparse.ArgumentParser(description="fixed concurrency caps vs adaptive rules, side by side")
    parser.add_argument("--seconds", type=float, default=60.0, help="window per setting and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all settings, interleaved")
    parser.add_argument("--caps", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--small-kv-requests", type=int, default=4, help="full-length requests the small cache holds"
    )
    parser.add_argument("--completion-tokens", type=int, default=512)
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument(
        "--servers", nargs="+", default=["small-kv", "large-kv"], choices=["small-kv", "large-kv"]
    )
    parser.add_argument(
        "--watermarks", type=float, nargs="*", default=[0.05, 0.1, 0.2],
        help="each also starts the server with --watermark W and runs goodput and the bound's fixed cap there",
    )  # fmt: skip
    args = parser.parse_args()
    print(
        f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}; {vars(args)}"
    )
    model_dir = save_tiny_model(Path(tempfile.mkdtemp(prefix="agrpo-bench-concurrency-")))
    tokenizer = build_tokenizer()
    small = args.small_kv_requests * args.max_model_len * KV_BYTES_PER_TOKEN
    sizes = {"small-kv": small, "large-kv": 0}
    bound = max(args.caps)
    on_watermark = [
        Setting(name=f"goodput (<= {bound})", control="goodput", cap=bound),
        Setting(name=f"fixed {bound}", control="fixed", cap=bound),
    ]
    for name in args.servers:
        server = SizedServer(
            model_dir=model_dir, max_model_len=args.max_model_len, kv_cache_bytes=sizes[name]
        )
        default = _run_server(name, server, tokenizer, args, _settings(args.caps))
        print(f"\n{name}: {_verdict(default)}", flush=True)
        for watermark in args.watermarks:
            server = SizedServer(
                model_dir=model_dir, max_model_len=args.max_model_len, kv_cache_bytes=sizes[name],
                watermark=watermark,
            )  # fmt: skip
            by_name = _run_server(f"{name}, --watermark {watermark:g}", server, tokenizer, args, on_watermark)
            print(f"\n{name}: {_against_default(watermark, by_name, default)}", flush=True)


if __name__ == "__main__":
    main()

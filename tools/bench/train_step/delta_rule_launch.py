"""The train-step benchmark under the fastest Triton launch preset that passed parity (`gpu_delta_rule.sh`'s step c).

Run: `python3 -m tools.bench.train_step.delta_rule_launch --from OUT/kernels_*.json -- <train_step arguments>`.
Owns the choice: of the presets measured by `delta_rule_kernels.py` (one JSON file per run), those whose every
ratio passed parity, the one with the smallest Triton forward + backward time at its first ratio; that preset
is set (`delta_rule_kernels.apply_launch`) and printed, then `tools.bench.train_step` runs in this process
with the arguments after `--`. With no passing preset (or no file) it says so and keeps the default table,
so the step's numbers then measure speed only. Afterwards, when the step wrote `--json`, one line per ratio
and kind of row: the delta rule's and the path convolution's seconds and shares of the step, and tree/plain
MFU against the issue's targets. Does not know the step itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .delta_rule_kernels import apply_launch


def best_preset(paths: list[Path]) -> tuple[str | None, dict[str, float]]:
    """(the fastest passing preset or None, each readable preset's fwd+bwd ms, inf where parity failed)."""
    times: dict[str, float] = {}
    for path in paths:
        if not path.is_file():
            continue
        run = json.loads(path.read_text())
        results = run["results"]
        ok = bool(results) and all(r["passed"] for r in results)
        times[run["launch"]] = 1e3 * results[0]["seconds"]["triton_fwd_bwd_s"] if ok else float("inf")
    passing = {k: v for k, v in times.items() if v != float("inf")}
    return (min(passing, key=passing.get) if passing else None), times


SHARE_TARGET, MFU_TARGET = 0.20, 0.95
"""Issue 21: the delta rule at most 20% of the step; tree/plain MFU at least 0.95 (ratios 1 and 3.4)."""


def print_shares(path: Path) -> None:
    """Per ratio of a train-step JSON: delta rule and conv seconds (share of the step), tree/plain MFU."""
    for result in json.loads(path.read_text())["results"]:
        cells = []
        for kind in ("tree", "plain"):
            r = result.get(kind)
            if r and "delta_rule_step_s" in r:
                rule, conv = r["delta_rule_step_s"] / r["seconds"], r.get("conv_step_s", 0.0) / r["seconds"]
                cells.append(f"{kind} step {r['seconds']:.2f} s, delta rule {r['delta_rule_step_s']:.2f} s ({100 * rule:.0f}%"
                             f"{'' if rule <= SHARE_TARGET else ' > 20%'}), conv {r.get('conv_step_s', 0.0):.2f} s "
                             f"({100 * conv:.0f}%)")  # fmt: skip
        mfu = result.get("tree_over_plain_mfu")
        if mfu is not None:
            cells.append(
                f"tree/plain MFU {mfu:.3f}x ({'meets' if mfu >= MFU_TARGET else 'below'} {MFU_TARGET})"
            )
        print(f"shares {result.get('setup', '')} ratio {result['ratio']}: " + "; ".join(cells), flush=True)


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="paths", nargs="*", default=[], help="delta_rule_kernels JSON files")
    args = parser.parse_args(argv[:split])
    preset, times = best_preset([Path(p) for p in args.paths])
    cells = ", ".join(
        f"{k} {v:.2f} ms" if v != float("inf") else f"{k} FAILED parity" for k, v in times.items()
    )
    if preset is None:
        print(f"no launch preset passed parity ({cells or 'no results'}): the default table runs, speed only")
        preset = "default"
    table = apply_launch(preset)
    print(
        f"delta rule launch preset {preset} (fwd+bwd per layer per 16k tokens: {cells}): {table}", flush=True
    )
    from .__main__ import main as train_step

    step_args = argv[split + 1 :]
    sys.argv = ["tools.bench.train_step", *step_args]
    train_step()
    if "--json" in step_args and Path(step_args[step_args.index("--json") + 1]).is_file():
        print_shares(Path(step_args[step_args.index("--json") + 1]))


if __name__ == "__main__":
    main()

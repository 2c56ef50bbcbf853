"""The targets of issues 20 and 31 read back from a `gpu_compile.sh` run: the trainer's own compiled runs, one line
per setup and ratio, then the checks.

Run: `python -m tools.bench.train_step.compile_summary OUT_DIR` (the JSON files the bench wrote there). For
every measured row: MFU (tree / plain), tree/plain MFU, trained tokens/s and their ratio to today's eager
step at the same ratio (the `on` setup without compile, from any file), peak memory, GPU idle; then parity,
graph and recompile counts per setup, the auto choice, and the weight cast's saving (steps with and
without it, eager and compiled). Targets: >= 40% MFU with checkpointing, >= 45% without, tree/plain >= 0.95,
idle < 2%, tokens/s >= 1.5x eager. Does not measure anything.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PARITY_SLACK = 1.5
"""Under amp, compiled regions pass parity when their gradients are at most this many times as far from the
fp32 reference as the eager regions' own bf16 rounding puts them."""
FP32_PARITY = 1e-3
"""Without amp the eager regions are the reference: compiled gradients pass within this relative L2 distance."""


def parity_line(p: dict) -> str:
    """One printed line of `parity`'s result (the bench and `compile_summary.py` print the same)."""
    line = (
        f"loss {p['loss']:.6g} vs eager {p['loss_eager']:.6g} (rel {p['loss_rel_diff']:.2e}), grad rel diff "
        f"{p['grad_rel_diff']:.2e} (worst parameter {p['grad_rel_diff_worst_param']:.2e}"
    )
    if "grad_worst_param" in p:
        line += f" {p['grad_worst_param']}"
    line += f", cosine {p['grad_cosine']:.6f}"
    if "grad_norm_ratio" in p:
        line += f", norm ratio {p['grad_norm_ratio']:.3f}"
    line += ")"
    if "grad_err_ratio" in p:
        line += (
            f"; against fp32: compiled {p['grad_err_compiled']:.2e}, eager {p['grad_err_eager']:.2e} "
            f"(ratio {p['grad_err_ratio']:.2f}, limit {PARITY_SLACK})"
        )
        if "grad_norm_ratio_compiled_fp32" in p:
            line += (
                f", gradient norm over fp32's: compiled {p['grad_norm_ratio_compiled_fp32']:.3f}, "
                f"eager {p['grad_norm_ratio_eager_fp32']:.3f}"
            )
    return line + {True: ": PASS", False: ": FAIL"}.get(p.get("passed"), "")


def _load(folder: Path) -> tuple[list[dict], list[dict], list[dict]]:
    results, setups, runs = [], [], []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        for r in data.get("results", []):
            results.append({**r, "file": path.stem})
        setups += [{**s, "file": path.stem} for s in data.get("setups", [])]
        runs += [{**r, "file": path.stem} for r in data.get("runs", [])]  # trainer_run.py
    return results, setups, runs


def _trainer_run(r: dict) -> str:
    """One `trainer_run.py` run against what compile by default needs: on, no new graph, no break, parity."""
    ok = r["torch_compile"] and r["new_graphs_after_step_2"] == 0 and r["graph_breaks"] == 0
    ok = ok and bool(r["parity"].get("passed"))
    return (
        f"{r['file']}: train() {'LoRA' if r['lora'] else 'full fine-tuning'}, compile {r['torch_compile']}, "
        f"{r['compiled_layers']}/{r['layers']} layers, checkpointing {r['checkpointing']}, first step "
        f"{r['first_step_s']:.0f} s, {r['graphs_by_step_2']} graphs by step 2, {r['new_graphs_after_step_2']} new "
        f"over {r['steps'] - 2} steps, {r['graph_breaks']} breaks, parity {parity_line(r['parity'])}: "
        f"{'ok' if ok else 'MISSED'}"
    )


def _eager(results: list[dict]) -> dict:
    """(model, ratio, kind) -> trained tok/s of today's eager step."""
    out = {}
    for r in results:
        if r["checkpointing"] == "on" and not r["compile"]:
            for kind in ("tree", "plain"):
                if kind in r:
                    out[(r["model"], r["ratio"], kind)] = r[kind]["trained_tok_s"]
    return out


def _line(r: dict, eager: dict) -> str:
    parts = [f"{r['file']:<26} {r['model']:<11} ratio {r['ratio']:<4} {r['checkpointing']:<9}"]
    for kind in ("tree", "plain"):
        if kind not in r:
            continue
        m = r[kind]
        base = eager.get((r["model"], r["ratio"], kind))
        speed = f" ({m['trained_tok_s'] / base:.2f}x eager)" if base else ""
        idle = f" idle {100 * m['gpu_idle_frac']:.1f}%" if "gpu_idle_frac" in m else ""
        chose = f" auto->{m['auto_chose']}" if "auto_chose" in m else ""
        parts.append(
            f"{kind} MFU {100 * m['mfu']:.1f}% {m['trained_tok_s']:.0f} tok/s{speed} {m['peak_gib']:.0f} GiB{idle}{chose}"
        )
    if "tree_over_plain_mfu" in r:
        parts.append(f"tree/plain {r['tree_over_plain_mfu']:.3f}")
    return " | ".join(parts)


def _checks(results: list[dict], eager: dict) -> list[str]:
    out = []
    for r in results:
        if not r["compile"]:
            continue
        for kind in ("tree", "plain"):
            if kind not in r:
                continue
            m, none = r[kind], r["checkpointing"] == "none" or r[kind].get("auto_chose") == "none"
            target = 0.45 if none else 0.40
            base = eager.get((r["model"], r["ratio"], kind))
            flags = [
                f"MFU {'ok' if m['mfu'] >= target else 'MISSED'} ({100 * m['mfu']:.1f}% vs {100 * target:.0f}%)"
            ]
            if base:
                ratio = m["trained_tok_s"] / base
                flags.append(f"tok/s {'ok' if ratio >= 1.5 else 'MISSED'} ({ratio:.2f}x)")
            if "gpu_idle_frac" in m:
                flags.append(
                    f"idle {'ok' if m['gpu_idle_frac'] < 0.02 else 'MISSED'} ({100 * m['gpu_idle_frac']:.1f}%)"
                )
            out.append(f"{r['file']} {r['model']} ratio {r['ratio']} {kind}: " + ", ".join(flags))
        if "tree_over_plain_mfu" in r:
            ok = "ok" if r["tree_over_plain_mfu"] >= 0.95 else "MISSED"
            out.append(
                f"{r['file']} {r['model']} ratio {r['ratio']}: tree/plain MFU {ok} ({r['tree_over_plain_mfu']:.3f})"
            )
    return out


def _weight_cast(results: list[dict]) -> list[str]:
    by = {}
    for r in results:
        if "tree" in r and r["ratio"] == 1.0 and r["checkpointing"] in ("full", "selective"):
            by.setdefault((r["model"], r["compile"], r["checkpointing"]), {})[r["cast_weights"]] = r["tree"][
                "seconds"
            ]
    out = []
    for (model, compiled, mode), seconds in sorted(by.items()):
        if True in seconds and False in seconds:
            saved = 1 - seconds[True] / seconds[False]
            out.append(f"{model} {'compiled' if compiled else 'eager'} {mode}, ratio 1 tree: step {seconds[False]:.3f} s "
                       f"without the cast once, {seconds[True]:.3f} s with it ({100 * saved:.1f}% saved)")  # fmt: skip
    return out


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu_compile")
    results, setups, runs = _load(folder)
    eager = _eager(results)
    for r in runs:
        print(_trainer_run(r))
    print(f"{len(results)} measured setups x ratios in {folder}")
    for r in results:
        print(_line(r, eager))
        if "parity" in r:
            print(f"    parity: {parity_line(r['parity'])}")
    for s in setups:
        if "cast_probe" in s:
            c = s["cast_probe"]
            print(f"{s['file']}: {s['model']}: one bf16 cast of {c['weights']} layer weights ({c['gib']:.1f} GiB moved): "
                  f"{1e3 * c['seconds']:.2f} ms")  # fmt: skip
            continue
        extra = ""
        if "recompile" in s:
            rc = s["recompile"]
            extra = f"; over {rc['steps']} more steps of fresh rows: {rc['new_graphs']} new graphs"
        print(f"{s['file']}: {s['setup']}: {s['graphs']} graphs, {s['graph_breaks']} graph breaks{extra}")
    print("targets:")
    for line in _checks(results, eager) + _weight_cast(results):
        print("  " + line)


if __name__ == "__main__":
    main()

"""Tree packing vs plain padding-free packing: fwd+bwd of a random Qwen3-1.7B-shaped model (and a hybrid).

Run: `uv run python -m tools.bench.tree_attention` (GPU) or `... --tiny` (CPU smoke test, tiny shapes).
For each packing ratio (near 1, 2, 3.4, 8) the same GRPO samples are packed as tree rows and as plain
rows; both are trained (token_logprobs + backward) on the same model; the table shows trained tokens/s,
executed TFLOP/s and MFU for each, the speedup and speedup / ratio; a second table times one
attention layer alone per backend. Results also go to `--json`. Owns the command line and the report;
does not know kernels.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from agrpo_attention import enable_tree_attention

from .measure import PEAK_TFLOPS, attention_only, time_rows
from .model_shapes import SHAPES, build_random_model
from .workload import build_workload


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-1.7b,qwen3-0.6b", help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own)")
    parser.add_argument("--ratios", default="1,2,3.4,8", help="target packing ratios")
    parser.add_argument("--budget", type=int, default=16384, help="forwarded tokens per row")
    parser.add_argument(
        "--tree-backends", default="varlen,cascade,flex", help="attention backends tried for tree rows"
    )
    parser.add_argument(
        "--deltanet-kernel", default="auto", help="Gated DeltaNet kernel of hybrids (torch/fla)"
    )
    parser.add_argument("--plain-backend", default="varlen", help="attention backend of plain rows")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median) after one warm-up")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None, help="write all measurements here")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny models, rows and repeats")
    args = parser.parse_args()
    if args.tiny:
        args.models, args.budget, args.device, args.repeats = "tiny-dense,tiny-hybrid", 512, "cpu", 1
        args.tree_backends = args.plain_backend = "reference"
    return args


def _environment(device: str) -> str:
    import transformers

    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU"
    return f"{name}, torch {torch.__version__}, transformers {transformers.__version__}"


def _run_mode(model, rows, backend: str, args) -> dict:
    enable_tree_attention(model, backend, deltanet_kernel=args.deltanet_kernel)
    try:
        result = time_rows(model, rows, repeats=args.repeats)
    except RuntimeError as error:  # a backend's kernel failing to compile or run: report it, time the others
        print(f"  {backend} failed: {str(error)[:400]}", flush=True)
        model.zero_grad(set_to_none=True)
        return {"backend": backend, "error": str(error)[:2000]}
    trained = sum(r.num_loss_terms for r in rows)
    result |= {
        "backend": backend,
        "rows": len(rows),
        "tokens": sum(r.num_tokens for r in rows),
        "trained_tokens_per_s": trained / result["seconds"],
        "tflops": result["flops"] / result["seconds"] / 1e12,
    }
    result["mfu"] = result["tflops"] / PEAK_TFLOPS
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _attention_table(workload, shape: dict, tree_backends: list[str], plain: str, device: str) -> dict:
    heads = dict(heads=shape["heads"], kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], device=device)
    table = {}
    for label, rows, backends in (
        ("tree", workload.tree_rows, tree_backends),
        ("plain", workload.plain_rows, [plain]),
    ):
        for backend in backends:
            try:
                runs = [attention_only(row, backend, **heads) for row in rows]
            except RuntimeError as error:  # reported in the table, the other backends still run
                table[f"{label}-{backend}"] = {"error": str(error)[:400]}
                continue
            seconds = sum(r["seconds"] for r in runs)
            flops = sum(r["tflops"] * r["seconds"] for r in runs)
            table[f"{label}-{backend}"] = {"seconds": seconds, "tflops": flops / seconds}
    return table


def _print_header(name: str, layers: int, dtype: torch.dtype) -> None:
    print(f"\n{name}, {layers} layers: fwd+bwd of all rows of each workload (median), {dtype}")
    print(
        "ratio | rows tree/plain | tokens tree/plain | mode | s | trained tok/s | TFLOP/s | MFU | speedup | /ratio"
        " | FLOP bound (plain/tree FLOPs, /ratio)"
    )


def _print_ratio(r: dict) -> None:
    """One workload's lines, printed as soon as it is measured (a time limit keeps what was printed)."""
    plain = r["plain"]
    for mode in ["plain", *r["tree"]]:
        m = plain if mode == "plain" else r["tree"][mode]
        label = "plain-" + plain["backend"] if mode == "plain" else "tree-" + mode
        if "error" in m or "error" in plain:
            print(f"{r['ratio']:5.2f} | {label} | failed: {m.get('error', plain.get('error'))[:200]}")
            continue
        speedup, bound = plain["seconds"] / m["seconds"], plain["flops"] / m["flops"]
        print(
            f"{r['ratio']:5.2f} | {r['tree_rows']}/{plain['rows']} | {r['tree_tokens']}/{plain['tokens']} | "
            f"{label} | {m['seconds']:.3f} | {m['trained_tokens_per_s']:,.0f} | {m['tflops']:.0f} | "
            f"{m['mfu']:.1%} | {speedup:.2f}x | {speedup / r['ratio']:.2f} | {bound:.2f}x, {bound / r['ratio']:.2f}"
        )
    cells = ", ".join(
        f"{k} failed" if "error" in v else f"{k} {v['tflops']:.0f} ({v['seconds'] * 1e3:.1f} ms)"
        for k, v in r["attention"].items()
    )
    print(
        f"  attention alone (one layer, fwd+bwd, random q/k/v, TFLOP/s of useful score pairs): {cells}",
        flush=True,
    )


def _bench_model(name: str, args) -> list[dict]:
    shape = SHAPES[name]
    layers = args.layers or shape["layers"]
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = build_random_model(name, layers, args.device, dtype)
    scale = 1 / 32 if args.tiny else 1.0
    tree_backends = args.tree_backends.split(",")
    results = []
    _print_header(name, layers, dtype)
    for target in (float(x) for x in args.ratios.split(",")):
        workload = build_workload(target, args.budget, shape["vocab"], scale=scale)
        tree = {b: _run_mode(model, workload.tree_rows, b, args) for b in tree_backends}
        plain = _run_mode(model, workload.plain_rows, args.plain_backend, args)
        results.append({
            "model": name, "layers": layers, "target": target, "ratio": workload.ratio,
            "tree_rows": len(workload.tree_rows), "tree_tokens": sum(r.num_tokens for r in workload.tree_rows),
            "trained_tokens": workload.trained_tokens, "tree": tree, "plain": plain,
            "attention": _attention_table(workload, shape, tree_backends, args.plain_backend, args.device),
        })  # fmt: skip
        _print_ratio(results[-1])
    return results


def main() -> None:
    args = _arguments()
    print(
        f"tree_attention benchmark on {_environment(args.device)}; budget {args.budget} tokens/row",
        flush=True,
    )
    results = [r for name in args.models.split(",") for r in _bench_model(name, args)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"environment": _environment(args.device), "args": vars(args), "results": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()

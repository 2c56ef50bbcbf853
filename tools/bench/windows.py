"""Sliding windows and attention sinks on a GPU: parity of the tree backends against the fp32 reference, what a
window saves, and tree vs plain training speed for a Gemma 3-like shape.

Run: `python -m tools.bench.windows` on a CUDA machine (`--cpu-dry-run` tests this script on CPU, tiny shapes,
reference backend). One process, every figure printed as it is measured (and written to `--json`):
1. parity, attention alone: a GRPO row at packing ratio ~3.4 (8 completions of 490 tokens under a 2,048-token
   prompt), Gemma 3 4B heads (8 query, 4 key-value, head dim 256), bf16 q/k/v, window 1,024 (Gemma 3 4B's) and
   none, with and without gpt-oss-style sinks (N(0, 1) per head): flex and adaptive outputs and q/k/v/sink
   gradients against the reference backend's fp32 math on the same bf16 inputs. Rule: relative L2 <= 1e-2
   (bf16 rounds at ~4e-3);
2. what the window saves, attention alone: fwd+bwd seconds of the same row with and without the window (flex),
   beside the ratio of attended pairs (the block lists skip every block outside the window);
3. training speed: a Gemma 3-like model (4B widths, 6 layers: 5 sliding + 1 global, window 1,024, vocab 32k),
   fp32 master weights under bf16 autocast as the trainer runs it, token_logprobs + backward, tree rows
   (`enable_tree_attention` "auto") vs plain padding-free rows of the same samples at ratios 1, 3.4 and 8:
   trained tokens/s of each and their ratio (median of 3 after a warm-up);
4. (`--families`) the tiny gpt-oss, Gemma 2, Gemma 3 and Mistral models of `agrpo_attention.testing` (window 8,
   4 layers) in fp32 on the device: packed tree rows through flex and adaptive (with their backward, which
   FlexAttention has on CUDA only) against each sample alone through the stock model's eager attention:
   largest log-prob gap and worst parameter-gradient relative error (rule: 2e-5 and 2e-4, as the CPU tests).
Exits non-zero if a parity check fails. Does not know the trainer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from agrpo_attention import build_tree_plan, enable_tree_attention, token_logprobs

from .tree_attention.workload import build_workload

GEMMA3_4B = dict(hidden=2560, mlp=10240, heads=8, kv_heads=4, head_dim=256, window=1024, vocab=32768)
TINY = dict(hidden=64, mlp=128, heads=2, kv_heads=1, head_dim=32, window=16, vocab=512)
TOLERANCE = 1e-2


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _report(results: list[dict], entry: dict) -> None:
    results.append(entry)
    print(json.dumps(entry), flush=True)


def attention_parity(
    shape: dict, device: str, backends: list[str], scale: float, results: list[dict]
) -> bool:
    row = build_workload(3.4, int(12288 * scale), vocab=1000, scale=scale).tree_rows[0]
    gen = torch.Generator(device=device).manual_seed(0)
    n, heads, kv_heads, dim = row.num_tokens, shape["heads"], shape["kv_heads"], shape["head_dim"]
    low = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (
        torch.randn(1, h, n, dim, device=device, generator=gen).to(low) for h in (heads, kv_heads, kv_heads)
    )
    sinks_value = torch.randn(heads, device=device, generator=gen)
    grad = torch.randn(1, n, heads, dim, device=device, generator=gen).to(low)
    passed = True
    for window in (shape["window"], None):
        windows = () if window is None else (window,)
        for with_sinks in (False, True):
            truth_in = [x.detach().float().requires_grad_() for x in (q, k, v, sinks_value)]
            truth_sinks = truth_in[3] if with_sinks else None
            truth_plan = build_tree_plan(row, backend="reference", device=device, windows=windows)
            truth = truth_plan.attend(*truth_in[:3], scaling=dim**-0.5, window=window, sinks=truth_sinks)
            wrt = truth_in if with_sinks else truth_in[:3]
            truth_grads = torch.autograd.grad(truth, wrt, grad.float())
            for backend in backends:
                inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                sinks = sinks_value.detach().clone().requires_grad_() if with_sinks else None
                plan = build_tree_plan(row, backend=backend, device=device, windows=windows)
                out = plan.attend(*inputs, scaling=dim**-0.5, window=window, sinks=sinks)
                grads = torch.autograd.grad(out, inputs + ([sinks] if with_sinks else []), grad)
                errors = [_relative(out, truth)] + [
                    _relative(g, t) for g, t in zip(grads, truth_grads, strict=True)
                ]
                ok = max(errors) <= TOLERANCE
                passed &= ok
                _report(results, {"check": "parity", "backend": backend, "window": window, "sinks": with_sinks,
                                  "tokens": n, "errors_out_dq_dk_dv_dsinks": errors, "ok": ok})  # fmt: skip
    return passed


def window_savings(shape: dict, device: str, backend: str, scale: float, results: list[dict]) -> None:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for ratio in (3.4, 8.0):
        row = build_workload(ratio, int(16384 * scale), vocab=1000, scale=scale).tree_rows[0]
        n = row.num_tokens
        q = torch.randn(
            1, shape["heads"], n, shape["head_dim"], device=device, dtype=dtype, requires_grad=True
        )
        k, v = (torch.randn(1, shape["kv_heads"], n, shape["head_dim"], device=device, dtype=dtype,
                            requires_grad=True) for _ in range(2))  # fmt: skip
        grad = torch.randn(1, n, shape["heads"], shape["head_dim"], device=device, dtype=dtype)
        entry = {"check": "window_savings", "backend": backend, "ratio": ratio, "tokens": n}
        for window in (None, shape["window"]):
            plan = build_tree_plan(
                row, backend=backend, device=device, windows=() if window is None else (window,)
            )
            samples = []
            for attempt in range(5):
                _sync(device)
                start = time.perf_counter()
                plan.attend(q, k, v, window=window).backward(grad)
                _sync(device)
                samples.append(time.perf_counter() - start) if attempt >= 2 else None
            key = "windowed" if window else "full"
            entry[f"{key}_seconds"] = statistics.median(samples)
            entry[f"{key}_pairs"] = plan.layout.score_pairs_within(window)
        entry["time_ratio"] = entry["windowed_seconds"] / entry["full_seconds"]
        entry["pairs_ratio"] = entry["windowed_pairs"] / entry["full_pairs"]
        _report(results, entry)


def gemma3_like(shape: dict, device: str, layers: int):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["mlp"],
        num_hidden_layers=layers, num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], query_pre_attn_scalar=shape["head_dim"], sliding_window=shape["window"],
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        max_position_embeddings=131072,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train()


def training_speed(shape: dict, device: str, layers: int, scale: float, results: list[dict]) -> None:
    model = gemma3_like(shape, device, layers)
    backend = enable_tree_attention(model)
    for ratio in (1.0, 3.4, 8.0):
        workload = build_workload(ratio, int(16384 * scale), vocab=shape["vocab"], scale=scale)
        entry = {
            "check": "training_speed",
            "backend": backend,
            "ratio": round(workload.ratio, 2),
            "layers": layers,
        }
        for mode, rows in (("tree", workload.tree_rows), ("plain", workload.plain_rows)):
            plans = [build_tree_plan(row, model) for row in rows]
            rows = [row.to(device) for row in rows]
            samples = []
            for attempt in range(4 if device == "cuda" else 2):
                model.zero_grad(set_to_none=True)
                _sync(device)
                start = time.perf_counter()
                for row, plan in zip(rows, plans, strict=True):
                    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                        logprobs = token_logprobs(model, row, plan=plan)
                    (logprobs * row.advantages.to(logprobs.device)).sum().backward()
                _sync(device)
                samples.append(time.perf_counter() - start) if attempt >= 1 else None
            seconds = statistics.median(samples)
            entry[f"{mode}_trained_tokens_per_s"] = workload.trained_tokens / seconds
            entry[f"{mode}_rows"] = len(rows)
        entry["tree_over_plain"] = entry["tree_trained_tokens_per_s"] / entry["plain_trained_tokens_per_s"]
        if device == "cuda":
            entry["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        _report(results, entry)
        model.zero_grad(set_to_none=True)


def family_parity(device: str, backends: list[str], results: list[dict]) -> bool:
    import copy

    from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
    from agrpo_packing import TreeRow
    from agrpo_packing.testing import GroupShape, assert_packed_logprobs_match, random_grpo_groups

    tokenizer = build_tokenizer()
    shape = GroupShape(num_prompts=2, rollouts_per_prompt=3, prompt_tokens=(3, 25), completion_tokens=(1, 50),
                       multi_turn_frac=0.5, tool_tokens=(1, 8), fork_frac=0.7, vocab_size=512)  # fmt: skip
    tree_row = TreeRow(0)
    tree_row.extend(random_grpo_groups(shape, seed=1))
    row = tree_row.pack()
    weights = torch.randn(row.num_loss_terms, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    passed = True
    for kind in ("gpt_oss", "gemma2", "gemma3", "mistral"):
        stock = build_model(TinyModelSpec(kind=kind, num_layers=4, sliding_window=8), tokenizer).to(device)
        stock.set_attn_implementation("eager")

        def alone(input_ids: torch.Tensor, model=stock) -> torch.Tensor:
            logits = model(input_ids=input_ids.to(device)[None], use_cache=False).logits[0, :-1].double()
            return logits.log_softmax(-1).gather(1, input_ids.to(device)[1:, None])[:, 0]

        for backend in backends:
            stock.zero_grad()
            tree = copy.deepcopy(stock)
            enable_tree_attention(tree, backend)
            packed, reference = assert_packed_logprobs_match(
                row, lambda r, m=tree: token_logprobs(m, r).double(), alone, atol=1.0, rtol=0
            )
            gap = float((packed - reference).abs().max())
            (packed * weights.to(device)).sum().backward()
            (reference * weights.to(device)).sum().backward()
            pairs = zip(tree.named_parameters(), stock.named_parameters(), strict=True)
            worst = max(_relative(p.grad, q.grad) for (_, p), (_, q) in pairs if q.grad is not None)
            ok = gap <= 2e-5 and worst <= 2e-4
            passed &= ok
            _report(results, {"check": "family", "kind": kind, "backend": backend, "logprob_gap": gap,
                              "worst_grad_rel": worst, "ok": ok})  # fmt: skip
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on CPU, reference backend")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--json", default=None)
    parser.add_argument("--families", action="store_true", help="only check 4 (tiny windowed families)")
    args = parser.parse_args()
    device, shape, scale = ("cpu", TINY, 1 / 16) if args.cpu_dry_run else ("cuda", GEMMA3_4B, 1.0)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}", flush=True)
    results: list[dict] = []
    backends = ["reference"] if device == "cpu" else ["flex", "adaptive"]
    if args.families:
        passed = family_parity(device, backends, results)
        _write(args.json, name, results)
        sys.exit(0 if passed else 1)
    passed = attention_parity(shape, device, backends, scale, results)
    window_savings(shape, device, backends[0], scale, results)
    training_speed(shape, device, 2 if device == "cpu" else args.layers, scale, results)
    _write(args.json, name, results)
    sys.exit(0 if passed else 1)


def _write(path: str | None, device_name: str, results: list[dict]) -> None:
    if path:
        with open(path, "w") as out:
            json.dump({"device": device_name, "torch": torch.__version__, "results": results}, out, indent=1)


if __name__ == "__main__":
    main()

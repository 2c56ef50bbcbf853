"""The train step's cost of MoE routing replay: `token_logprobs` + backward of one packed row, replay off vs on.

Run: `uv run python -m tools.bench.routing_replay [--device cpu] [--shape small] [--regions stock]`. One random
Qwen3-MoE (transformers' class, tree attention, the reference backend on CPU and `auto` on CUDA; fp32 on CPU, on
CUDA the trainer's fp32 weights under bf16 autocast), one packed GRPO row;
three variants measured interleaved, repeat after repeat, median of each: `live` (the row carries no routes:
the stock forward), `measured` (routes present, `replay=False`: live routing plus the agreement count) and
`replayed` (`replay=True`). The routes are the model's own live ones, so every variant sends each token to the
same experts and only replay's own work differs. `--regions eager|compiled` runs the decoder layers through the
trainer's own regions (full activation checkpointing, so the recompute replays too; `compiled`: per-layer
torch.compile) instead of transformers' stock layers. Prints the hardware, the shape, each variant's median
milliseconds and its ratio to `live`, and how far replaying the model's own routes moved the log-probs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import statistics
import time

import torch

from agrpo_attention import enable_routing_replay, enable_tree_attention, token_logprobs
from agrpo_packing import TreeRow
from agrpo_packing.testing import GroupShape, random_grpo_groups

SHAPES = {
    "tiny": dict(hidden=64, experts=4, top_k=2, expert_width=32, layers=2, heads=2, prompts=1, vocab=512),
    "small": dict(hidden=256, experts=8, top_k=2, expert_width=128, layers=4, heads=4, prompts=1, vocab=4096),
    "qwen3_30b_a3b": dict(
        hidden=2048, experts=128, top_k=8, expert_width=768, layers=4, heads=32, prompts=8, vocab=151936
    ),
}
"""`tiny`: the smoke test's; `small`: the CPU measurement's; `qwen3_30b_a3b`: that model's layer shape (4 of its 48
layers), for a GPU."""


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "amp": torch.float32}
"""The weights' dtype of each `--precision`; `amp` runs the step under bf16 autocast, as the trainer does."""


def _precision_context(precision: str, device: str):
    if precision == "amp":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _model(shape: dict, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=4 * shape["hidden"],
        moe_intermediate_size=shape["expert_width"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=max(1, shape["heads"] // 8), head_dim=128,
        num_experts=shape["experts"], num_experts_per_tok=shape["top_k"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).train()
    enable_tree_attention(model, "reference" if device == "cpu" else "auto")
    return model


def _row(shape: dict):
    groups = GroupShape(
        num_prompts=shape["prompts"], rollouts_per_prompt=8, prompt_tokens=(200, 400),
        completion_tokens=(100, 300), vocab_size=shape["vocab"],
    )  # fmt: skip
    row = TreeRow(0)
    row.extend(random_grpo_groups(groups, seed=0))
    return row.pack()


def _own_routes(model, row, precision: str) -> torch.Tensor:
    """(N, L, K) int16: the experts each packed token goes to under live routing."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out[2]))
             for layer in model.model.layers]  # fmt: skip
    with torch.no_grad(), _precision_context(precision, str(next(model.parameters()).device)):
        token_logprobs(model, row)
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, 1).to(device="cpu", dtype=torch.int16)


def _install_regions(model, regions: str) -> None:
    """The trainer's decoder-layer regions (after replay's patch, as the trainer orders them)."""
    from agrpo_trainer._layer_region import LayerRegions, RegionSettings

    enable_routing_replay(model, replay=False)
    if regions != "stock":
        LayerRegions(RegionSettings(compile=regions == "compiled", checkpointing="full")).install(model)


def _step_ms(model, row, device: str, precision: str) -> float:
    """One forward + backward of `row`, in milliseconds (synchronised on CUDA)."""
    model.zero_grad(set_to_none=True)
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with _precision_context(precision, device):
        logprobs = token_logprobs(model, row)
    logprobs.sum().backward()
    if device != "cpu":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the measurement; returns each variant's median milliseconds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--precision", choices=sorted(PRECISIONS), help="default: fp32 on CPU, amp on CUDA")
    parser.add_argument("--regions", default="stock", choices=("stock", "eager", "compiled"))
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: steadier on a shared machine)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    precision = args.precision or ("fp32" if args.device == "cpu" else "amp")
    dtype = PRECISIONS[precision]
    model, row = _model(shape, args.device, dtype), _row(shape)
    routed = dataclasses.replace(row, routed_experts=_own_routes(model, row, precision))
    _install_regions(model, args.regions)
    hardware = (
        torch.cuda.get_device_name() if args.device != "cpu"
        else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads of {os.cpu_count()} cores"
    )  # fmt: skip
    print(f"hardware: {hardware}; {args.shape} Qwen3-MoE ({shape['layers']} layers, hidden {shape['hidden']}, "
          f"{shape['experts']} experts, top-{shape['top_k']}, {precision}, {args.regions} layers, experts "
          f"{model.config._experts_implementation}); row of "
          f"{row.num_tokens} tokens, {row.num_loss_terms} loss terms; median of {args.repeats}", flush=True)  # fmt: skip
    variants = {"live": (False, row), "measured": (False, routed), "replayed": (True, routed)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, (replay, this_row) in variants.items():
            enable_routing_replay(model, replay=replay)
            elapsed = _step_ms(model, this_row, args.device, precision)
            if repeat:
                times[name].append(elapsed)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name:9s}: {medians[name]:8.1f} ms  ({medians[name] / medians['live']:.3f}x live; spread "
              f"{min(values):.1f}-{max(values):.1f})")  # fmt: skip
    with torch.no_grad(), _precision_context(precision, args.device):
        enable_routing_replay(model, replay=False)
        live = token_logprobs(model, row).float()
        enable_routing_replay(model, replay=True)
        replayed = token_logprobs(model, routed).float()
    print(
        f"replaying the model's own routes moved the log-probs by at most {float((replayed - live).abs().max()):.3g}"
    )
    return medians


if __name__ == "__main__":
    main()

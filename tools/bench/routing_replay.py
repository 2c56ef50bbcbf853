"""The train step's cost of MoE routing replay: `token_logprobs` + backward of one packed row, replay off vs on.

Run: `uv run python -m tools.bench.routing_replay [--device cpu] [--shape small]`. One random Qwen3-MoE
(transformers' class, tree attention, the reference backend on CPU and `auto` on CUDA), one packed GRPO row;
three variants measured interleaved, repeat after repeat, median of each: `live` (the row carries no routes:
the stock forward), `measured` (routes present, `replay=False`: live routing plus the agreement count) and
`replayed` (`replay=True`). The routes are the model's own live ones, so every variant sends each token to the
same experts and only replay's own work differs. Prints the hardware, the shape, each variant's median
milliseconds and its ratio to `live`.
"""

from __future__ import annotations

import argparse
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


def _own_routes(model, row) -> torch.Tensor:
    """(N, L, K) int16: the experts each packed token goes to under live routing."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out[2]))
             for layer in model.model.layers]  # fmt: skip
    with torch.no_grad():
        token_logprobs(model, row)
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, 1).to(device="cpu", dtype=torch.int16)


def _step_ms(model, row, device: str) -> float:
    """One forward + backward of `row`, in milliseconds (synchronised on CUDA)."""
    model.zero_grad(set_to_none=True)
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    token_logprobs(model, row).sum().backward()
    if device != "cpu":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the measurement; returns each variant's median milliseconds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: steadier on a shared machine)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model, row = _model(shape, args.device, dtype), _row(shape)
    routed = dataclasses.replace(row, routed_experts=_own_routes(model, row))
    hardware = (
        torch.cuda.get_device_name() if args.device != "cpu"
        else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads of {os.cpu_count()} cores"
    )  # fmt: skip
    print(f"hardware: {hardware}; {args.shape} Qwen3-MoE ({shape['layers']} layers, hidden {shape['hidden']}, "
          f"{shape['experts']} experts, top-{shape['top_k']}, {dtype}); row of {row.num_tokens} tokens, "
          f"{row.num_loss_terms} loss terms; median of {args.repeats}", flush=True)  # fmt: skip
    variants = {"live": (False, row), "measured": (False, routed), "replayed": (True, routed)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, (replay, this_row) in variants.items():
            enable_routing_replay(model, replay=replay)
            elapsed = _step_ms(model, this_row, args.device)
            if repeat:
                times[name].append(elapsed)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name:9s}: {medians[name]:8.1f} ms  ({medians[name] / medians['live']:.3f}x live; spread "
              f"{min(values):.1f}-{max(values):.1f})")  # fmt: skip
    return medians


if __name__ == "__main__":
    main()

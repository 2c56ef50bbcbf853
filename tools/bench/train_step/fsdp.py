"""The train-step benchmark over several GPUs with FSDP2, next to one GPU in the same run; and a weight sync
from the sharded model.

Run: `python -m tools.bench.train_step.fsdp --world 2 [--sync]` (GPUs: NCCL, one process per GPU) or
`... --tiny` (CPU smoke test: gloo, two processes, tiny shapes). The parent process runs the one-GPU
reference first (world 1, no sharding, on GPU 0, no process group), then spawns `--world` ranks
(torch.multiprocessing).
Every rank builds the same random model (seed 0) and shards it the way the trainer is sharded under
accelerate's FSDP2: `fully_shard` on every decoder layer, then on the root (embedding, final norm and the
tied head), with accelerate's bf16 policy `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16,
output_dtype=bf16)` over fp32 master weights for `amp`. The same GRPO samples are planned with
`num_ranks=world` (one row per rank per micro-batch; rank r trains row r, as the trainer's
`get_batch_samples` scatters them), and each rank runs `micro_batch_loss(world_size=world)`.

Measured for each world size: the loss curve (`--curve-steps` optimizer steps at `--curve-lr` on the same
fixed samples from the same weights; the step loss is the token mean over every rank's rows), then trained
tokens/s per GPU (median of `--steps` after a warm-up; a step lasts as long as its slowest rank). With
`--sync`, after the steps of the sharded run: `WeightSync` (NCCL backend) from the FSDP2 model, every rank
joining the bucketed gathers and rank 0 sending, to the stub receiver (`tools/bench/weight_sync/
stub_worker.py`) on GPU 1, timed against the raw NCCL broadcast of the same chunks through the same
communicator, and the receiver's checksums compared with the full weights. Does not know the step code
beyond `step.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agrpo_attention import build_tree_plan, enable_tree_attention

from ..tree_attention.measure import PEAK_TFLOPS, step_flops
from ..tree_attention.model_shapes import build_random_model, stock_checkpointing
from .data import grpo_samples
from .step import plan_batches, timed_step

LOSS_TOLERANCE = 2e-3
"""Largest |loss(world) - loss(1 GPU)| per curve step, relative to the curve's scale (max(1, mean |loss|)):
the rows differ (each rank packs its own), so bf16 rounding and the ranks' gradient reduction differ too."""


def _arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (GPUs) of the sharded run")
    parser.add_argument(
        "--model", default="qwen3-1.7b", help="a shape of tools/bench/tree_attention/model_shapes"
    )
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--ratio", type=float, default=1.0, help="target packing ratio (1, 3.4 or 8)")
    parser.add_argument("--prompts", type=int, default=8, help="groups per step")
    parser.add_argument("--budget", type=int, default=16384, help="forwarded tokens per row")
    parser.add_argument("--checkpointing", default="on", choices=["on", "off"])
    parser.add_argument("--precision", default="amp", choices=["amp", "bf16"])
    parser.add_argument("--backend", default="auto", help="agrpo-attention backend")
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps (median) after a warm-up")
    parser.add_argument("--curve-steps", type=int, default=4, help="optimizer steps of the loss curve")
    parser.add_argument("--curve-lr", type=float, default=1e-5, help="AdamW learning rate of every step")
    parser.add_argument("--sync", action="store_true", help="weight sync from the sharded model to the stub")
    parser.add_argument("--sync-iters", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--tiny", action="store_true", help="CPU smoke test: gloo, tiny model, rows and steps"
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.model = args.model if args.model.startswith("tiny-") else "tiny-dense"
        args.budget, args.device, args.prompts = 256, "cpu", 4
        args.backend, args.precision, args.curve_lr = "reference", "bf16", 3e-2
        args.steps, args.curve_steps, args.sync_iters = 1, 3, 2
    return args


def _shard(model: torch.nn.Module, amp: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16
    ) if amp else MixedPrecisionPolicy()  # fmt: skip
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def _model(args, rank: int, world: int):
    cuda = args.device == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    dtype = torch.float32 if args.precision == "amp" else torch.bfloat16
    model = build_random_model(args.model, args.layers, device, dtype)
    enable_tree_attention(model, args.backend)
    if args.checkpointing == "on":
        stock_checkpointing(model, True)
    if world > 1:
        _shard(model, args.precision == "amp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.curve_lr, fused=cuda)
    return model, optimizer


def _hardware(args, world: int) -> str:
    if args.device != "cuda":
        return f"CPU ({os.cpu_count()} cores), gloo, {world} process(es)"
    return f"{world}x {torch.cuda.get_device_name()}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"


def _world_max(value: float, world: int) -> float:
    if world == 1:
        return value
    box = torch.tensor([value], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box)


def _world_sum(value: float, world: int) -> float:
    if world == 1:
        return value
    box = torch.tensor([value], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(box)
    return float(box)


def run_world(args, rank: int, world: int) -> dict:
    """One world size on this rank: the loss curve, then timed steps; rank 0's summary (others: {})."""
    model, optimizer = _model(args, rank, world)
    samples = grpo_samples(
        args.ratio, num_prompts=args.prompts, vocab=model.config.vocab_size, tiny=args.tiny
    )
    batches = plan_batches(samples, args.budget, share_prefixes=True, num_ranks=world)
    rows = [batch[rank] for batch in batches]
    step_tokens = sum(row.num_loss_terms for batch in batches for row in batch)
    amp = args.precision == "amp"

    def step():
        times = timed_step(model, optimizer, rows, amp=amp, world_size=world, step_tokens=step_tokens)
        return times, _world_sum(times.loss, world) / world, _world_max(times.total_s, world)

    curve = [step()[1] for _ in range(args.curve_steps)]
    step()  # warm-up of the timed steps
    timed = [step() for _ in range(args.steps)]
    seconds = statistics.median(t[2] for t in timed)
    plans = [build_tree_plan(row, model) for row in rows]
    flops = _world_sum(step_flops(model, rows, plans), world)
    peak = _world_max(max(t[0].peak_gib for t in timed), world)
    out = {
        "world": world, "micro_batches": len(batches), "trained_tokens": step_tokens, "seconds": seconds,
        "trained_tok_s_per_gpu": step_tokens / seconds / world, "mfu": flops / world / seconds / (PEAK_TFLOPS * 1e12),
        "peak_gib": peak, "loss_curve": curve, "hardware": _hardware(args, world),
    }  # fmt: skip
    if args.sync and world > 1:
        from .fsdp_sync import sync_from_sharded

        out["sync"] = sync_from_sharded(model, rank, world, args)
    return out if rank == 0 else {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, args, port: int, out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo", rank=rank, world_size=world,
        device_id=torch.device("cuda", rank) if cuda else None,
    )  # fmt: skip
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        result = run_world(args, rank, world)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def compare(one: dict, many: dict) -> dict:
    """Tokens/s per GPU and the loss curve of the sharded run against one GPU."""
    scale = max(1.0, statistics.fmean(abs(x) for x in one["loss_curve"]))
    diffs = [abs(a - b) / scale for a, b in zip(one["loss_curve"], many["loss_curve"], strict=True)]
    return {
        "tok_s_per_gpu_ratio": many["trained_tok_s_per_gpu"] / one["trained_tok_s_per_gpu"],
        "loss_max_rel_diff": max(diffs),
        "loss_curve_moves": abs(one["loss_curve"][-1] - one["loss_curve"][0]) / scale,
        "loss_within_tolerance": max(diffs) <= LOSS_TOLERANCE,
    }


def _print(one: dict, many: dict, verdict: dict) -> None:
    for r in (one, many):
        curve = ", ".join(f"{x:.5f}" for x in r["loss_curve"])
        print(f"  world {r['world']}: {r['micro_batches']} micro-batches, step {r['seconds']:.2f} s, trained tok/s per GPU "
              f"{r['trained_tok_s_per_gpu']:.0f}, MFU {100 * r['mfu']:.1f}%, peak {r['peak_gib']:.1f} GiB; loss curve {curve}")  # fmt: skip
    print(f"  tok/s per GPU, world {many['world']} / world 1: {verdict['tok_s_per_gpu_ratio']:.3f} (target >= 0.90); "
          f"loss curve max |diff| {verdict['loss_max_rel_diff']:.2e} of its scale (tolerance {LOSS_TOLERANCE:.0e}; "
          f"the curve itself moves {verdict['loss_curve_moves']:.2e}): "
          f"{'within' if verdict['loss_within_tolerance'] else 'OUTSIDE'} tolerance", flush=True)  # fmt: skip
    if "sync" in many:
        s = many["sync"]
        print(f"  weight sync from the FSDP2 model ({s['bytes'] / 1e9:.2f} GB, {s['chunks']} chunks): transfer "
              f"{s['transfer_s'] * 1e3:.1f} ms vs raw NCCL broadcast {s['raw_s'] * 1e3:.1f} ms: ratio "
              f"{s['transfer_s'] / s['raw_s']:.2f}x (target <= 1.5x); whole sync median {s['sync_s'] * 1e3:.1f} ms; "
              f"receiver checksums match: {s['checksums_match']}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = _arguments(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        raise SystemExit(
            f"--world {args.world} needs {args.world} GPUs; this machine has {torch.cuda.device_count()}"
        )
    print(f"train_step FSDP2, torch {torch.__version__}, {args.model} {args.precision}, checkpointing "
          f"{args.checkpointing}, ratio {args.ratio}, {args.prompts} prompts/step, budget {args.budget}", flush=True)  # fmt: skip
    if args.device == "cuda":
        torch.cuda.set_device(0)
    results = {1: run_world(args, 0, 1)}  # one GPU, in this process: no process group, no sharding
    if args.device == "cuda":
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as scratch:
        out_file = os.path.join(scratch, "sharded.json")
        mp.spawn(_rank, args=(args.world, args, _free_port(), out_file), nprocs=args.world, join=True)
        with open(out_file) as f:
            results[args.world] = json.load(f)
    verdict = compare(results[1], results[args.world])
    print(f"  hardware: {results[args.world]['hardware']}")
    _print(results[1], results[args.world], verdict)
    summary = {"args": vars(args), "one": results[1], "sharded": results[args.world], **verdict}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()

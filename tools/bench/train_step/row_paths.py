"""The three ways rows reach the device (`step.ROW_PATHS`), side by side on the same rows and model.

Run: `python3 -m tools.bench.train_step.row_paths [--ratios 1,8] [--repeats 3]` (GPU; `--tiny` on CPU).
Each repeat times one optimizer step per path, in a rotated order, after one warm-up step per path;
printed: the median step seconds per path and each path's ratio to `sequential`. Written after the
policy-step issue measured the `RowPrefetcher` thread 18% slower than the sequential path at ratio 8
(GIL contention between plan building and kernel launches, inferred), to decide which path the trainer
takes. Does not measure memory or MFU (`__main__.py` does).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from agrpo_attention import enable_tree_attention

from ..tree_attention.model_shapes import build_random_model, stock_checkpointing
from .data import grpo_samples
from .step import ROW_PATHS, plan_rows, timed_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--ratios", default="1,8")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    name = "tiny-dense" if args.tiny else args.model
    budget = 256 if args.tiny else args.budget
    model = build_random_model(name, None, device, torch.float32)
    enable_tree_attention(model, "reference" if args.tiny else "auto")
    stock_checkpointing(model, True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=device == "cuda")
    print(
        f"row paths on {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, {name}, amp, checkpointing on"
    )
    for ratio in (float(r) for r in args.ratios.split(",")):
        samples = grpo_samples(ratio, num_prompts=args.prompts, vocab=model.config.vocab_size, tiny=args.tiny)
        for label, share in (("tree", True), ("plain", False)):
            rows = plan_rows(samples, budget, share_prefixes=share)
            for path in ROW_PATHS:
                timed_step(model, optimizer, rows, amp=True, path=path)
            seconds = {path: [] for path in ROW_PATHS}
            for repeat in range(args.repeats):
                order = ROW_PATHS[repeat % 3 :] + ROW_PATHS[: repeat % 3]
                for path in order:
                    seconds[path].append(timed_step(model, optimizer, rows, amp=True, path=path).total_s)
            median = {path: statistics.median(s) for path, s in seconds.items()}
            cells = "  ".join(
                f"{path} {median[path]:.3f} s ({median[path] / median['sequential']:.3f}x)"
                for path in ROW_PATHS
            )
            print(f"ratio {ratio:g} {label:<5} rows {len(rows):>3}  {cells}", flush=True)


if __name__ == "__main__":
    main()

"""`agrpo-rollout eval ...`: the command line of the evaluation harness.

Owns argument parsing and printing only; the work is `_evaluation.evaluate`. Run
`agrpo-rollout eval --help` for every flag.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from ._config import RolloutConfig
from ._evaluation import evaluate, load_eval_dataset, resolve_reward


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agrpo-rollout", description="Rollouts against a vLLM server.")
    commands = parser.add_subparsers(dest="command", required=True)
    ev = commands.add_parser("eval", help="run a dataset and print mean reward, pass@1, pass@K, tokens/s")
    ev.add_argument("--base-url", default="http://localhost:8000", help="vLLM server base URL")
    ev.add_argument("--model", required=True, help="served model (or LoRA adapter) name")
    ev.add_argument("--tokenizer", help="tokenizer path or hub id; default: --model")
    ev.add_argument(
        "--dataset", required=True, help="a .jsonl/.json/.parquet file, or a reasoning-gym task name"
    )
    ev.add_argument(
        "--num-prompts", type=int, help="first N rows of a file; N items of a gym task (default 100)"
    )
    ev.add_argument("--prompt-column", default="prompt", help="column holding the prompt (text or messages)")
    ev.add_argument("--raw-text", action="store_true", help="send text prompts without the chat template")
    ev.add_argument(
        "--reward",
        action="append",
        required=True,
        help="exact | contains | gym | module:function; repeatable",
    )
    ev.add_argument("--num-generations", type=int, default=8, help="K: rollouts per prompt")
    ev.add_argument("--max-completion-length", type=int, default=1024, help="generated tokens per rollout")
    ev.add_argument("--temperature", type=float, default=1.0)
    ev.add_argument("--top-p", type=float, default=1.0)
    ev.add_argument("--top-k", type=int, default=0)
    ev.add_argument(
        "--max-concurrent-rollouts", type=int, default=64, help="upper bound of rollouts in flight"
    )
    ev.add_argument("--num-sampler-logprobs", type=int, default=0, help="top log-probs per token (0: none)")
    ev.add_argument("--pass-threshold", type=float, default=1.0, help="a rollout passes when reward >= this")
    ev.add_argument("--seed", type=int, default=0, help="seed of procedural datasets")
    ev.add_argument("--output", help="write one JSON line per rollout here")
    ev.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from transformers import AutoTokenizer

    config = RolloutConfig(
        vllm_server_base_url=args.base_url,
        model_name=args.model,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_concurrent_rollouts=args.max_concurrent_rollouts,
        num_sampler_logprobs=args.num_sampler_logprobs,
    )
    rows = load_eval_dataset(
        args.dataset,
        num_prompts=args.num_prompts,
        prompt_column=args.prompt_column,
        seed=args.seed,
        chat=not args.raw_text,
    )
    report = asyncio.run(
        evaluate(
            config,
            tokenizer=AutoTokenizer.from_pretrained(args.tokenizer or args.model),
            dataset=rows,
            reward_funcs=[resolve_reward(r) for r in args.reward],
            output_path=args.output,
            pass_threshold=args.pass_threshold,
            progress=not args.no_progress,
        )
    )
    print(
        f"prompts {report.num_prompts}  rollouts {report.num_rollouts}  mean reward {report.mean_reward:.4f}  "
        f"pass@1 {report.pass_at_1:.4f}  pass@{report.k} {report.pass_at_k:.4f}  tokens/s {report.tokens_per_s:.1f}"
    )
    print(json.dumps(report.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

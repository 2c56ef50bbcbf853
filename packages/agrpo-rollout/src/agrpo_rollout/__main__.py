"""`agrpo-rollout eval ...`: the command line of the evaluation harness.

Owns argument parsing, the order of the start-up checks and printing; the work is `_evaluation.evaluate`.
Checks run cheapest first, so a user error costs seconds, not a model load: flags (the config's own
checks, messages in flag names), `--reward`, the dataset's rows (and the columns the rewards read), the
server (`--server-timeout`, a wrong URL fails at once) and the served names (`--model`), then the
tokenizer (transformers is imported only here) and the prompts' lengths against the server's
`max_model_len`. Each failure is one line on stderr naming the flag to change (exit 2); a server that
fails during the run exits 1 and Ctrl-C exits 130, with the rollouts finished so far already in
`--output`. A finished run prints a one-screen summary, then the same numbers as one JSON line. Run
`agrpo-rollout eval --help` for every flag.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

from ._client import VLLMClient
from ._config import RolloutConfig
from ._eval_dataset import FILE_SUFFIXES, EvalRows, fit_context, load_eval_dataset, prompt_length
from ._evaluation import REWARD_COLUMNS, evaluate, resolve_reward
from ._exceptions import RolloutError, ServerUnavailableError
from ._server import json_body

_FLAG_OF_FIELD = {
    "vllm_server_base_url": "--base-url",
    "model_name": "--model",
    "num_generations": "--num-generations",
    "max_completion_length": "--max-completion-length",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "max_concurrent_rollouts": "--max-concurrent-rollouts",
    "num_sampler_logprobs": "--num-sampler-logprobs",
    "seed": "--seed",
}
_FIELD_NAMES = re.compile(r"(?<![-\w.])(" + "|".join(_FLAG_OF_FIELD) + r")\b")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agrpo-rollout", description="Rollouts against a vLLM server.")
    commands = parser.add_subparsers(dest="command", required=True)
    ev = commands.add_parser("eval", help="run a dataset and print mean reward, pass@1, pass@K, tokens/s")
    ev.add_argument("--base-url", default="http://localhost:8000", help="the vLLM server's root URL (no /v1)")
    ev.add_argument("--model", required=True, help="served model (or LoRA adapter) name")
    ev.add_argument(
        "--tokenizer",
        help="tokenizer directory or hub id; default: --model, which must then be one (a served alias or "
        "LoRA adapter is not: the error names what to pass)",
    )
    ev.add_argument(
        "--server-timeout", type=float, default=15.0, help="seconds to wait for the server to answer /health"
    )
    ev.add_argument(
        "--dataset", required=True, help="a .jsonl/.json/.parquet file, or a reasoning-gym task name"
    )
    ev.add_argument(
        "--num-prompts", type=int, help="first N rows of a file; N items of a gym task (default 100)"
    )
    ev.add_argument("--prompt-column", default="prompt", help="column holding the prompt (text or messages)")
    ev.add_argument(
        "--answer-column", default="answer", help="column the `exact` and `contains` rewards compare with"
    )
    ev.add_argument("--raw-text", action="store_true", help="send text prompts without the chat template")
    ev.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="skip (and count) malformed dataset rows instead of failing",
    )
    ev.add_argument("--dataset-seed", type=int, default=0, help="seed of procedural (reasoning-gym) datasets")
    ev.add_argument(
        "--reward",
        action="append",
        required=True,
        help="exact | contains | gym | module:function (found in the current directory too); repeatable",
    )
    ev.add_argument("--num-generations", type=int, default=8, help="K: rollouts per prompt")
    ev.add_argument("--max-completion-length", type=int, default=1024, help="generated tokens per rollout")
    ev.add_argument("--temperature", type=float, default=1.0)
    ev.add_argument("--top-p", type=float, default=1.0, help="< 1 needs --top-k")
    ev.add_argument("--top-k", type=int, default=0)
    ev.add_argument(
        "--seed", type=int, help="sampling seed: the same seed repeats the run (default: unseeded)"
    )
    ev.add_argument(
        "--max-concurrent-rollouts", type=int, default=64, help="upper bound of rollouts in flight"
    )
    ev.add_argument("--num-sampler-logprobs", type=int, default=0, help="top log-probs per token (0: none)")
    ev.add_argument("--pass-threshold", type=float, default=1.0, help="a rollout passes when reward >= this")
    ev.add_argument("--output", help="write one JSON line per rollout here, as each prompt finishes")
    ev.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def _in_flag_names(message: str) -> str:
    """A library message with the config's field names replaced by this command's flags."""
    return _FIELD_NAMES.sub(lambda m: _FLAG_OF_FIELD[m.group(1)], message)


def _config(args: argparse.Namespace) -> RolloutConfig:
    return RolloutConfig(
        vllm_server_base_url=args.base_url,
        model_name=args.model,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_concurrent_rollouts=args.max_concurrent_rollouts,
        num_sampler_logprobs=args.num_sampler_logprobs,
        seed=args.seed,
    )


async def _served_models(config: RolloutConfig, timeout_s: float) -> list[dict[str, Any]]:
    """`/v1/models` of a server that answers `/health` within `timeout_s`."""
    async with VLLMClient(config) as client:
        try:
            await client.wait_until_ready(timeout_s)
        except ServerUnavailableError as error:  # the wait is --server-timeout's here
            raise ServerUnavailableError(
                str(error).replace("vllm_server_timeout", "--server-timeout")
            ) from error
        return json_body(await client.request("GET", "/v1/models"))["data"]


def served_entry(model: str, served: list[dict[str, Any]]) -> dict[str, Any]:
    """The `/v1/models` entry of `model`; a name the server does not serve raises, listing those it does."""
    by_id = {m["id"]: m for m in served}
    if model not in by_id:
        raise ValueError(
            f"--model {model!r} is not served (the server serves {sorted(by_id)}); pass one of those"
        )
    return by_id[model]


def tokenizer_source(model: str, served: list[dict[str, Any]]) -> str:
    """What to load the tokenizer from without `--tokenizer`: `model` when it is a local directory or the
    name the server loaded it by (a hub id); a served alias or LoRA adapter raises, naming what to pass."""
    entry = served_entry(model, served)
    if Path(model).is_dir() or entry.get("root") in (None, model):
        return model
    if entry.get("parent"):
        by_id = {m["id"]: m for m in served}
        base = by_id.get(entry["parent"], {}).get("root") or entry["parent"]
        raise ValueError(
            f"--model {model!r} is a LoRA adapter of {entry['parent']!r}, not a tokenizer; pass --tokenizer {base}"
        )
    raise ValueError(
        f"--model {model!r} is the server's name for {entry['root']}, not a tokenizer; pass --tokenizer "
        f"{entry['root']} (or the tokenizer's local directory)"
    )


def _max_model_len(model: str, served: list[dict[str, Any]]) -> int | None:
    """The context length the server gives `model` (a LoRA adapter's is its base model's)."""
    entry = served_entry(model, served)
    parent = next((m for m in served if m["id"] == entry.get("parent")), {})
    value = entry.get("max_model_len") or parent.get("max_model_len")
    return int(value) if value else None


def _load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"no tokenizer at {name!r} ({first}); pass --tokenizer with its directory or hub id"
        ) from error


def _fail(error: BaseException | str, code: int) -> int:
    print(f"agrpo-rollout eval: error: {_in_flag_names(str(error))}", file=sys.stderr)
    return code


def _required_columns(args: argparse.Namespace) -> dict[str, str]:
    """File columns the built-in rewards read, with the sentence end that says why (`load_eval_dataset`)."""
    is_file = Path(args.dataset).suffix in FILE_SUFFIXES
    required = {}
    for spec in args.reward:
        if REWARD_COLUMNS.get(spec) == "entry" and is_file:
            raise ValueError(
                f"--reward {spec} scores reasoning-gym tasks with their own scorer; pass a task name as "
                f"--dataset ({args.dataset} is a file), or use --reward exact/contains/module:function"
            )
        if REWARD_COLUMNS.get(spec) == "answer":
            required[args.answer_column] = (
                f"--reward {spec} compares completions with; pass --answer-column naming it"
            )
    return required


def _load_rows(args: argparse.Namespace) -> EvalRows:
    data = load_eval_dataset(
        args.dataset, num_prompts=args.num_prompts, prompt_column=args.prompt_column, seed=args.dataset_seed,
        chat=not args.raw_text, skip_bad_rows=args.skip_bad_rows, required=_required_columns(args),
    )  # fmt: skip
    if args.answer_column != "answer" and Path(args.dataset).suffix in FILE_SUFFIXES:
        for row in data.rows:
            if args.answer_column in row:
                row["answer"] = row.pop(args.answer_column)
    return data


def _prepare(args: argparse.Namespace) -> tuple[RolloutConfig, list, EvalRows, Any]:
    """Every start-up check, cheapest first: config, rewards, dataset, server and model, tokenizer, lengths."""
    config = _config(args)
    reward_funcs = [resolve_reward(r) for r in args.reward]
    data = _load_rows(args)
    served = asyncio.run(_served_models(config, args.server_timeout))
    served_entry(args.model, served)
    tokenizer = _load_tokenizer(args.tokenizer or tokenizer_source(args.model, served))
    limit = _max_model_len(args.model, served)
    if limit is not None:
        lengths = [prompt_length(tokenizer, row["prompt"]) for row in data.rows]
        data = fit_context(data, lengths, limit, skip_bad_rows=args.skip_bad_rows)
    return config, reward_funcs, data, tokenizer


class _FlagNames(logging.Filter):
    """Library warnings (which name config fields) in this command's flag names."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = _in_flag_names(record.getMessage()), ()
        return True


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_FlagNames())
    try:
        config, reward_funcs, data, tokenizer = _prepare(args)
    except (ValueError, RolloutError) as error:
        return _fail(error, 2)
    if data.skipped:
        print(f"skipped {len(data.skipped)} malformed rows (--skip-bad-rows), first: {data.skipped[0]}")
    try:
        report = asyncio.run(
            evaluate(
                config, tokenizer=tokenizer, dataset=data.rows, reward_funcs=reward_funcs,
                output_path=args.output, pass_threshold=args.pass_threshold, progress=not args.no_progress,
            )
        )  # fmt: skip
    except RolloutError as error:
        done = f" (rollouts finished before it are in {args.output})" if args.output else ""
        return _fail(f"{error}{done}", 1)
    except KeyboardInterrupt:  # Ctrl-C: in-flight rollouts were cancelled; what finished is kept
        done = f"; the rollouts finished before it are in {args.output}" if args.output else ""
        print(f"agrpo-rollout eval: interrupted{done}", file=sys.stderr)
        return 130
    print(report.summary(f"agrpo-rollout eval: {args.dataset} on {args.model} at {args.base_url}"))
    if data.skipped:
        print(f"  skipped       {len(data.skipped)} rows (--skip-bad-rows)")
    if args.output:
        print(f"  output        {args.output} (one JSON line per rollout)")
    print(json.dumps({**report.as_dict(), "skipped_rows": len(data.skipped)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

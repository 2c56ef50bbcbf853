"""The `agrpo-trainer` command: `train CONFIG.yaml [--field value ...]` and `demo`.

Owns the parsing. `train` is `transformers.HfArgumentParser` over `RunSpec` and `AsyncGRPOConfig`, so
every config field is a flag with its help text (`--help` lists them all); a YAML or JSON file given
first sets defaults that flags then override, and a key the file misspells is an error naming it. It runs
under `accelerate launch -m agrpo_trainer train ...` (or torchrun) as under plain `python -m`: the Trainer
reads the ranks from the environment and rank 0 alone starts the rollout process. `demo` is the
workspace's main job (`_demo`). Does not know training itself.

    agrpo-trainer train run.yaml --learning_rate 3e-6 --max_steps 200
    accelerate launch --num_processes 2 -m agrpo_trainer train run.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser

from ._config import AsyncGRPOConfig
from ._run_spec import RunSpec

_CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping of a YAML or JSON config file."""
    text = path.read_text()
    if path.suffix == ".json":
        values = json.loads(text)
    else:
        import yaml

        values = yaml.safe_load(text)
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of field: value, got a {type(values).__name__}")
    return values


def train_parser() -> HfArgumentParser:
    # No prefix abbreviations: with ~200 fields, `--num_generation` must be an error, not num_generations.
    parser = HfArgumentParser((RunSpec, AsyncGRPOConfig), prog="agrpo-trainer train", allow_abbrev=False)
    parser.usage = "agrpo-trainer train [CONFIG.yaml|CONFIG.json] [--field value ...]"
    parser.description = (
        "Train with AsyncGRPOTrainer. Every field below can be a flag or a key of the config file; flags win."
    )
    # HfArgumentParser gives `vllm_server_base_url: str | list[str]` nargs="+" but drops its string default:
    # put it back, so an absent flag means the default URL, not None.
    for action in parser._actions:
        if action.dest == "vllm_server_base_url":
            action.default = AsyncGRPOConfig.vllm_server_base_url
    return parser


def parse_train_args(argv: list[str]) -> tuple[RunSpec, AsyncGRPOConfig]:
    """(spec, config) from an optional leading config file and flags."""
    parser = train_parser()
    if argv and not argv[0].startswith("-") and argv[0].endswith(_CONFIG_SUFFIXES):
        path = Path(argv[0])
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        values, argv = read_config_file(path), argv[1:]
        unknown = sorted(set(values) - {a.dest for a in parser._actions if a.dest != "help"})
        if unknown:
            raise ValueError(f"{path}: unknown fields {unknown}; `agrpo-trainer train --help` lists them")
        for (
            action
        ) in parser._actions:  # the file's values become defaults (of `--no_x` too) and satisfy required
            if action.dest in values:
                action.default, action.required = values[action.dest], False
    spec, config, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if rest:
        raise ValueError(f"unrecognised arguments {rest}; `agrpo-trainer train --help` lists the fields")
    return spec, config


def train_command(argv: list[str]) -> None:
    from ._run_spec import load_prompts, resolve_reward_funcs
    from ._trainer import AsyncGRPOTrainer

    try:  # bad input: the message names the fix, and a traceback would bury it
        spec, config = parse_train_args(argv)
        trainer = AsyncGRPOTrainer(
            spec.model_name_or_path,
            reward_funcs=resolve_reward_funcs(spec),
            args=config,
            train_dataset=load_prompts(spec),
        )
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"agrpo-trainer train: error: {exc}") from exc
    trainer.train()


def demo_command(argv: list[str]) -> None:
    from ._demo import main as demo_main

    demo_main(argv)


COMMANDS = {
    "train": (train_command, "train from a YAML/JSON config and flags (--help lists every field)"),
    "demo": (demo_command, "the main job: a tiny model learns against a local CPU vLLM server (~4 min)"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    top = argparse.ArgumentParser(
        prog="agrpo-trainer",
        description="Asynchronous GRPO. Commands: "
        + "; ".join(f"{name}: {text}" for name, (_, text) in COMMANDS.items()),
    )
    top.add_argument("command", choices=sorted(COMMANDS))
    top.parse_args(argv[:1] or ["--help"])
    command, _ = COMMANDS[argv[0]]
    command(argv[1:])

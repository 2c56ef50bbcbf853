"""`RunSpec`: what a command-line run trains (the model, the prompt dataset, the reward functions), by name.

Owns the fields a config file or flag gives beside `AsyncGRPOConfig`'s, and their resolution into the
objects `AsyncGRPOTrainer` takes: `load_prompts` (a local JSON/JSONL/Parquet/CSV file, a folder saved
with `Dataset.save_to_disk` or of data files, else a `datasets` hub name) and `resolve_reward_funcs` (a
public name of `agrpo_trainer.rewards`, or `module:attribute`; a class is instantiated without
arguments). Each failure names the value to change. Does not parse arguments (`_cli` does) nor train.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class RunSpec:
    """The model, prompts and rewards of `agrpo-trainer train` (HfArgumentParser reads the help texts)."""

    model_name_or_path: str = field(metadata={"help": "The policy: a hub id or a local model directory."})
    dataset_name: str = field(
        metadata={
            "help": "Prompts with a `prompt` column: a .json/.jsonl/.parquet/.csv file, a folder (saved with "
            "Dataset.save_to_disk, or of data files), or a `datasets` hub name."
        }
    )
    reward_funcs: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Reward functions, summed: a name from agrpo_trainer.rewards (accuracy_reward, "
            "think_format_reward, CharacterFractionReward) or module:attribute (a function, a callable "
            "instance, or a class built without arguments). Modules resolve from the current directory too."
        },
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "The hub dataset's configuration name."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "The split to train on."})


def load_prompts(spec: RunSpec) -> Any:
    """The `Dataset` that `dataset_name` names (the train split)."""
    import datasets

    path = Path(spec.dataset_name).expanduser()
    if path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"dataset_name={spec.dataset_name!r} is a {path.suffix or 'suffix-less'} file; give a "
                f"{', '.join(sorted(_FILE_BUILDERS))} file, a dataset folder or a hub name"
            )
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    if path.is_dir() and (path / "dataset_info.json").exists():
        return datasets.load_from_disk(str(path))
    split = spec.dataset_train_split
    return datasets.load_dataset(
        str(path) if path.is_dir() else spec.dataset_name, spec.dataset_config, split=split
    )


def _instantiate(obj: Any, name: str) -> Any:
    if not inspect.isclass(obj):
        return obj
    try:
        return obj()
    except TypeError as exc:
        raise ValueError(
            f"reward {name!r} is a class that needs arguments ({exc}); define an instance in a module of yours, "
            f"e.g. `length = LengthReward(target_tokens=256)` in my_rewards.py, and name it 'my_rewards:length'"
        ) from exc


def resolve_reward(name: str) -> Any:
    """One reward function from its name (see `RunSpec.reward_funcs`)."""
    from . import rewards

    if ":" not in name:
        public = sorted(n for n in dir(rewards) if not n.startswith("_") and callable(getattr(rewards, n))
                        and getattr(getattr(rewards, n), "__module__", "") == rewards.__name__)  # fmt: skip
        if name not in public:
            raise ValueError(
                f"reward {name!r} is not a built-in reward (agrpo_trainer.rewards has {', '.join(public)}); "
                "name your own as module:function"
            )
        return _instantiate(getattr(rewards, name), name)
    module_name, _, attribute = name.partition(":")
    if os.getcwd() not in sys.path:  # `my_rewards:f` next to the config; spawned workers inherit sys.path
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r} ({exc})") from exc
    if not hasattr(module, attribute):
        raise ValueError(f"reward {name!r}: module {module_name!r} has no attribute {attribute!r}")
    func = _instantiate(getattr(module, attribute), name)
    if not callable(func):
        raise ValueError(f"reward {name!r} is a {type(func).__name__}, not a callable")
    return func


def resolve_reward_funcs(spec: RunSpec) -> list[Any]:
    if not spec.reward_funcs:
        raise ValueError("no reward function: set reward_funcs (e.g. `reward_funcs: [accuracy_reward]`)")
    return [resolve_reward(name) for name in spec.reward_funcs]

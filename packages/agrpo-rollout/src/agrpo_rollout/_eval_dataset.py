"""Eval datasets: prompt rows from a local file, or the items of a procedural reasoning-gym task.

Owns reading `.jsonl` (line by line, so a bad row is named by file and line), `.json` (a list of
objects, or JSON lines) and `.parquet` (through `datasets`), what a usable row is (an object whose
prompt column holds a non-empty string or a list of `{"role", "content"}` messages, and which has the
columns the rewards read), prompts that leave the server no room to generate (`fit_context`, once the
tokenizer and the server's `max_model_len` are known), and skipping and counting malformed rows when
asked (`skip_bad_rows`). Every problem is a `DatasetError` whose message names the file, the line and
the flag to use. Does not know rewards or the loop (`_evaluation.py`).
"""

from __future__ import annotations

import difflib
import json
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._conversation import render_prompt
from ._exceptions import DatasetError

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True, slots=True)
class EvalRows:
    """The usable rows of an eval dataset, each with a `prompt` column, and what was skipped."""

    rows: list[dict[str, Any]]
    skipped: list[str] = field(default_factory=list)
    """`file:line: reason` of each malformed row skipped (`skip_bad_rows=True`)."""
    origins: list[str] = field(default_factory=list)
    """Where each row came from (`file:line`, `file row N`, `task item N`), in the order of `rows`."""


def _as_messages(prompt: Any) -> Any:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _is_messages(prompt: Any) -> bool:
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    )


def _row_problem(obj: Any, prompt_column: str, required: Mapping[str, str]) -> str | None:
    """Why `obj` is not a usable row, or None. `required`: column -> why it is needed and the flag to pass."""
    if not isinstance(obj, dict):
        return f"a row must be a JSON object, got {type(obj).__name__}"
    if prompt_column not in obj:
        return f"no {prompt_column!r} column (it has {sorted(obj)}); pass --prompt-column naming the prompt"
    for column, why in required.items():
        if column not in obj:
            return f"no {column!r} column (it has {sorted(obj)}), which {why}"
    prompt = obj[prompt_column]
    if (isinstance(prompt, str) and prompt.strip()) or _is_messages(prompt):
        return None
    return (
        f"{prompt_column!r} must be a non-empty string or a list of {{role, content}} messages, "
        f"got {str(prompt)[:80]!r}"
    )


@dataclass(frozen=True, slots=True)
class _NotJSON:
    """A line that did not parse, standing in for its row."""

    problem: str


def _jsonl_objects(path: Path, lines: list[str]) -> Iterator[tuple[str, Any]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", json.loads(line)
        except json.JSONDecodeError as exc:
            yield f"{path}:{number}", _NotJSON(f"not valid JSON ({exc.msg}, column {exc.colno})")


def _file_objects(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, parsed row) per row of the file, in order."""
    if path.suffix == ".parquet":
        import datasets

        table = datasets.load_dataset("parquet", data_files=str(path), split="train")
        yield from ((f"{path} row {i}", dict(row)) for i, row in enumerate(table))
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if path.suffix == ".json":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # not one JSON document: read it as JSON lines
        if isinstance(whole, list):
            yield from ((f"{path} item {i}", obj) for i, obj in enumerate(whole))
            return
    yield from _jsonl_objects(path, text.splitlines())


def _file_rows(
    path: Path, *, num_prompts: int | None, prompt_column: str, chat: bool, skip_bad_rows: bool,
    required: Mapping[str, str],
) -> EvalRows:  # fmt: skip
    rows, skipped, origins = [], [], []
    for where, obj in _file_objects(path):
        if num_prompts is not None and len(rows) >= num_prompts:
            break
        problem = obj.problem if isinstance(obj, _NotJSON) else _row_problem(obj, prompt_column, required)
        if problem is not None:
            if not skip_bad_rows:
                raise DatasetError(
                    f"{where}: {problem}; fix the row, or pass --skip-bad-rows to skip such rows"
                )
            skipped.append(f"{where}: {problem}")
            continue
        row = dict(obj)
        prompt = row.pop(prompt_column)
        row["prompt"] = _as_messages(prompt) if chat else prompt
        rows.append(row)
        origins.append(where)
    if not rows:
        why = f"all {len(skipped)} rows are malformed, first: {skipped[0]}" if skipped else "it is empty"
        raise DatasetError(f"--dataset {path} has no usable rows: {why}")
    return EvalRows(rows, skipped, origins)


def _import_reasoning_gym(spec: str) -> Any:
    try:
        with warnings.catch_warnings():  # one of its dependencies (cellpylib) warns about its own syntax
            warnings.simplefilter("ignore", SyntaxWarning)
            import reasoning_gym
    except ImportError as exc:
        raise DatasetError(
            f"--dataset {spec!r} is neither a {'/'.join(FILE_SUFFIXES)} file nor usable as a reasoning-gym "
            "task: install the extra (`pip install 'agrpo-rollout[gym]'`)"
        ) from exc
    return reasoning_gym


def _gym_rows(spec: str, *, num_prompts: int | None, seed: int, chat: bool) -> EvalRows:
    reasoning_gym = _import_reasoning_gym(spec)
    try:
        items = reasoning_gym.create_dataset(spec, size=num_prompts or 100, seed=seed)
    except ValueError as exc:
        close = difflib.get_close_matches(spec, list(reasoning_gym.factory.DATASETS), n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise DatasetError(
            f"--dataset {spec!r} is neither a {'/'.join(FILE_SUFFIXES)} file nor a reasoning-gym task "
            f"({exc}){hint}"
        ) from exc
    rows = [
        {
            "prompt": _as_messages(item["question"]) if chat else item["question"],
            "answer": str(item["answer"]),
            "entry": json.dumps(item, default=str),
        }
        for item in items
    ]
    return EvalRows(rows, origins=[f"{spec} item {i}" for i in range(len(rows))])


def load_eval_dataset(
    spec: str,
    *,
    num_prompts: int | None = None,
    prompt_column: str = "prompt",
    seed: int = 0,
    chat: bool = True,
    skip_bad_rows: bool = False,
    required: Mapping[str, str] | None = None,
) -> EvalRows:
    """Rows with a `prompt` column: the first `num_prompts` usable rows of a local file, or
    `num_prompts` (default 100) items of a reasoning-gym task drawn with `seed`. `required` maps a column
    every file row must have to the end of the sentence that says why (e.g. "--reward exact compares
    with; pass --answer-column naming it")."""
    path = Path(spec)
    if path.suffix not in FILE_SUFFIXES:
        return _gym_rows(spec, num_prompts=num_prompts, seed=seed, chat=chat)
    if not path.is_file():
        raise DatasetError(f"--dataset {spec}: no such file")
    if path.stat().st_size == 0:
        raise DatasetError(f"--dataset {spec} has no usable rows: it is empty")
    return _file_rows(
        path, num_prompts=num_prompts, prompt_column=prompt_column, chat=chat, skip_bad_rows=skip_bad_rows,
        required=required or {},
    )  # fmt: skip


def prompt_length(tokenizer: Any, prompt: Any, template_kwargs: Mapping[str, Any] | None = None) -> int:
    """Tokens of `prompt` as the loop sends it: text encoded as is, messages through the chat template
    with the generation prompt."""
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt))
    return len(render_prompt(tokenizer, prompt, [], dict(template_kwargs or {})))


def fit_context(data: EvalRows, lengths: list[int], max_model_len: int, *, skip_bad_rows: bool) -> EvalRows:
    """`data` without the rows whose prompt (`lengths[i]` tokens) leaves no room to generate under the
    server's `max_model_len`: the first such row raises `DatasetError` naming it, or with `skip_bad_rows`
    each is skipped and counted. (The loop would send it and get an empty rollout, scored as a failure.)"""
    rows, origins, skipped = [], [], list(data.skipped)
    for row, where, length in zip(data.rows, data.origins, lengths, strict=True):
        if length < max_model_len:
            rows.append(row)
            origins.append(where)
            continue
        problem = f"the prompt is {length} tokens, the server's max_model_len is {max_model_len}: no room to generate"
        if not skip_bad_rows:
            raise DatasetError(
                f"{where}: {problem}; shorten it, restart the server with a larger --max-model-len, or pass "
                "--skip-bad-rows to skip such rows"
            )
        skipped.append(f"{where}: {problem}")
    if not rows:
        raise DatasetError(
            f"no usable rows: all {len(skipped)} are malformed or too long, first: {skipped[0]}"
        )
    return EvalRows(rows, skipped, origins)

"""`log_completions`: a table of sampled completions with their reward and advantage, printed at each log.

Owns `CompletionLog` (a `TrainerCallback` that keeps the samples the optimizer steps of a logging window
trained and, at the window's log, prints `num_completions_to_print` of them, or all, as a `rich` table) and
`completion_rows` (a sample's prompt and completion as text: the tokens before its first trained token are
the prompt; from there on, tool results included, the completion). Does not compute rewards or
advantages: they are the sample's own (`RolloutSample.reward`, `.advantage`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import TrainerCallback

_PROMPT_CHARS = 300
"""Prompts repeat a group's chat template and system prompt: their tail is what tells them apart."""


@dataclass(frozen=True, slots=True)
class CompletionRow:
    step: int
    prompt: str
    completion: str
    reward: float
    advantage: float


def completion_rows(samples: list, tokenizer: Any, step: int) -> list[CompletionRow]:
    """Each sample as text, split at its first trained token."""
    rows = []
    for sample in samples:
        ids = np.asarray(sample.input_ids)
        first = int(np.argmax(sample.trained_mask)) if np.any(sample.trained_mask) else len(ids)
        prompt = tokenizer.decode(ids[:first].tolist(), skip_special_tokens=True)
        completion = tokenizer.decode(ids[first:].tolist(), skip_special_tokens=True)
        rows.append(CompletionRow(step, prompt, completion, float(sample.reward), float(sample.advantage)))
    return rows


def completion_table(rows: list[CompletionRow]) -> Any:
    """A `rich.table.Table` of the rows (rich is imported here: only runs with log_completions need it)."""
    from rich.table import Table

    table = Table(title="completions", show_lines=True)
    for name, justify in (("step", "right"), ("prompt", "left"), ("completion", "left"),
                          ("reward", "right"), ("advantage", "right")):  # fmt: skip
        table.add_column(name, justify=justify, overflow="fold")
    for row in rows:
        prompt = row.prompt if len(row.prompt) <= _PROMPT_CHARS else "…" + row.prompt[-_PROMPT_CHARS:]
        table.add_row(str(row.step), prompt, row.completion, f"{row.reward:.4g}", f"{row.advantage:+.4g}")
    return table


class CompletionLog(TrainerCallback):
    """Prints the window's completions when the Trainer logs (world process zero). Added after the trainer's
    own step hook, so `trainer.last_step_samples` already holds the step's samples at `on_step_end`."""

    def __init__(self, trainer: Any, console: Any = None) -> None:
        from rich.console import Console

        self.trainer = trainer
        self.console = console or Console()
        """Where the table goes (a `rich.console.Console`; standard output by default)."""
        self.rows: list[CompletionRow] = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            tokenizer = self.trainer.processing_class
            self.rows += completion_rows(self.trainer.last_step_samples, tokenizer, state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not self.rows:
            return
        limit = args.num_completions_to_print
        shown = self.rows if limit is None else self.rows[:limit]
        self.console.print(completion_table(shown))
        self.rows = []

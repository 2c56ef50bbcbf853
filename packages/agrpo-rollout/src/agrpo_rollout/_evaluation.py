"""Evaluation: run a prompt set through the rollout loop and report reward, pass@1, pass@K, tokens/s.

Owns the built-in reward functions of the CLI and how `--reward` names are resolved, `EvalReport` and
`evaluate`, which writes each rollout to the output file as its group finishes (a crash loses nothing
done). Does not know argument parsing (`__main__.py`), where rows come from (`_eval_dataset.py`) or
training: it reuses `AsyncRolloutLoop` unchanged, so an eval samples exactly like training does (same
client, tool loop, concurrency controller).

pass@1 is the mean over prompts of the fraction of rollouts whose reward >= `pass_threshold`;
pass@K is the fraction of prompts with at least one such rollout among their K. Rollouts no reward
function scored count as failures.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._config import RolloutConfig
from ._loop import AsyncRolloutLoop, GroupOutcome

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def completion_text(completion: Any) -> str:
    """The final answer text: the last assistant message's content, or the text of a text completion."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role") == "assistant":
            return message.get("content") or ""
    return ""


def extract_answer(text: str) -> str:
    """The content of the last `<answer>...</answer>` if any, else the whole text, stripped."""
    tagged = _ANSWER_TAG.findall(text)
    return (tagged[-1] if tagged else text).strip()


def exact_match(completions: list[Any], answer: list[Any] | None = None, **_: Any) -> list[float | None]:
    """1.0 when the extracted answer equals the `answer` column (stripped), else 0.0; None without one."""
    if answer is None:
        return [None] * len(completions)
    return [
        float(extract_answer(completion_text(c)) == str(a).strip())
        for c, a in zip(completions, answer, strict=True)
    ]


def contains_answer(completions: list[Any], answer: list[Any] | None = None, **_: Any) -> list[float | None]:
    """1.0 when the `answer` column appears in the completion text, else 0.0; None without one."""
    if answer is None:
        return [None] * len(completions)
    return [float(str(a).strip() in completion_text(c)) for c, a in zip(completions, answer, strict=True)]


def gym_score(completions: list[Any], entry: list[str] | None = None, **_: Any) -> list[float | None]:
    """reasoning-gym's own scorer of each task (rows built by `load_eval_dataset` carry `entry`)."""
    if entry is None:
        return [None] * len(completions)
    import reasoning_gym

    scores = []
    for completion, raw in zip(completions, entry, strict=True):
        item = json.loads(raw)
        score = reasoning_gym.get_score_answer_fn(item["metadata"]["source_dataset"])
        scores.append(float(score(answer=extract_answer(completion_text(completion)), entry=item)))
    return scores


BUILTIN_REWARDS: dict[str, Callable[..., list[float | None]]] = {
    "exact": exact_match,
    "contains": contains_answer,
    "gym": gym_score,
}
REWARD_COLUMNS = {"exact": "answer", "contains": "answer", "gym": "entry"}
"""The dataset column each built-in reward reads (without it, every rollout would go unscored)."""


def resolve_reward(spec: str) -> Callable[..., list[float | None]]:
    """A built-in name (`exact`, `contains`, `gym`) or `package.module:function`; modules are also looked
    up in the current directory (the console script, unlike `python -m`, does not put it on sys.path)."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(
            f"--reward {spec!r}: use one of {sorted(BUILTIN_REWARDS)} or `package.module:function`"
        )
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"--reward {spec!r}: no module {exc.name!r} in the current directory ({os.getcwd()}) or on sys.path"
        ) from exc
    func = getattr(module, name, None)
    if not callable(func):
        raise ValueError(f"--reward {spec!r}: {module.__file__} has no function {name!r}")
    return func


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalReport:
    """The numbers one eval run prints."""

    num_prompts: int
    num_rollouts: int
    k: int
    mean_reward: float
    """Mean over rollouts with a reward (NaN-free)."""
    pass_at_1: float
    pass_at_k: float
    generated_tokens: int
    wall_s: float
    tokens_per_s: float
    pass_threshold: float = 1.0
    mean_reward_by_func: dict[str, float] = field(default_factory=dict)
    """Per reward function, the mean over the rollouts it scored (NaN when it scored none)."""
    num_unscored: int = 0
    """Rollouts no reward function scored (they count as failures)."""
    clipped_frac: float = 0.0
    """Rollouts cut at `max_completion_length` (or the server's context) before they stopped."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self, title: str) -> str:
        """The run on one screen: what was evaluated, the scores, the completions, the throughput."""
        by_func = "  ".join(f"{name} {value:.4f}" for name, value in self.mean_reward_by_func.items())
        lines = [
            title,
            f"  prompts       {self.num_prompts} x {self.k} rollouts = {self.num_rollouts}",
            f"  mean reward   {self.mean_reward:.4f}"
            + (f"   ({by_func})" if len(self.mean_reward_by_func) > 1 else ""),
            f"  pass@1        {self.pass_at_1:.4f}   (mean per-prompt fraction of rollouts with reward >= "
            f"{self.pass_threshold:g})",
            f"  pass@{self.k:<9}{self.pass_at_k:.4f}   (prompts with at least one such rollout among {self.k})",
            f"  completions   {self.generated_tokens / max(self.num_rollouts, 1):.1f} tokens mean, "
            f"{100 * self.clipped_frac:.1f}% cut at the length limit",
            f"  throughput    {self.tokens_per_s:.1f} tokens/s over {self.wall_s:.1f} s",
        ]
        if self.num_unscored:
            lines.append(
                f"  unscored      {self.num_unscored} rollouts no reward scored (counted as failures)"
            )
        return "\n".join(lines)


def _records(outcome: GroupOutcome) -> list[dict[str, Any]]:
    group = outcome.group
    return [
        {
            "row_index": group.row_index,
            "generation": i,
            "prompt": group.prompts[i],
            "completion": rollout.completion,
            "reward": None if np.isnan(group.rewards[i]) else float(group.rewards[i]),
            "rewards": {
                k: (None if np.isnan(v[i]) else float(v[i])) for k, v in group.rewards_by_func.items()
            },
            "num_tokens": rollout.num_generated_tokens,
            "num_turns": len(rollout.turns),
            "clipped": rollout.clipped,
        }
        for i, rollout in enumerate(group.rollouts)
    ]


async def evaluate(
    config: RolloutConfig,
    *,
    tokenizer: Any,
    dataset: list[dict[str, Any]],
    reward_funcs: list[Callable],
    output_path: str | Path | None = None,
    pass_threshold: float = 1.0,
    progress: bool = True,
    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop,
) -> EvalReport:
    """Generate `num_generations` rollouts per prompt once, score them and report; each group's rollouts
    are written to `output_path` (JSONL, flushed) as soon as the group is scored."""
    from tqdm.auto import tqdm

    loop = loop_cls(config, tokenizer=tokenizer, dataset=dataset, reward_funcs=reward_funcs, max_epochs=1)
    records: list[dict[str, Any]] = []
    passed: list[float] = []  # per finished prompt, for the bar
    with contextlib.ExitStack() as stack:
        out = None if output_path is None else stack.enter_context(open(output_path, "w"))
        bar = stack.enter_context(tqdm(total=len(dataset), desc="eval", unit="prompt", disable=not progress))

        def on_group(outcome: GroupOutcome) -> None:
            if outcome.group is not None:
                done = _records(outcome)
                records.extend(done)
                if out is not None:
                    out.write("".join(json.dumps(r, default=str) + "\n" for r in done))  # one call: Ctrl-C
                    # between two writes would leave a partial group; the buffer is flushed when the file closes
                    out.flush()
                passed.append(np.mean([_passes(r, pass_threshold) for r in done]))
                bar.set_postfix_str(f"pass@1 {np.mean(passed):.3f}", refresh=False)
            bar.update(1)

        async def discard(_sample: Any) -> None:
            return None

        start = time.monotonic()
        await loop.run(discard, on_group=on_group)
    wall = time.monotonic() - start
    return _report(records, config.num_generations, pass_threshold, wall)


def _passes(record: dict[str, Any], pass_threshold: float) -> bool:
    return record["reward"] is not None and record["reward"] >= pass_threshold


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


def _report(records: list[dict[str, Any]], k: int, pass_threshold: float, wall_s: float) -> EvalReport:
    by_prompt: dict[int, list[bool]] = {}
    for record in records:
        by_prompt.setdefault(record["row_index"], []).append(_passes(record, pass_threshold))
    funcs = dict.fromkeys(name for r in records for name in r.get("rewards", {}))
    tokens = sum(r["num_tokens"] for r in records)
    return EvalReport(
        num_prompts=len(by_prompt),
        num_rollouts=len(records),
        k=k,
        mean_reward=_mean([r["reward"] for r in records if r["reward"] is not None]),
        pass_at_1=float(np.mean([np.mean(p) for p in by_prompt.values()])) if by_prompt else 0.0,
        pass_at_k=float(np.mean([any(p) for p in by_prompt.values()])) if by_prompt else 0.0,
        generated_tokens=tokens,
        wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        pass_threshold=pass_threshold,
        mean_reward_by_func={
            f: _mean([r["rewards"][f] for r in records if r["rewards"].get(f) is not None]) for f in funcs
        },
        num_unscored=sum(r["reward"] is None for r in records),
        clipped_frac=_mean([float(r.get("clipped", False)) for r in records]) if records else 0.0,
    )

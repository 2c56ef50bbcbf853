"""`RolloutMetrics`: the `rollout/`, `completions/`, `tools/` and `env/` metrics of a running loop.

Owns accumulation over a window and the reduction to a flat `{name: float}` dict (means, maxima,
fractions; `*_total` counters are cumulative since the loop started). Also reduces the group-level
numbers only the loop sees, over the window: `rollout/window_reward` (every scored group, dropped ones
included: the reference's `reward`), `rollout/window_reward_kept` and `rollout/window_frac_reward_zero_std`
(the trainer logs the `reward` of each optimizer step's trained rollouts beside them). Does not know where the dict goes: the loop hands it to a caller's sink.
Meanings follow the reference's metric tables (docs of the trainer).
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from ._rollout import Rollout
from ._sequence import ReconcileStats
from ._toolbox import ToolOutcome


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


class RolloutMetrics:
    """Window accumulators; `flush()` reduces and resets them."""

    def __init__(self) -> None:
        self.tool_calls_total: dict[str, int] = defaultdict(int)
        self.tool_failures_total: dict[str, int] = defaultdict(int)
        self.unknown_tool_total = 0
        self.parse_failure_total = 0
        self.prompt_too_long_total = 0
        self.groups_stale = 0
        self.groups_cancelled = 0
        """Groups abandoned because the server unloaded their policy version's adapter (running total)."""
        self.rewards_nonfinite_total = 0
        """Reward values excluded for being +-inf or beyond float32's range (running total)."""
        self.route_conflicts_total = 0
        """Held tokens a later turn routed to other MoE experts (running total; reported once nonzero)."""
        self._window_start = time.monotonic()
        self._reset_window()

    def _reset_window(self) -> None:
        self.durations: list[float] = []
        self.lengths: list[int] = []
        self.turns: list[int] = []
        self.clipped: list[bool] = []
        self.samples_per_rollout: list[int] = []
        self.boundaries = 0
        self.forks = 0
        self.drift_tokens: list[int] = []
        self.rollout_tool_calls: list[int] = []
        self.loop_exhausted: list[bool] = []
        self.tool_latency: dict[str, list[float]] = defaultdict(list)
        self.window_calls = 0
        self.window_failures = 0
        self.parallel_calls: list[int] = []
        self.env_reset_s: list[float] = []
        self.env_reward_s: list[float] = []
        self.score_s: list[float] = []
        self.score_wait_s: list[float] = []
        self.score_block_s = 0.0
        self.backpressure_s = 0.0
        self.group_rewards: list[float] = []
        self.kept_group_rewards: list[float] = []
        self.groups_zero_std = 0
        self.groups_dropped = 0

    def record_rollout(
        self, rollout: Rollout, duration_s: float, stats: ReconcileStats, num_samples: int
    ) -> None:
        self.durations.append(duration_s)
        self.lengths.append(rollout.num_generated_tokens)
        self.turns.append(len(rollout.turns))
        self.clipped.append(rollout.clipped)
        self.samples_per_rollout.append(num_samples)
        self.boundaries += stats.boundaries
        self.forks += stats.forks
        self.drift_tokens.extend(stats.drift_tokens)
        self.route_conflicts_total += stats.route_conflicts
        self.rollout_tool_calls.append(rollout.tool_call_count)
        self.loop_exhausted.append(rollout.tool_loop_exhausted)

    def record_tool_turn(self, outcomes: list[ToolOutcome]) -> None:
        """One assistant turn's tool calls."""
        self.parallel_calls.append(len(outcomes))
        for outcome in outcomes:
            self.window_calls += 1
            self.window_failures += outcome.failed
            if outcome.unknown:
                self.unknown_tool_total += 1
                continue
            self.tool_calls_total[outcome.name] += 1
            self.tool_failures_total[outcome.name] += outcome.failed
            self.tool_latency[outcome.name].append(outcome.latency_s)

    def record_group(self, rewards: np.ndarray, kept: bool, reason: str) -> None:
        scored = rewards[~np.isnan(rewards)]
        if scored.size:
            self.group_rewards.append(float(scored.mean()))
            if kept:
                self.kept_group_rewards.append(float(scored.mean()))
        self.groups_dropped += not kept
        self.groups_zero_std += reason == "zero_std"

    def _rollout_part(self) -> dict[str, float]:
        out = {
            "rollout/duration_s": _mean(self.durations),
            "rollout/prompt_too_long_total": float(self.prompt_too_long_total),
            "rollout/groups_stale_total": float(self.groups_stale),
            "rollout/groups_cancelled_total": float(self.groups_cancelled),
            "rollout/rewards_nonfinite_total": float(self.rewards_nonfinite_total),
            "rollout/turns_mean": _mean(self.turns),
            "rollout/turns_max": float(max(self.turns, default=0)),
            "rollout/samples_per_rollout": _mean(self.samples_per_rollout),
            "rollout/fork_frac": self.forks / self.boundaries if self.boundaries else 0.0,
            "rollout/drift_tokens_mean": _mean(self.drift_tokens),
            "rollout/drift_tokens_max": float(max(self.drift_tokens, default=0)),
            "rollout/score_s": _mean(self.score_s),
            "rollout/score_wait_s": _mean(self.score_wait_s),
            "rollout/score_block_s": self.score_block_s,
            "rollout/backpressure_s": self.backpressure_s,
            "completions/mean_length": _mean(self.lengths),
            "completions/min_length": float(min(self.lengths, default=0)),
            "completions/max_length": float(max(self.lengths, default=0)),
            "completions/clipped_ratio": _mean(self.clipped),
        }
        if self.route_conflicts_total:
            out["rollout/route_conflicts_total"] = float(self.route_conflicts_total)
        if self.group_rewards:
            groups = len(self.group_rewards)
            out.update(
                {
                    "rollout/window_reward": _mean(self.group_rewards),
                    "rollout/window_reward_kept": _mean(self.kept_group_rewards),
                    "rollout/window_frac_reward_zero_std": self.groups_zero_std / groups,
                }
            )
        return out

    def _tool_part(self) -> dict[str, float]:
        if not self.window_calls and not self.tool_calls_total and not self.unknown_tool_total:
            return {}
        all_latency = [x for values in self.tool_latency.values() for x in values]
        out = {
            "tools/call_frequency": _mean(self.rollout_tool_calls),
            "tools/failure_frequency": self.window_failures / self.window_calls if self.window_calls else 0.0,
            "tools/latency_s": _mean(all_latency),
            "tools/unknown_name_total": float(self.unknown_tool_total),
            "tools/parse_failure_total": float(self.parse_failure_total),
            "tools/parallel_calls_mean": _mean(self.parallel_calls),
            "tools/loop_exhausted_frac": _mean(self.loop_exhausted),
        }
        for name, calls in self.tool_calls_total.items():
            out[f"tools/{name}/call_total"] = float(calls)
            out[f"tools/{name}/failure_total"] = float(self.tool_failures_total[name])
            if self.tool_latency[name]:
                out[f"tools/{name}/latency_s"] = _mean(self.tool_latency[name])
        return out

    def flush(self) -> dict[str, float]:
        """Reduce the window to `{name: value}` and start a new window."""
        elapsed = max(time.monotonic() - self._window_start, 1e-9)
        out = self._rollout_part()
        out["rollout/generated_tok_s"] = sum(self.lengths) / elapsed
        out.update(self._tool_part())
        if self.env_reset_s or self.env_reward_s:
            out.update({"env/reset_s": _mean(self.env_reset_s), "env/reward_s": _mean(self.env_reward_s)})
        self._window_start = time.monotonic()
        self._reset_window()
        return out

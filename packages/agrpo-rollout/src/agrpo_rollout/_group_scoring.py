"""`GroupScoring`: the stage after generation: a collected group's rewards, advantages, keep or drop.

Owns what happens to a finished group on the loop's score queue: reward columns from every source (reward
functions in the loop's thread pool, environments, `Rollout.reward`), `compute_advantages`, the keep rule
(`is_trainable`), the samples handed to the sink (which may block: `rollout/backpressure_s`) and the
group's `GroupOutcome`. Does not generate, dispatch or know the server.

Rewards that are +-inf or beyond float32's range (a source's value, or a sum of sources) are excluded
like None, counted (`rollout/rewards_nonfinite_total`) and named in a warning once per source; an
override of `compute_advantages` that returns a non-finite advantage for a kept group is an error, so
no sample ever carries one. A reward source that raises ends the run; its exception gets a note naming
the group's dataset row, epoch and prompt (beside `RewardScorer`'s note naming the function and the fix).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

from ._group import REWARD_LIMIT, RolloutGroup, is_trainable, prompt_preview, usable_rewards
from ._group_outcome import GroupOutcome
from ._reward import RewardScorer, exclude_unusable, sum_rewards, with_other_sources
from ._rollout_metrics import RolloutMetrics
from ._sample import samples_from_group

logger = logging.getLogger("agrpo_rollout")


class GroupScoring:
    """Scores the groups of a score queue until it yields None."""

    def __init__(
        self,
        scorer: RewardScorer,
        metrics: RolloutMetrics,
        executor: Executor,
        compute_advantages: Callable[[RolloutGroup], np.ndarray],
    ) -> None:
        self.scorer = scorer
        self.metrics = metrics
        self.executor = executor
        self.compute_advantages = compute_advantages
        self._warned_no_reward = False
        self._warned_unusable: set[str] = set()

    async def run(self, queue: asyncio.Queue, sink: Callable, on_group: Callable | None) -> None:
        while (group := await queue.get()) is not None:
            self.metrics.score_wait_s.append(time.monotonic() - group.queued_at)
            start = time.monotonic()
            try:
                await self._reward_columns(group)
            except Exception as error:
                error.add_note(
                    f"while scoring the group of dataset row {group.row_index} (epoch {group.epoch}), prompt "
                    f"{prompt_preview(group.prompts[0] if group.prompts else None)!r}"
                )
                raise
            advantages = np.asarray(self.compute_advantages(group), dtype=np.float32)
            kept, reason = is_trainable(group.rewards)
            if kept and not np.isfinite(advantages).all():
                raise ValueError(
                    f"compute_advantages returned {advantages.tolist()} for the group of row {group.row_index} "
                    f"(rewards {group.rewards.tolist()}); return finite advantages, 0 for rollouts not to train"
                )
            self.metrics.score_s.append(time.monotonic() - start)
            self.metrics.record_group(group.rewards, kept, reason)
            samples = samples_from_group(group, advantages) if kept else []
            for sample in samples:
                blocked = time.monotonic()
                sample.enqueued_at = time.time()
                result = (
                    sink(sample)
                    if inspect.iscoroutinefunction(sink)
                    else await asyncio.to_thread(sink, sample)
                )
                if inspect.isawaitable(result):
                    await result
                self.metrics.backpressure_s += time.monotonic() - blocked
            if on_group is not None:
                on_group(
                    GroupOutcome(
                        group.row_index, group.epoch, group.group_id, kept, reason, len(samples), group
                    )
                )

    async def _reward_columns(self, group: RolloutGroup) -> None:
        columns = await self.scorer.score(
            group.prompts, group.completions, group.completions_ids, group.reward_kwargs, self.executor
        )
        columns = with_other_sources(columns, group.env_rewards, group.rollout_rewards)
        group.rewards_by_func, unusable = exclude_unusable(columns)
        if group.rewards_by_func:
            group.rewards = sum_rewards(list(group.rewards_by_func.values()))
            overflow = ~usable_rewards(group.rewards) & ~np.isnan(group.rewards)
            if overflow.any():  # finite sources whose sum leaves float32's range
                group.rewards[overflow] = np.nan
                unusable["(sum of sources)"] = int(overflow.sum())
            self._count_unusable(unusable, group)
            return
        if not self._warned_no_reward:
            logger.warning(
                "no reward source: pass reward_funcs, an environment with get_reward, or set Rollout.reward"
            )
            self._warned_no_reward = True
        group.rewards = np.full(len(group.prompts), np.nan)

    def _count_unusable(self, unusable: dict[str, int], group: RolloutGroup) -> None:
        for source, count in unusable.items():
            self.metrics.rewards_nonfinite_total += count
            if source not in self._warned_unusable:
                self._warned_unusable.add(source)
                logger.warning(
                    "reward source %r gave %d reward(s) that are +-inf or beyond +-%.3g (row %d); they are excluded like None "
                    "(rollout/rewards_nonfinite_total counts them). Return finite rewards in float32's range",
                    source,
                    count,
                    REWARD_LIMIT,
                    group.row_index,
                )

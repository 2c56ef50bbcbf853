"""`AsyncRolloutLoop`: generate, score and emit GRPO groups from a vLLM server, on one event loop.

Owns the overridable steps (`filter_prompt`, `generate_one`, `generate_one_turn`,
`compute_advantages`, `setup`, `close`) and `run`, the producer. Does not own processes or queues:
the caller passes a `sink` for samples, a `policy_version` callable, and optional `on_group` and
`metrics_sink` callables; the trainer's rollout process wraps its multiprocessing queue in them.

Data flow of `run` (every arrow but dispatch and scoring is in this file):

    PromptSource ──filter_prompt──> GroupDispatch (`_group_dispatch.py`) ──(a live slot per rollout on
      one server of the ServerPool)──> _run_rollout
      ──generate_one──> Rollout ──build_sequences──> collected per group
      ──score queue (score_queue_maxsize)──> GroupScoring (`_group_scoring.py`): rewards,
      compute_advantages, keep/drop ──> sink(RolloutSample) for each sequence of a kept group;
      on_group(GroupOutcome) for every group

Servers (`ServerPool`, `_server_pool.py`): each group goes to one server of `vllm_server_base_url`, the
serving one with the most free slots under its live cap, and all its rollouts and their turns stay there
(its prefix cache holds the shared prompt). A group whose server lost its process mid-generation (died,
or restarted: `_pooled_server.py`) is abandoned and its prompt dispatched again, first in line, so
nothing a dead or not yet re-synced process generated is emitted and no prompt is lost
(`rollout/groups_redispatched_total`); the prompt still gets exactly one `GroupOutcome`.

Any other failure ends the run with the original error; a failed rollout ends it at once, before another
rollout is sent (`RolloutTasks`, `_rollout_tasks.py`).

Customise by subclassing at module level (the loop is pickled into a spawned process) and override
only what changes; create clients in `setup`, not `__init__`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ._assistant_message import parse_assistant_turn, parser_kind
from ._client import VLLMClient
from ._config import RolloutConfig
from ._conversation import Conversation, render_prompt, with_reset_text
from ._environment import EnvironmentPool
from ._exceptions import ServerLostError
from ._group import FinishedRollout, RolloutGroup, group_advantages
from ._group_dispatch import GroupDispatch, maybe_retired
from ._group_outcome import GroupOutcome
from ._group_scoring import GroupScoring
from ._pooled_server import BOUND
from ._prompt_source import PromptSource
from ._reward import RewardScorer
from ._rollout import Rollout
from ._rollout_metrics import RolloutMetrics
from ._rollout_tasks import RolloutTasks
from ._sample import RolloutSample
from ._sequence import build_sequences
from ._server_event import ServerEvent
from ._server_pool import ServerPool
from ._toolbox import Toolbox
from ._turn import TurnRecord

logger = logging.getLogger("agrpo_rollout")


class AsyncRolloutLoop:
    """Generates and scores GRPO groups; see the module docstring for the flow."""

    def __init__(
        self,
        config: RolloutConfig,
        *,
        tokenizer: Any,
        dataset: Any = None,
        reward_funcs: Callable | list[Callable] | None = None,
        tools: list[Callable] | None = None,
        environment_factory: Callable[[], object] | Mapping[str, Callable[[], object]] | None = None,
        start_index: int = 0,
        max_epochs: int | None = None,
        skip_prompts: frozenset[tuple[int, int]] = frozenset(),
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.reward_funcs = (
            []
            if reward_funcs is None
            else (reward_funcs if isinstance(reward_funcs, list) else [reward_funcs])
        )
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.start_index = start_index
        self.max_epochs = max_epochs
        self.skip_prompts = skip_prompts  # (epoch, row_index) already trained before a resume: not drawn
        self.metrics = RolloutMetrics()

    @property
    def client(self) -> VLLMClient:
        """The client of the server the current rollout's group was dispatched to (outside a rollout: the
        first server's). `generate_one_turn` samples through it, and so can overrides."""
        binding = BOUND.get()
        return binding.server.client if binding is not None else self.pool.servers[0].client

    # ---- overridable steps -------------------------------------------------------------------

    def filter_prompt(self, row_index: int, row: Mapping[str, Any], epoch: int) -> bool:
        """Whether to generate for this prompt; rejected prompts count as consumed. Default: all."""
        return True

    async def setup(self) -> None:
        """Create resources other hooks need, on the loop's event loop. Default: nothing."""

    async def close(self) -> None:
        """Release what `setup` created; runs when the loop stops, also after a failure. Default: nothing."""

    async def generate_one_turn(
        self, prompt_ids: list[int], max_tokens: int | None = None, routes_from: int = 0
    ) -> TurnRecord:
        """One vLLM sampling request with the config's sampling parameters (`max_tokens` caps the turn;
        `routes_from`: the first prompt position whose MoE routes to return, see `VLLMClient.sample`)."""
        return await self.client.sample(prompt_ids, max_tokens=max_tokens, routes_from=routes_from)

    async def generate_one(self, prompt: Any, tools: Any, group_id: int = 0) -> Rollout:
        """One rollout: the multi-turn tool loop for message prompts, one turn for text prompts."""
        toolbox = tools if isinstance(tools, Toolbox) else Toolbox(list(tools or []))
        if isinstance(prompt, str):
            return await self._generate_text(prompt)
        talk = Conversation(messages=list(prompt), budget=self.config.max_completion_length)
        kwargs = self.config.chat_template_kwargs or {}
        exhausted = False
        while True:
            prompt_ids = render_prompt(self.tokenizer, talk.messages, toolbox.schemas, kwargs)
            if not talk.turns:
                self._check_prompt_fits(prompt_ids)
            routes_from = talk.routes_from(prompt_ids)
            turn = await self._turn(prompt_ids, talk.budget, routes_from)
            message = parse_assistant_turn(
                self.tokenizer, turn.output_ids, turn.prompt_ids, self._parser_kind
            )
            self.metrics.parse_failure_total += message.parse_error is not None
            talk.add_turn(turn, message, routes_from if self._turn_takes_routes_from else 0)
            if not message.tool_calls or not toolbox or talk.budget <= 0 or not turn.stopped:
                break
            limit = self.config.max_tool_calling_iterations
            if limit is not None and talk.tool_rounds >= limit:
                exhausted = True
                break
            outcomes = await toolbox.run(
                message.tool_calls, self._executor, timeout_s=self.config.tool_timeout_s
            )
            self.metrics.record_tool_turn(outcomes)
            talk.add_tool_messages([o.as_chat_message() for o in outcomes], sum(o.failed for o in outcomes))
        return Rollout(
            completion=talk.completion,
            completion_ids=talk.completion_ids,
            turns=talk.turns,
            tool_call_count=talk.tool_calls,
            tool_failure_count=talk.tool_failures,
            clipped=not talk.turns[-1].stopped,
            tool_loop_exhausted=exhausted,
        )

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """(G,) advantages in `group.rewards` order: rewards standardised in the group, NaN -> 0."""
        return group_advantages(group.rewards)

    # ---- helpers of the default steps ------------------------------------------------------------

    async def _turn(self, prompt_ids: list[int], budget: int, routes_from: int = 0) -> TurnRecord:
        """`generate_one_turn` with the keywords its override takes (older overrides take neither)."""
        kwargs: dict[str, int] = {}
        if self._turn_takes_max_tokens:
            kwargs["max_tokens"] = budget
        if self._turn_takes_routes_from and routes_from:
            kwargs["routes_from"] = routes_from
        return await self.generate_one_turn(prompt_ids, **kwargs)

    def _check_prompt_fits(self, prompt_ids: list[int]) -> None:
        """A prompt that fills the server's context yields an empty, untrainable rollout: count and say so."""
        limit = self.client.server.max_model_len
        if len(prompt_ids) < limit:
            return
        self.metrics.prompt_too_long_total += 1
        if self.metrics.prompt_too_long_total == 1:
            logger.warning(
                "a prompt of %d tokens leaves no room under the server's max_model_len %d, so its rollouts are "
                "empty and its group is dropped (rollout/prompt_too_long_total counts them); restart the server "
                "with a larger --max-model-len or reject long prompts in filter_prompt",
                len(prompt_ids),
                limit,
            )

    async def _generate_text(self, prompt: str) -> Rollout:
        prompt_ids = self.tokenizer.encode(prompt)
        self._check_prompt_fits(prompt_ids)
        turn = await self._turn(prompt_ids, self.config.max_completion_length)
        text = parse_assistant_turn(self.tokenizer, turn.output_ids, prompt_ids, "plain").content
        return Rollout(
            completion=text, completion_ids=turn.output_ids.tolist(), turns=[turn], clipped=not turn.stopped
        )

    # ---- the producer ------------------------------------------------------------------------

    async def _prepare(self, policy_version: Callable[[], int], on_server: Callable | None) -> None:
        """Build what `run` needs: the servers (probed, one cap each), thread pool, tools, environments."""
        self.pool = await ServerPool.open(self.config, policy_version=policy_version, on_event=on_server)
        self._executor = ThreadPoolExecutor(self.config.tool_threads or self.config.max_concurrent_rollouts)
        self._toolbox = Toolbox(self.tools)
        self._environments = (
            None if self.environment_factory is None else EnvironmentPool(self.environment_factory)
        )
        self._scoring = GroupScoring(
            RewardScorer(self.reward_funcs), self.metrics, self._executor, self.compute_advantages
        )
        self._parser_kind = parser_kind(self.tokenizer)
        parameters = inspect.signature(self.generate_one_turn).parameters
        self._turn_takes_max_tokens = "max_tokens" in parameters
        self._turn_takes_routes_from = "routes_from" in parameters

    async def _teardown(self) -> None:
        await self.pool.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run_rollout(self, row: Mapping[str, Any], group_id: int) -> FinishedRollout:
        start = time.monotonic()
        try:
            prompt, tools, env = row.get("prompt", []), self._toolbox, None
            if self._environments is not None:
                env = await self._environments.acquire(row, self._executor)
                self.metrics.env_reset_s.append(env[3])
                prompt, tools = with_reset_text(prompt, env[2]), tools + self._environments.toolbox(env[1])
            rollout = await self.generate_one(prompt, tools, group_id)
            env_reward = None
            if env is not None:
                value, seconds = await self._environments.reward(env[1], self._executor)
                if value is not None:
                    self.metrics.env_reward_s.append(seconds)
                    env_reward = (type(env[1]), value)
                self._environments.release(env[0], env[1])
        except Exception as error:  # recorded before the slot is given back: no new rollout follows it
            if not (maybe_retired(self.config, error) or isinstance(error, ServerLostError)):
                self._tasks.fail(error)
            raise
        finally:
            await self.pool.release(BOUND.get().server)
        sequences, stats = build_sequences(rollout.turns, rollout.rollout_id)
        self.metrics.record_rollout(rollout, time.monotonic() - start, stats, len(sequences))
        return FinishedRollout(prompt, rollout, sequences, env_reward)

    def _source(self) -> PromptSource:
        return PromptSource(
            self.dataset, start_index=self.start_index, max_epochs=self.max_epochs, skip=self.skip_prompts
        )

    def _metric_snapshot(self, queue: asyncio.Queue) -> dict[str, float]:
        out = self.metrics.flush()
        out.update(self.pool.metrics())
        out["rollout/vllm_retry_total"] = float(self.pool.retry_total)
        out["rollout/groups_redispatched_total"] = float(self._dispatch.redispatched)
        out["rollout/score_queue_size"] = float(queue.qsize())
        return out

    async def _push_metrics(self, queue: asyncio.Queue, metrics_sink: Callable[[dict], Any]) -> None:
        """Push once as soon as the first group is scored (a short run's first logged step then carries the
        rollout side too), then every `metrics_interval_s`."""
        first_by = time.monotonic() + self.config.metrics_interval_s
        while time.monotonic() < first_by and not (self.metrics.group_rewards or self.metrics.groups_dropped):
            await asyncio.sleep(0.05)
        metrics_sink(self._metric_snapshot(queue))
        while True:
            await asyncio.sleep(self.config.metrics_interval_s)
            metrics_sink(self._metric_snapshot(queue))

    async def run(
        self,
        sink: Callable[[RolloutSample], Awaitable[None] | None],
        *,
        policy_version: Callable[[], int] = lambda: 0,
        on_group: Callable[[GroupOutcome], None] | None = None,
        metrics_sink: Callable[[dict[str, float]], Any] | None = None,
        max_groups: int | None = None,
        on_draw: Callable[[int, int], None] | None = None,
        on_server: Callable[[ServerEvent], None] | None = None,
        may_dispatch: Callable[[], bool] | None = None,
        trainable: Callable[[int], bool] | None = None,
    ) -> None:
        """Produce samples until the dataset's epochs or `max_groups` run out (cancel the task to stop).

        `sink` gets every sample of every kept group: an `async def` is awaited; a plain callable runs
        in a thread, so a blocking `queue.put` throttles generation (`rollout/backpressure_s`).
        `metrics_sink` gets a metrics dict every `metrics_interval_s` seconds (a heartbeat too) and
        once at the end. `policy_version()` is read when a group's first rollout is dispatched.
        `on_draw(row_index, epoch)` is called when an accepted prompt's group is dispatched, before
        `on_group` reports its outcome (a trainer's resume position must know prompts still in flight).
        `on_server(ServerEvent)` is for a caller that syncs the servers' weights (the trainer): with it, a
        server takes groups only while its weight label shows the published policy version or newer, and
        one that falls behind (a restart, a missed push) is reported as `resync` for the caller to re-sync.
        While `may_dispatch()` says no, no new group starts (a trainer holds the producer at `max_staleness`);
        a group in flight that `trainable(policy_version)` rejects (asked every 0.25 s) is cancelled (its
        requests closed: vLLM aborts them), reported `stale` and counted (`rollout/groups_cancelled_total`).
        """
        await self._prepare(policy_version, on_server)
        queue: asyncio.Queue = asyncio.Queue(self.config.score_queue_maxsize)
        self._tasks = RolloutTasks()
        self._dispatch = GroupDispatch(
            config=self.config, draws=iter(self._source().draws(self.filter_prompt)), pool=self.pool,
            tasks=self._tasks, metrics=self.metrics, run_rollout=self._run_rollout, queue=queue,
            policy_version=policy_version, on_group=on_group, on_draw=on_draw, max_groups=max_groups,
            may_dispatch=may_dispatch, trainable=trainable,
        )  # fmt: skip
        spawn = self._tasks.spawn
        try:
            await self.setup()
            watched = {self._tasks.failed, *(spawn(server.watch()) for server in self.pool.servers)}
            if metrics_sink is not None:
                watched.add(spawn(self._push_metrics(queue, metrics_sink)))
            scorer = spawn(self._scoring.run(queue, sink, on_group))
            watched |= {scorer, spawn(self._dispatch.run())}
            while (
                not scorer.done()
            ):  # any failure (a rollout, dispatch, scoring, a sink, the poller) ends the run
                done, watched = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            if metrics_sink is not None:
                metrics_sink(self._metric_snapshot(queue))
        finally:
            await self._tasks.cancel_all()
            try:
                await self.close()
            finally:
                await self._teardown()

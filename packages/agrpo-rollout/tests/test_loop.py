"""`AsyncRolloutLoop` end to end against the real CPU vLLM server.

A random tiny model never emits a well-formed tool call, so the tool tests use `ScriptedToolLoop`:
each turn really samples a few tokens from the server, then appends the tokens a tool-using model
would have produced (a tool call, optionally a `<think>` block). The appended tokens are context
only (`output_mask` 0): nothing is trained on them and no log-prob is invented for them.
"""

import asyncio
import logging
import math
import time

import httpx
import numpy as np
import pytest

from agrpo_packing import PackSample, TreeRow
from agrpo_packing.testing import assert_row_layout
from agrpo_rollout import (
    AsyncRolloutLoop,
    RequestRejectedError,
    ServerUnavailableError,
)
from agrpo_rollout.testing import scripted_turn


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def length_reward(completions, **_):
    return [float(len(str(c))) for c in completions]


def constant_reward(completions, **_):
    return [1.0] * len(completions)


class ScriptedToolLoop(AsyncRolloutLoop):
    """Real sampled tokens, then a scripted tool call on the first turn (context only)."""

    script = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

    async def generate_one_turn(self, prompt_ids, max_tokens=None, routes_from=0):
        for _ in range(20):  # the first turn keeps only plain-text sampled tokens: sample until it keeps one
            real = await super().generate_one_turn(
                prompt_ids, max_tokens=min(3, max_tokens or 3), routes_from=routes_from
            )
            if self.tokenizer.convert_tokens_to_ids("<tool_response>") in prompt_ids:
                return real
            turn = scripted_turn(self.tokenizer, real, self.script)
            if turn.output_mask.any():
                return turn
        raise AssertionError("20 samples of 3 tokens without one plain-text token")


class ThinkingToolLoop(ScriptedToolLoop):
    """As above, with a `<think>` block first, which the history-rewriting template strips later."""

    script = "<think>add them</think>" + ScriptedToolLoop.script


def _run(loop, **kwargs):
    samples, groups, metrics = [], [], []

    async def go():
        await loop.run(samples.append, on_group=groups.append, metrics_sink=metrics.append, **kwargs)

    asyncio.run(go())
    return samples, groups, metrics


def _chat(text):
    return [{"role": "user", "content": text}]


def test_single_turn_groups_become_pack_samples(server_config, tool_tokenizer):
    dataset = [{"prompt": _chat(f"What is {i} + {i}?"), "answer": str(2 * i)} for i in range(3)] + [
        {"prompt": "Once upon"}
    ]
    config = server_config(num_generations=3, max_completion_length=10)
    loop = AsyncRolloutLoop(
        config, tokenizer=tool_tokenizer, dataset=dataset, reward_funcs=length_reward, max_epochs=1
    )
    samples, groups, metrics = _run(loop, policy_version=lambda: 7)
    assert [g.row_index for g in groups] == [0, 1, 2, 3] and all(
        g.kept for g in groups if g.reason != "zero_std"
    )
    assert isinstance(groups[3].group.completions[0], str), "text prompts complete without the chat template"
    for sample in samples:
        packed = PackSample(**sample.pack_fields())
        assert packed.num_trained == sample.num_generated_tokens <= 10
        assert sample.policy_version == 7 and sample.sampler_top_ids.shape == (packed.num_trained, 8)
        assert sample.rewards_by_func.keys() == {"length_reward"}
    for outcome in (g for g in groups if g.kept):
        advantages = [s.advantage for s in samples if s.group_id == outcome.group_id]
        assert len(advantages) == 3 and abs(sum(advantages)) < 1e-4
    windows = [
        m for m in metrics if m["rollout/turns_mean"]
    ]  # a loaded machine may flush an empty last window
    assert all(m["completions/max_length"] <= 10 and m["rollout/turns_mean"] == 1.0 for m in windows)
    assert all(m["rollout/samples_per_rollout"] == 1.0 for m in windows) and windows
    assert metrics[-1]["rollout/concurrency_cap"] == 8.0


def test_filtered_and_zero_std_groups_are_reported_not_emitted(server_config, tool_tokenizer):
    class EvenRows(AsyncRolloutLoop):
        def filter_prompt(self, row_index, row, epoch):
            return row_index % 2 == 0

    dataset = [{"prompt": _chat(f"q{i}")} for i in range(4)]
    loop = EvenRows(
        server_config(), tokenizer=tool_tokenizer, dataset=dataset, reward_funcs=constant_reward, max_epochs=1
    )
    samples, groups, metrics = _run(loop)
    assert samples == []
    assert sorted((g.row_index, g.reason) for g in groups) == [
        (0, "zero_std"),
        (1, "filtered"),
        (2, "zero_std"),
        (3, "filtered"),
    ]
    scored = [m for m in metrics if "rollout/window_reward" in m]  # windows may split the groups
    assert scored and all(
        m["rollout/window_frac_reward_zero_std"] == 1.0 and m["rollout/window_reward"] == 1.0 for m in scored
    )


def test_prompts_longer_than_the_context_are_counted_named_and_dropped(server_config, tool_tokenizer, caplog):
    long_prompt = _chat("one two three " * 1200)  # well over the server's max_model_len of 2048 tokens
    dataset = [{"prompt": long_prompt}, {"prompt": _chat("What is 1 + 1?")}]
    loop = AsyncRolloutLoop(
        server_config(num_generations=2, max_completion_length=8),
        tokenizer=tool_tokenizer,
        dataset=dataset,
        reward_funcs=length_reward,
        max_epochs=1,
    )
    with caplog.at_level(logging.WARNING, logger="agrpo_rollout"):
        samples, groups, metrics = _run(loop)
    assert "--max-model-len" in caplog.text and "filter_prompt" in caplog.text
    assert metrics[-1]["rollout/prompt_too_long_total"] == 2.0  # both rollouts of the long prompt
    assert {s.group_id for s in samples} <= {g.group_id for g in groups if g.row_index == 1}
    assert not next(g for g in groups if g.row_index == 0).kept


def _add_tool_loop(loop_cls, config, tokenizer):
    """One prompt asking for the `add` tool, one epoch, scored by length; its metrics arrive in one window
    (see `_group_window`)."""
    dataset = [{"prompt": _chat("Add 2 and 3 with the tool.")}]
    return loop_cls(
        config, tokenizer=tokenizer, dataset=dataset, reward_funcs=length_reward, tools=[add], max_epochs=1
    )


def _group_window(metrics):
    """The one metrics window holding the only group: with a long `metrics_interval_s` the loop pushes once
    the group is scored and once at the end, and either push may be the one that carries it."""
    busy = [m for m in metrics if m["rollout/turns_max"] > 0]
    assert len(busy) == 1, metrics
    return busy[0]


def test_multi_turn_tool_conversation(server_config, tool_tokenizer):
    config = server_config(max_completion_length=60, metrics_interval_s=600.0)
    loop = _add_tool_loop(ScriptedToolLoop, config, tool_tokenizer)
    samples, groups, metrics = _run(loop)
    group = groups[0].group
    for rollout, sequences in zip(group.rollouts, group.completions_sequences, strict=True):
        assert len(rollout.turns) == 2 and rollout.tool_call_count == 1 and rollout.tool_failure_count == 0
        assert [m["role"] for m in rollout.completion] == ["assistant", "tool", "assistant"]
        assert rollout.completion[0]["tool_calls"][0]["function"] == {
            "name": "add",
            "arguments": {"a": 2, "b": 3},
        }
        assert rollout.completion[1] == {"role": "tool", "name": "add", "content": "5"}
        assert "5" in tool_tokenizer.decode(rollout.turns[1].prompt_ids[-12:]), (
            "the tool result is in the next prompt"
        )
        sampled = [t.output_ids[t.trained_mask] for t in rollout.turns]
        trained = [s.input_ids[s.trained_mask] for s in sequences]
        assert np.array_equal(np.concatenate(trained), np.concatenate(sampled)), (
            "every sampled token trained once"
        )
        logprobs = np.concatenate([t.output_log_probs[t.trained_mask] for t in rollout.turns])
        assert np.array_equal(np.concatenate([s.sampler_logprobs for s in sequences]), logprobs)
    final = _group_window(metrics)
    assert final["tools/add/call_total"] == 2.0 and final["tools/call_frequency"] == 1.0
    assert final["tools/failure_frequency"] == 0.0 and final["rollout/turns_max"] == 2.0
    assert samples == [] or all(PackSample(**s.pack_fields()) for s in samples)


def test_history_rewriting_template_forks(server_config, rewrite_tokenizer):
    config = server_config(max_completion_length=80, metrics_interval_s=600.0)
    loop = _add_tool_loop(ThinkingToolLoop, config, rewrite_tokenizer)
    _, groups, metrics = _run(loop)
    group = groups[0].group
    for rollout, sequences in zip(group.rollouts, group.completions_sequences, strict=True):
        first, second = rollout.turns
        held = np.concatenate([first.prompt_ids, first.output_ids])
        assert not np.array_equal(second.prompt_ids[: held.shape[0]], held), (
            "the template rewrote the history"
        )
        assert len(sequences) == 2, "the rewritten turn starts a new sequence"
        assert np.array_equal(sequences[1].input_ids[: second.prompt_ids.shape[0]], second.prompt_ids)
        n = min(sequences[0].input_ids.shape[0], second.prompt_ids.shape[0])
        shared = np.flatnonzero(sequences[0].input_ids[:n] != second.prompt_ids[:n])[0]
        assert shared >= first.prompt_ids.shape[0], "the fork shares the whole first prompt"
    final = _group_window(metrics)
    assert final["rollout/fork_frac"] == 1.0 and final["rollout/drift_tokens_max"] > 0
    assert final["rollout/samples_per_rollout"] == 2.0


class Counter:
    def reset(self, start=0, **_):
        self.value = start
        return f"The counter starts at {start}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.value += step
        return self.value

    def get_reward(self):
        return float(self.value)


class Echo:
    def reset(self, **_):
        return None

    def echo(self, text: str) -> str:
        """Repeat a text.

        Args:
            text: The text.
        """
        return text


class IncrementLoop(ScriptedToolLoop):
    script = '<tool_call>\n{"name": "increment", "arguments": {"step": 3}}\n</tool_call>'


@pytest.mark.parametrize("dict_factory", [False, True])
def test_environment_tools_reset_and_reward(server_config, tool_tokenizer, dict_factory):
    dataset = [{"prompt": _chat("Count."), "start": 4, "environment": "counter"}]
    factory = {"counter": Counter, "echo": Echo} if dict_factory else Counter
    loop = IncrementLoop(
        server_config(num_generations=2, max_completion_length=60), tokenizer=tool_tokenizer, dataset=dataset,
        reward_funcs=length_reward, environment_factory=factory, max_epochs=1,
    )  # fmt: skip
    _, groups, metrics = _run(loop)
    group = groups[0].group
    assert group.prompts[0][-1]["content"] == "Count.\n\nThe counter starts at 4."
    assert group.rewards_by_func["Counter"].tolist() == [7.0, 7.0], "4 + the scripted increment of 3"
    assert np.allclose(
        group.rewards, group.rewards_by_func["Counter"] + group.rewards_by_func["length_reward"]
    )
    prompt_text = tool_tokenizer.decode(group.rollouts[0].turns[0].prompt_ids)
    assert '"name": "increment"' in prompt_text and '"name": "echo"' not in prompt_text
    # window metrics: in whichever push followed the reset and the reward (the first push can come before the end)
    assert any(m.get("env/reset_s", -1) >= 0 for m in metrics) and any("env/reward_s" in m for m in metrics)


def test_cancelling_run_stops_cleanly_and_a_blocking_sink_throttles(server_config, tool_tokenizer):
    closed = []

    class Tracked(AsyncRolloutLoop):
        async def close(self):
            closed.append(True)

    def slow_sink(sample):
        import time

        time.sleep(0.05)

    async def go():
        dataset = [{"prompt": _chat("Go on.")}]  # no max_epochs: cycles forever
        loop = Tracked(
            server_config(num_generations=2),
            tokenizer=tool_tokenizer,
            dataset=dataset,
            reward_funcs=length_reward,
        )
        metrics = []
        task = asyncio.ensure_future(loop.run(slow_sink, metrics_sink=metrics.append))
        for _ in range(600):
            if any(m["rollout/backpressure_s"] > 0 for m in metrics):
                break
            await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return metrics

    metrics = asyncio.run(go())
    assert closed == [True]
    assert any(m["rollout/backpressure_s"] > 0 for m in metrics)


def broken_reward(completions, **_):
    raise RuntimeError("grader is down")


def test_failures_end_the_run_with_the_original_error(server_config, tool_tokenizer):
    dataset = [{"prompt": _chat("q")}]
    loop = AsyncRolloutLoop(
        server_config(), tokenizer=tool_tokenizer, dataset=dataset, reward_funcs=broken_reward
    )
    with pytest.raises(RuntimeError, match="grader is down"):
        asyncio.run(loop.run(lambda sample: None))

    def full_queue(sample):
        raise OverflowError("queue full")

    loop = AsyncRolloutLoop(
        server_config(), tokenizer=tool_tokenizer, dataset=dataset, reward_funcs=length_reward
    )
    with pytest.raises(OverflowError, match="queue full"):
        asyncio.run(loop.run(full_queue, metrics_sink=lambda metrics: None))


def test_a_failed_rollout_stops_dispatch_at_once(fault_proxy, server_config, tool_tokenizer):
    """The server dies (every completion answers 500). With 2 slots and groups of 4, the dispatcher used to
    start the group's other rollouts, each with a fresh retry budget, after the first had failed, and only
    looked at a group's failure once the whole group was dispatched: about 2x the retry budget, or more."""
    started = []

    class Counting(AsyncRolloutLoop):
        async def generate_one(self, prompt, tools, group_id=0):
            started.append(group_id)
            return await super().generate_one(prompt, tools, group_id)

    async def go():
        async with fault_proxy(["500"] * 100) as url:
            config = server_config(
                vllm_server_base_url=url, num_generations=4, max_concurrent_rollouts=2, vllm_max_retries=2
            )
            dataset = [{"prompt": _chat(f"q{i}")} for i in range(3)]
            loop = Counting(config, tokenizer=tool_tokenizer, dataset=dataset, reward_funcs=length_reward)
            with pytest.raises(ServerUnavailableError, match="failed 3 times"):
                await loop.run(lambda sample: None)

    asyncio.run(go())
    assert started == [0, 0], "no rollout starts after one failed"


def test_a_group_whose_adapter_left_the_server_is_dropped_as_stale_once_a_newer_version_exists(
    server_config, tool_tokenizer, monkeypatch
):
    """The real server answers 404 for an adapter it does not serve (as after a LoRA window unload)."""
    monkeypatch.setattr("agrpo_rollout._group_dispatch._RETIRED_WAIT_S", 1.0)
    dataset = [{"prompt": _chat("q")}]
    config = server_config(model_name="never-loaded-v{version}")
    versions = iter([1])  # the group is dispatched at version 1; version 2 is published meanwhile
    loop = AsyncRolloutLoop(config, tokenizer=tool_tokenizer, dataset=dataset, reward_funcs=length_reward)
    samples, groups, metrics = _run(loop, policy_version=lambda: next(versions, 2), max_groups=1)
    assert samples == [] and [(g.row_index, g.kept, g.reason) for g in groups] == [(0, False, "stale")]
    assert metrics[-1]["rollout/groups_stale_total"] == 1.0

    loop = AsyncRolloutLoop(config, tokenizer=tool_tokenizer, dataset=dataset, reward_funcs=length_reward)
    with pytest.raises(RequestRejectedError, match="never-loaded-v3"):  # no newer version: a real error
        asyncio.run(loop.run(lambda sample: None, policy_version=lambda: 3, max_groups=1))


def wild_reward(completions, **_):
    """inf and 1e308 (beyond float32, overflows a float64 sum), then 3e38 and two ordinary rewards."""
    return [math.inf, 1e308, 3e38, 1.0, 0.0]


def bonus_reward(completions, **_):
    """Only rollout 2 gets one: 3e38 + 3e38 leaves float32's range."""
    return [None, None, 3e38, None, None]


def first_wins(completions, **_):
    return [1.0] + [0.0] * (len(completions) - 1)


def test_infinite_and_overflowing_rewards_are_excluded_counted_and_never_make_nan_advantages(
    server_config, tool_tokenizer, caplog
):
    dataset = [{"prompt": _chat("q")}]
    loop = AsyncRolloutLoop(
        server_config(num_generations=5), tokenizer=tool_tokenizer, dataset=dataset,
        reward_funcs=[wild_reward, bonus_reward], max_epochs=1,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="agrpo_rollout"):
        samples, groups, metrics = _run(loop)
    assert groups[0].kept and len(samples) == 5
    by_rollout = {s.rollout_id: s for s in samples}
    rollouts = groups[0].group.rollouts
    advantages = [by_rollout[r.rollout_id].advantage for r in rollouts]
    assert np.isfinite([a for s in samples for a in s.advantages]).all()
    assert advantages[:3] == [0.0, 0.0, 0.0] and advantages[3] == pytest.approx(1.0, abs=1e-5)
    assert all(math.isnan(by_rollout[r.rollout_id].reward) for r in rollouts[:3])
    assert metrics[-1]["rollout/rewards_nonfinite_total"] == 3.0  # inf, 1e308, and the overflowing sum
    assert "'wild_reward' gave 2" in caplog.text and "(sum of sources)" in caplog.text

    class NaNAdvantages(AsyncRolloutLoop):
        def compute_advantages(self, group):
            return np.full(len(group.rewards), np.nan)

    loop = NaNAdvantages(server_config(), tokenizer=tool_tokenizer, dataset=dataset, reward_funcs=first_wins)
    with pytest.raises(ValueError, match="compute_advantages returned.*return finite advantages"):
        asyncio.run(loop.run(lambda sample: None, max_groups=1))


class ReferenceSignatureLoop(AsyncRolloutLoop):
    """Overrides `generate_one_turn` with the reference's one-argument signature."""

    async def generate_one_turn(self, prompt_ids):
        turn = await self.client.sample(prompt_ids, max_tokens=3)
        self.seen.append(len(prompt_ids))
        return turn


def test_overrides_with_the_reference_signature_still_run(server_config, tool_tokenizer):
    loop = ReferenceSignatureLoop(
        server_config(),
        tokenizer=tool_tokenizer,
        dataset=[{"prompt": _chat("hi")}],
        reward_funcs=length_reward,
        max_epochs=1,
    )
    loop.seen = []
    _, groups, _ = _run(loop)
    assert len(loop.seen) == 2 and all(len(r.completion_ids) <= 3 for r in groups[0].group.rollouts)


def test_a_blocked_sink_stops_new_groups_once_the_score_queue_is_full(server_config, tool_tokenizer):
    """Slots come back when rollouts end, so without this a blocked sink would let finished groups pile up
    in front of the score queue for as long as prompts last."""
    settings = dict(num_generations=2, max_concurrent_rollouts=4, score_queue_maxsize=2)

    async def go():
        release = asyncio.Event()
        loop = AsyncRolloutLoop(server_config(**settings), tokenizer=tool_tokenizer,
                                dataset=[{"prompt": _chat("Go on.")}], reward_funcs=length_reward)  # fmt: skip
        draws = []

        async def blocked(sample):
            await release.wait()

        task = asyncio.ensure_future(loop.run(blocked, on_draw=lambda row, epoch: draws.append(epoch)))
        await asyncio.sleep(10)  # far longer than the few tiny rollouts that fit
        filled = len(draws)
        await asyncio.sleep(4)
        still = len(draws)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return filled, still

    filled, still = asyncio.run(go())
    # one group at the blocked sink, two in the queue, up to four more in flight or waiting to enter it (a
    # rollout gives its slot back when it ends, so four slots can hold one unfinished rollout of four groups),
    # and the one the dispatcher drew before the queue filled, waiting for a slot (drawn counts it already)
    assert 3 <= filled == still <= 1 + 2 + 4 + 1, (filled, still)


def _server_counts(url: str) -> dict[str, float]:
    """vLLM's running-request gauge and its count of requests finished by an abort (a closed client)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = {"running": 0.0, "aborted": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_running":
                counts["running"] += sample.value
            elif (
                sample.name == "vllm:request_success_total"
                and sample.labels.get("finished_reason") == "abort"
            ):
                counts["aborted"] += sample.value
    return counts


def test_a_group_that_can_no_longer_be_trained_is_cancelled_and_the_server_aborts_it(
    server_config, tool_tokenizer, vllm_server
):
    config = server_config(
        num_generations=4, max_completion_length=800, extra_request_fields={"ignore_eos": True}
    )
    dataset = [{"prompt": _chat("Tell me a long story.")}]
    loop = AsyncRolloutLoop(
        config, tokenizer=tool_tokenizer, dataset=dataset, reward_funcs=length_reward, max_epochs=1
    )
    state = {"trainable": True}
    samples, groups, metrics = [], [], []
    before = _server_counts(vllm_server.url)

    async def go():
        async def stale_once_generating():  # the trainer moves on while the group's requests run
            while getattr(loop, "pool", None) is None or not loop.pool.servers[0].client.generating:
                await asyncio.sleep(0.01)
            state["trainable"] = False

        watch = asyncio.ensure_future(stale_once_generating())
        await loop.run(
            samples.append, on_group=groups.append, metrics_sink=metrics.append,
            trainable=lambda version: state["trainable"],
        )  # fmt: skip
        watch.cancel()

    asyncio.run(go())
    assert [(g.kept, g.reason) for g in groups] == [(False, "stale")] and not samples
    deadline, counts = time.monotonic() + 15, _server_counts(vllm_server.url)
    while counts["running"] and time.monotonic() < deadline:
        time.sleep(0.2)  # the server's gauges are published a little after the event
        counts = _server_counts(vllm_server.url)
    assert counts["running"] == 0, (before, counts)  # 8 x 960 tokens would still be decoding otherwise
    assert metrics[-1]["rollout/groups_cancelled_total"] == 1.0


class OldSignatureToolLoop(ScriptedToolLoop):
    """An override written before `routes_from` existed: its requests ask for every route again."""

    async def generate_one_turn(self, prompt_ids, max_tokens=None):
        return await super().generate_one_turn(prompt_ids, max_tokens=max_tokens)


@pytest.mark.server
@pytest.mark.parametrize("kind", ["tool", "fork", "old_signature"])
def test_routes_reach_the_packed_row_through_turns_and_forks(
    server_config, routes_proxy, tool_tokenizer, rewrite_tokenizer, kind
):
    """Real multi-turn rollouts (a tool round; a history-rewriting template that forks; an override that
    cannot pass `routes_from`) on the real server, with the routes a GPU server adds (`RoutesProxy`, a route
    per token id): every token a request forwarded keeps its route through turns, sequences, samples and the
    packed row; a later turn asks only for the routes its rollout lacks; shared tokens agree, so nothing
    conflicts."""
    proxy = routes_proxy()
    loop_cls = {"tool": ScriptedToolLoop, "fork": ThinkingToolLoop, "old_signature": OldSignatureToolLoop}[
        kind
    ]
    tokenizer = rewrite_tokenizer if kind == "fork" else tool_tokenizer

    async def go():
        async with proxy as url:
            config = server_config(
                vllm_server_base_url=url,
                max_completion_length=80,
                return_routed_experts=True,
                model_config=proxy.model_config,
            )
            loop = _add_tool_loop(loop_cls, config, tokenizer)
            samples, groups, metrics = [], [], []
            await loop.run(samples.append, on_group=groups.append, metrics_sink=metrics.append)
            return samples, groups, metrics

    samples, groups, metrics = asyncio.run(go())
    group = groups[0].group
    for rollout, sequences in zip(group.rollouts, group.completions_sequences, strict=True):
        first, second = rollout.turns
        skipped = (second.routed_experts[: first.prompt_ids.shape[0]] == -1).all()
        assert skipped == (kind != "old_signature"), "the second request skips the routes the first returned"
        assert len(sequences) == 2 or kind != "fork"
        for sequence in sequences:
            routes = sequence.routed_experts
            routed = (routes != -1).any(axis=(1, 2))
            assert np.array_equal(routes[routed], proxy.route(sequence.input_ids[routed]))
            assert not routed[-1], "the last sampled token was never forwarded"
        assert routed[:-1].all(), "the last sequence is routed throughout: the second turn forwarded all of it"
    assert "rollout/route_conflicts_total" not in metrics[-1]
    if samples:
        packs = [PackSample(**s.pack_fields()) for s in samples]
        row = TreeRow(0)
        row.extend(packs)
        packed = row.pack()
        assert_row_layout(packed, packs)
        assert packed.routed_experts is not None and packed.route_conflicts == 0

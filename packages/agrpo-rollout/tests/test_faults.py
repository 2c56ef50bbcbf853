"""Faults of the rollout side against the real CPU vLLM server (issue 13, point 3; the whole matrix with every
row's proving test is `docs/reliability.md`; the same faults through the trainer are
`packages/agrpo-trainer/tests/test_faults.py`).

- A reward function that raises or returns the wrong number of values, or an environment whose `reset()`
  raises, ends the run with the original error plus a note naming the function (or environment), the
  dataset row and the fix. An exception is not turned into a silent exclusion: a function that fails
  would change what is optimised unseen; `None` is the documented way to leave a rollout out.
- None and NaN from one source leave only that source out of that rollout's reward.
- A tool call that does not return within the timeout becomes an error message to the model.
- 500s, dropped connections and slow answers on a share of sampling requests (`tools.fault_proxy`) are
  retried: every drawn prompt gets exactly one outcome and every kept group's samples all reach the sink.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from agrpo_rollout import AsyncRolloutLoop, Toolbox
from tools.fault_proxy import FaultMix, FaultProxy

pytestmark = pytest.mark.server


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def text_length(completions, **_):
    return [float(len(str(c[-1]["content"]))) for c in completions]


def exploding_reward(completions, **_):
    raise KeyError("solution")


def one_value_reward(completions, **_):
    return [1.0]


@pytest.mark.parametrize(
    ("reward", "error", "named"),
    [
        (exploding_reward, KeyError, r"reward function 'exploding_reward' raised.*return None"),
        (one_value_reward, ValueError, r"one_value_reward returned 1 values for 2 completions.*one float"),
    ],
    ids=["raises", "wrong-length"],
)
def test_a_reward_that_raises_or_miscounts_ends_the_run_naming_it_the_row_and_the_fix(
    server_config, tool_tokenizer, reward, error, named
):
    dataset = [{"prompt": _chat(f"q{i}")} for i in range(3)]
    loop = AsyncRolloutLoop(server_config(), tokenizer=tool_tokenizer, dataset=dataset,
                            reward_funcs=[text_length, reward], max_epochs=1)  # fmt: skip
    with pytest.raises(error) as raised:
        asyncio.run(loop.run(lambda sample: None))
    message = "\n".join([str(raised.value), *getattr(raised.value, "__notes__", [])])
    assert re.search(named, message, re.DOTALL), message
    assert re.search(r"the group of dataset row \d \(epoch 0\)", message), message


class BrokenSandbox:
    def reset(self, **row):
        raise ConnectionRefusedError("sandbox refused the connection")


def test_a_reset_that_raises_ends_the_run_naming_the_environment_and_the_fix(server_config, tool_tokenizer):
    loop = AsyncRolloutLoop(server_config(), tokenizer=tool_tokenizer, dataset=[{"prompt": _chat("q")}],
                            reward_funcs=text_length, environment_factory=BrokenSandbox, max_epochs=1)  # fmt: skip
    with pytest.raises(ConnectionRefusedError) as raised:
        asyncio.run(loop.run(lambda sample: None))
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "environment BrokenSandbox.reset() raised" in notes and "filter_prompt" in notes, notes
    assert "'q'" in notes, "the note shows the row's prompt"


def patchy(completions, **_):
    return [[1.0, None, math.nan, 2.0][i % 4] for i in range(len(completions))]


def test_none_and_nan_from_one_source_leave_only_that_source_out(server_config, tool_tokenizer):
    loop = AsyncRolloutLoop(server_config(num_generations=4), tokenizer=tool_tokenizer,
                            dataset=[{"prompt": _chat("q")}], reward_funcs=[text_length, patchy], max_epochs=1)  # fmt: skip
    groups = []
    asyncio.run(loop.run(lambda sample: None, on_group=groups.append))
    group = groups[0].group
    lengths = group.rewards_by_func["text_length"]
    np.testing.assert_allclose(group.rewards, lengths + np.array([1.0, 0.0, 0.0, 2.0]))
    assert np.isnan(group.rewards_by_func["patchy"][1:3]).all() and np.isfinite(group.rewards).all()


async def stall(seconds: int) -> str:
    """Never answers in time.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(3600)
    return "late"


def slow_lookup(key: str) -> str:
    """A blocking lookup that takes a while.

    Args:
        key: What to look up.
    """
    time.sleep(2.0)
    return key


async def own_timeout(url: str) -> str:
    """Fails with its own TimeoutError.

    Args:
        url: What to fetch.
    """
    raise TimeoutError(f"{url} timed out")


def test_a_tool_that_does_not_return_becomes_a_timeout_message():
    calls = [{"function": {"name": n, "arguments": a}}
             for n, a in (("stall", {"seconds": 1}), ("slow_lookup", {"key": "k"}), ("own_timeout", {"url": "u"}))]  # fmt: skip
    box = Toolbox([stall, slow_lookup, own_timeout])
    with ThreadPoolExecutor(2) as pool:
        start = time.monotonic()
        outcomes = asyncio.run(box.run(calls, pool, timeout_s=0.3))
        elapsed = time.monotonic() - start
    assert [o.failed for o in outcomes] == [True, True, True] and elapsed < 1.5
    assert outcomes[0].content == "Error: TimeoutError: tool 'stall' did not return within 0.3 s"
    assert outcomes[1].content == "Error: TimeoutError: tool 'slow_lookup' did not return within 0.3 s"
    assert outcomes[2].content == "Error: TimeoutError: u timed out", "the tool's own timeout is its own error"
    assert asyncio.run(Toolbox([slow_lookup]).run(calls[1:2], None))[0].content == "k", "no timeout: waits"


def test_500s_drops_and_slow_answers_on_a_share_of_requests_lose_no_prompt(vllm_server, server_config, tool_tokenizer):
    dataset = [{"prompt": _chat(f"Tell me about {i}.")} for i in range(12)]
    draws, outcomes, samples, metrics = [], [], Counter(), []
    policy = FaultMix(error_500=0.15, drop=0.1, slow=0.15, seed=3)
    with FaultProxy(vllm_server.url, policy, slow_s=(0.1, 0.4)) as proxy:
        config = server_config(vllm_server_base_url=proxy.url, num_generations=4, vllm_max_retries=10)
        loop = AsyncRolloutLoop(config, tokenizer=tool_tokenizer, dataset=dataset, reward_funcs=text_length,
                                max_epochs=1)  # fmt: skip
        asyncio.run(loop.run(lambda s: samples.update([s.group_id]), on_group=outcomes.append,
                             on_draw=lambda row, epoch: draws.append((epoch, row)), metrics_sink=metrics.append))  # fmt: skip
    assert sorted(draws) == sorted((o.epoch, o.row_index) for o in outcomes) == [(0, i) for i in range(12)]
    assert {o.group_id: o.num_samples for o in outcomes if o.kept} == dict(samples)
    assert proxy.counts["500"] > 0 and proxy.counts["drop"] > 0 and proxy.counts["slow"] > 0
    assert metrics[-1]["rollout/vllm_retry_total"] == proxy.counts["500"] + proxy.counts["drop"]

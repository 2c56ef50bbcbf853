import asyncio
import functools
import threading

import numpy as np
import pytest

from agrpo_rollout._reward import RewardScorer, reward_name, sum_rewards


def length_reward(completions, **_):
    return [float(len(c)) for c in completions]


async def judge_reward(completions, answer, **_):
    await asyncio.sleep(0)
    return [None if a is None else float(c == a) for c, a in zip(completions, answer, strict=True)]


def thread_reward(completions, **_):
    return [float(threading.current_thread() is not threading.main_thread())] * len(completions)


def test_sync_async_and_none_rewards_combine():
    scorer = RewardScorer([length_reward, judge_reward, functools.partial(thread_reward)])
    assert scorer.names == ["length_reward", "judge_reward", "thread_reward"]
    columns = asyncio.run(scorer.score(["p", "p"], ["ab", "c"], [[1], [2]], {"answer": ["ab", None]}))
    assert columns["length_reward"].tolist() == [2.0, 1.0]
    assert columns["judge_reward"][0] == 1.0 and np.isnan(columns["judge_reward"][1])
    assert columns["thread_reward"].tolist() == [1.0, 1.0], "sync reward functions run off the event loop"
    assert sum_rewards(list(columns.values())).tolist() == [4.0, 2.0]


def test_nan_only_where_no_source_scored():
    total = sum_rewards([np.array([np.nan, 1.0]), np.array([np.nan, np.nan])])
    assert np.isnan(total[0]) and total[1] == 1.0
    with pytest.raises(ValueError, match="no reward source"):
        sum_rewards([])


def test_wrong_length_and_duplicate_names_are_user_errors():
    with pytest.raises(ValueError, match="returned 1 values for 2"):
        asyncio.run(
            RewardScorer([lambda completions, **_: [1.0]]).score(["a", "b"], ["a", "b"], [[], []], {})
        )
    with pytest.raises(ValueError, match="distinct"):
        RewardScorer([length_reward, length_reward])
    assert reward_name(functools.partial(functools.partial(length_reward))) == "length_reward"

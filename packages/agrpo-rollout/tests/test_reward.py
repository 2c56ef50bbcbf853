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


def test_a_bare_float_or_a_non_number_names_the_function():
    def mean_score(completions, **_):
        return 0.5

    def labels(completions, **_):
        return ["good"] * len(completions)

    with pytest.raises(TypeError, match=r"reward function mean_score returned 0\.5 \(float\).*one float"):
        asyncio.run(RewardScorer([mean_score]).score(["a"], ["a"], [[]], {}))
    with pytest.raises(TypeError, match="reward function labels returned 'good' for completion 0"):
        asyncio.run(RewardScorer([labels]).score(["a"], ["a"], [[]], {}))


def test_infinite_and_out_of_range_values_are_excluded_and_counted():
    from agrpo_rollout._reward import exclude_unusable

    columns, counts = exclude_unusable(
        {"f": np.array([np.inf, 1e308, 1.0, np.nan]), "g": np.array([1.0, 2.0, -np.inf, 0.0])}
    )
    assert counts == {"f": 2, "g": 1}
    assert np.isnan(columns["f"][:2]).all() and columns["f"][2] == 1.0 and np.isnan(columns["g"][2])

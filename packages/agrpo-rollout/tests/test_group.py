import numpy as np

from agrpo_rollout import group_advantages, is_trainable


def test_advantages_standardise_within_the_group_and_zero_nan():
    advantages = group_advantages(np.array([1.0, 0.0, np.nan, 1.0, 0.0]))
    assert advantages[2] == 0.0
    scored = advantages[[0, 1, 3, 4]]
    assert np.allclose(scored, [1.0, -1.0, 1.0, -1.0], atol=1e-6)
    assert advantages.dtype == np.float32


def test_groups_without_signal_are_not_trainable():
    assert is_trainable(np.array([0.5, 0.5, np.nan])) == (False, "zero_std")
    assert is_trainable(np.array([1.0, np.nan])) == (False, "unscorable")
    assert is_trainable(np.array([1.0, 0.0])) == (True, "")
    assert group_advantages(np.array([1.0, np.nan])).tolist() == [0.0, 0.0]


def test_infinite_and_overflowing_rewards_are_excluded_like_nan():
    """inf - inf and 1e308 + 1e308 made NaN advantages; such rewards now count as unscored."""
    rewards = np.array([np.inf, 1e308, 1.0, 0.0, -np.inf, np.nan])
    advantages = group_advantages(rewards)
    assert np.isfinite(advantages).all()
    assert advantages.tolist()[:2] == [0.0, 0.0] and advantages.tolist()[4:] == [0.0, 0.0]
    assert np.allclose(advantages[2:4], [1.0, -1.0], atol=1e-6)
    assert is_trainable(np.array([1e308, 2e308, 1.0])) == (False, "unscorable")
    big = float(np.finfo(np.float32).max)
    assert np.isfinite(group_advantages(np.array([big, -big, big]))).all(), "the limit itself is usable"

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

"""A run whose groups are all dropped for their rewards stops loudly instead of waiting for samples forever:
`DroppedGroupGuard`'s counting, then the whole path against the real CPU server with a reward that never varies
(every group has equal rewards, so none reaches the trainer)."""

from __future__ import annotations

import psutil
import pytest
from rollout_doubles import constant_reward

from agrpo_rollout import GroupOutcome
from agrpo_trainer import AsyncGRPOTrainer, NothingTrainedError
from agrpo_trainer._demo import PROMPTS, demo_config
from agrpo_trainer._group_guard import DroppedGroupGuard


def _outcome(reason: str, samples: int = 0) -> GroupOutcome:
    return GroupOutcome(0, 0, 0, reason == "", reason, samples, None)


def test_the_guard_stops_at_the_limit_of_groups_dropped_in_a_row_and_a_kept_group_starts_over():
    guard = DroppedGroupGuard(limit=4)
    for reason in ("zero_std", "unscorable", "zero_std", "stale", "filtered"):  # stale/filtered say nothing
        guard.observe(_outcome(reason))
    guard.observe(_outcome("", samples=8))  # a group reached the queue: the count starts over
    assert guard.dropped.total() == 0
    guard.observe(_outcome("", samples=0))  # kept but without a trained token: neither counts nor resets
    for reason in ("zero_std", "zero_std", "unscorable"):
        guard.observe(_outcome(reason))
    with pytest.raises(NothingTrainedError) as raised:
        guard.observe(_outcome("zero_std"))
    message = str(raised.value)
    assert "the last 4 groups were all dropped" in message
    assert "3 with every rollout's reward equal, 1 with fewer than two scorable rewards" in message
    assert "max_groups_dropped_in_a_row=4" in message and "0: never stop" in message

    never = DroppedGroupGuard(limit=0)
    for _ in range(10_000):
        never.observe(_outcome("zero_std"))
    assert never.dropped.total() == 10_000


def test_the_limit_is_checked_at_construction(tmp_path):
    from agrpo_trainer import AsyncGRPOConfig

    with pytest.raises(ValueError, match="max_groups_dropped_in_a_row=-1; it must be >= 0"):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_groups_dropped_in_a_row=-1)


@pytest.mark.server
def test_a_run_whose_reward_never_varies_stops_naming_the_cause_instead_of_waiting_forever(
    training_server, untied_qwen3_dir, tmp_path
):
    """max_steps decides, so the prompts cycle without end: before the guard this run sat at step 0 for good."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    args = demo_config(str(tmp_path / "run"), training_server.url, max_steps=5)
    args.max_groups_dropped_in_a_row = 6
    trainer = AsyncGRPOTrainer(str(untied_qwen3_dir), constant_reward, args=args, train_dataset=PROMPTS)
    with pytest.raises(
        NothingTrainedError, match=r"last 6 groups were all dropped .*6 with every rollout's reward"
    ):
        trainer.train()
    assert trainer.state.global_step == 0
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before

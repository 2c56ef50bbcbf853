"""PromptLedger: epoch counting by distinct prompts (forks never double-count) and the trained position."""

from __future__ import annotations

from agrpo_rollout import GroupOutcome
from agrpo_trainer._pipeline import ResumePoint
from agrpo_trainer._prompt_ledger import PromptLedger


def outcome(row: int, kept: bool, samples: int, epoch: int = 0) -> GroupOutcome:
    return GroupOutcome(row, epoch, row if kept else -1, kept, "" if kept else "zero_std", samples, None)


def test_each_prompt_is_consumed_once_whatever_its_fate_and_however_many_samples():
    ledger = PromptLedger()
    ledger.record_outcome(outcome(0, kept=False, samples=0))  # dropped or filtered: consumed at once
    ledger.settle(0, 1, trained=True)  # samples may arrive before their group's outcome
    ledger.record_outcome(outcome(1, kept=True, samples=3))  # a forked rollout: 3 samples, one prompt
    assert ledger.num_consumed == 1
    ledger.settle(0, 1, trained=True)
    ledger.settle(0, 1, trained=False)
    assert ledger.num_consumed == 2 and ledger.num_trained_prompts == 1
    ledger.settle(0, 1, trained=True)  # an extra settle never counts the prompt twice
    assert ledger.num_consumed == 2


def test_the_trained_position_is_the_first_prompt_not_done_and_stale_losses_are_regenerated():
    ledger = PromptLedger()
    for row in range(5):
        ledger.record_outcome(outcome(row, kept=True, samples=1))
    for row in (0, 2, 4):
        ledger.settle(0, row, trained=True)
    ledger.settle(0, 1, trained=False)  # every sample went stale: consumed, but never trained
    state = ledger.resume_state()
    assert state == {"resume_from": [0, 1], "done": [[0, 2], [0, 4]], "prompts_consumed": 4}


def test_a_group_abandoned_as_stale_is_consumed_but_regenerated_after_a_resume():
    ledger = PromptLedger()
    ledger.record_outcome(GroupOutcome(0, 0, 0, False, "stale", 0, None))  # its adapter left the window
    ledger.record_outcome(outcome(1, kept=False, samples=0))
    assert ledger.num_consumed == 2
    assert ledger.resume_state() == {"resume_from": [0, 0], "done": [[0, 1]], "prompts_consumed": 2}


def test_a_resume_point_shifts_the_loops_epochs_and_skips_what_was_done():
    point = ResumePoint.from_state({"resume_from": [2, 7], "done": [[2, 9], [3, 0]], "prompts_consumed": 31})
    assert (point.start_index, point.base_epoch, point.prompts_consumed) == (7, 2, 31)
    assert point.loop_skip() == {(0, 9), (1, 0)}
    ledger = PromptLedger(base_epoch=point.base_epoch, done=set(point.done), num_consumed=31)
    assert ledger.key(0, 7) == (2, 7) and ledger.key(1, 3) == (3, 3)
    ledger.record_outcome(outcome(7, kept=True, samples=1))
    ledger.settle(0, 7, trained=True)
    assert ledger.resume_state() == {"resume_from": [3, 0], "done": [[3, 0]], "prompts_consumed": 32}
    assert ResumePoint.from_state(None) == ResumePoint()


def test_a_drawn_prompt_whose_group_never_finishes_holds_the_resume_position():
    ledger = PromptLedger()
    for row in range(3):
        ledger.record_draw(0, row)
    for row in (0, 2):  # group 1 is stuck in flight: no outcome, no samples
        ledger.record_outcome(outcome(row, kept=True, samples=1))
        ledger.settle(0, row, trained=True)
    assert ledger.resume_state() == {"resume_from": [0, 1], "done": [[0, 2]], "prompts_consumed": 2}

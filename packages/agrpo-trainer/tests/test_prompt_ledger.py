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
    assert ledger.num_consumed == 4
    state = ledger.resume_state()  # prompts 1 (lost) and 3 (open) are drawn again: not consumed for the resume
    assert state == {"resume_from": [0, 1], "done": [[0, 2], [0, 4]], "prompts_consumed": 3}


def test_a_group_abandoned_as_stale_is_consumed_but_regenerated_after_a_resume():
    ledger = PromptLedger()
    ledger.record_outcome(GroupOutcome(0, 0, 0, False, "stale", 0, None))  # its adapter left the window
    ledger.record_outcome(outcome(1, kept=False, samples=0))
    assert ledger.num_consumed == 2
    assert ledger.resume_state() == {"resume_from": [0, 0], "done": [[0, 1]], "prompts_consumed": 1}


def test_a_group_split_across_optimizer_steps_counts_as_trained_at_a_checkpoint():
    ledger = PromptLedger()
    for row in range(3):
        ledger.record_draw(0, row)
        ledger.record_outcome(outcome(row, kept=True, samples=4))
    for _ in range(4):
        ledger.settle(0, 0, trained=True)
    for _ in range(2):  # two of prompt 1's four samples closed the step; the other two wait in the queue
        ledger.settle(0, 1, trained=True)
    assert ledger.num_consumed == 1  # prompt 1 is still open for epoch counting: its samples will come
    state = ledger.resume_state()  # but a resumed run must not generate it again
    assert state == {"resume_from": [0, 2], "done": [], "prompts_consumed": 2}
    for _ in range(2):
        ledger.settle(0, 1, trained=True)
    assert ledger.num_consumed == 2 and ledger.resume_state()["prompts_consumed"] == 2


def test_over_a_resume_every_prompt_is_consumed_once_so_the_epoch_ends_after_the_last_one():
    ledger = PromptLedger()
    for row in range(4):
        ledger.record_draw(0, row)
        ledger.record_outcome(outcome(row, kept=True, samples=1))
    ledger.settle(0, 0, trained=True)
    ledger.settle(0, 1, trained=False)  # lost (stale): drawn again after the resume
    ledger.settle(0, 3, trained=True)
    point = ResumePoint.from_state(ledger.resume_state())
    resumed = PromptLedger(base_epoch=point.base_epoch, done=set(point.done), num_consumed=point.prompts_consumed)
    assert point.start_index == 1 and point.loop_skip() == {(0, 3)}
    for row in (1, 2):  # what the resumed loop draws
        resumed.record_outcome(outcome(row, kept=True, samples=1))
        assert resumed.num_consumed < 4  # not yet at the end of the 4-prompt epoch
        resumed.settle(0, row, trained=True)
    assert resumed.num_consumed == 4


def test_a_resume_point_shifts_the_loops_epochs_and_skips_what_was_done():
    point = ResumePoint.from_state({"resume_from": [2, 7], "done": [[2, 9], [3, 0]], "prompts_consumed": 31})
    assert (point.start_index, point.base_epoch, point.prompts_consumed, point.start) == (7, 2, 31, (2, 7))
    assert point.loop_skip() == {(0, 9), (1, 0)}
    ledger = PromptLedger(base_epoch=point.base_epoch, done=set(point.done), num_consumed=31, start=point.start)
    assert ledger.resume_state() == {"resume_from": [2, 7], "done": [[2, 9], [3, 0]], "prompts_consumed": 31}
    assert ledger.key(0, 7) == (2, 7) and ledger.key(1, 3) == (3, 3)
    ledger.record_draw(0, 7)
    ledger.record_outcome(outcome(7, kept=True, samples=1))
    ledger.settle(0, 7, trained=True)
    # Row 8 of epoch 2 is not drawn yet: the position is the last row this run drew, skipped by the next one.
    assert ledger.resume_state() == {
        "resume_from": [2, 7], "done": [[2, 7], [2, 9], [3, 0]], "prompts_consumed": 32,
    }  # fmt: skip
    for row in (8, 10):  # epoch 2 has 11 rows
        ledger.record_draw(0, row)
        ledger.record_outcome(outcome(row, kept=True, samples=1))
        ledger.settle(0, row, trained=True)
    ledger.record_draw(1, 1)
    assert ledger.resume_state() == {"resume_from": [3, 1], "done": [], "prompts_consumed": 34}
    assert ledger.num_consumed == 34
    assert ResumePoint.from_state(None) == ResumePoint() and ResumePoint().start is None


def test_a_drawn_prompt_whose_group_never_finishes_holds_the_resume_position():
    ledger = PromptLedger()
    for row in range(3):
        ledger.record_draw(0, row)
    for row in (0, 2):  # group 1 is stuck in flight: no outcome, no samples
        ledger.record_outcome(outcome(row, kept=True, samples=1))
        ledger.settle(0, row, trained=True)
    assert ledger.resume_state() == {"resume_from": [0, 1], "done": [[0, 2]], "prompts_consumed": 2}

import pytest

from agrpo_rollout import PromptsExhaustedError
from agrpo_rollout._prompt_source import PromptSource

ROWS = [{"prompt": f"p{i}"} for i in range(3)]


def test_epochs_resume_and_filter_verdicts():
    draws = list(PromptSource(ROWS, start_index=1, max_epochs=2).draws(lambda i, row, epoch: i != 2))
    assert [(d.row_index, d.epoch, d.accepted) for d in draws] == [
        (1, 0, True), (2, 0, False), (0, 1, True), (1, 1, True), (2, 1, False),
    ]  # fmt: skip


def test_iterable_datasets_restart_at_zero_and_none_is_endless():
    draws = list(PromptSource(IterRows(), start_index=2, max_epochs=1).draws(lambda *_: True))
    assert [d.row_index for d in draws] == [0, 1, 2]
    endless = PromptSource(None).draws(lambda *_: True)
    assert [next(endless).row_index for _ in range(3)] == [0, 1, 2]


def test_an_epoch_of_rejections_raises():
    with pytest.raises(PromptsExhaustedError, match="rejected all 3"):
        list(PromptSource(ROWS).draws(lambda *_: False))
    with pytest.raises(PromptsExhaustedError, match="empty"):
        list(PromptSource([]).draws(lambda *_: True))


class IterRows:  # a re-iterable, like datasets.IterableDataset
    def __iter__(self):
        return iter(ROWS)


def test_skipped_prompts_are_not_drawn_and_an_all_skipped_epoch_is_not_empty():
    source = PromptSource(ROWS, start_index=1, max_epochs=2, skip=frozenset({(0, 2), (1, 0)}))
    assert [(d.epoch, d.row_index) for d in source.draws(lambda *_: True)] == [(0, 1), (1, 1), (1, 2)]
    every_row_done = PromptSource(ROWS, start_index=2, max_epochs=2, skip=frozenset({(0, 2)}))
    assert [(d.epoch, d.row_index) for d in every_row_done.draws(lambda *_: True)] == [(1, 0), (1, 1), (1, 2)]

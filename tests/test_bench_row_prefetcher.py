"""The benchmark's `RowPrefetcher` (the measured alternative to preparing rows inline): rows prepared on its
worker equal the inline ones, it stays `lookahead` rows ahead on its own thread, and a worker error reaches
`take` of that row."""

from __future__ import annotations

import threading

import pytest
from test_device_row import _assert_same, tiny_model_and_rows

from agrpo_trainer._device_row import DeviceRow, prepare_device_row
from tools.bench.train_step.row_prefetcher import RowPrefetcher


@pytest.fixture(scope="module")
def model_and_rows():
    return tiny_model_and_rows()


def test_rows_prepared_on_the_worker_equal_the_inline_ones(model_and_rows):
    model, rows = model_and_rows
    inline = [prepare_device_row(row, model) for row in rows]
    prefetcher = RowPrefetcher(lambda row: prepare_device_row(row, model), "cpu", lookahead=1)
    try:
        for _ in range(2):  # two steps through one prefetcher
            prefetcher.begin(rows)
            _assert_same([prefetcher.take(i) for i in range(len(rows))], inline, "rows")
    finally:
        prefetcher.close()


def test_prefetcher_works_ahead_on_its_own_thread_and_never_past_the_lookahead(model_and_rows):
    _, rows = model_and_rows
    started: list[int] = []
    threads: set[str] = set()
    release = threading.Event()

    def prepare(row):
        started.append(next(i for i, r in enumerate(rows) if r is row))
        threads.add(threading.current_thread().name)
        release.wait(5.0)
        return DeviceRow(row=row, plan=None)

    prefetcher = RowPrefetcher(prepare, "cpu", lookahead=1)
    try:
        prefetcher.begin(rows)
        release.set()
        assert prefetcher.take(0).row is rows[0]
        prefetcher._futures[1].result(5.0)
        assert started == [0, 1]  # row 1 prepared while row 0 is in use, row 2 not yet
        assert all(prefetcher.take(i).row is rows[i] for i in range(1, len(rows)))
    finally:
        prefetcher.close()
    assert (
        threads == {t for t in threads if t.startswith("agrpo-rows")}
        and threading.current_thread().name not in threads
    )


def test_an_error_on_the_worker_is_raised_by_take_of_that_row(model_and_rows):
    _, rows = model_and_rows

    def prepare(row):
        if row is rows[1]:
            raise ValueError("bad row 1")
        return DeviceRow(row=row, plan=None)

    prefetcher = RowPrefetcher(prepare, "cpu")
    try:
        prefetcher.begin(rows)
        assert prefetcher.take(0).row is rows[0]
        with pytest.raises(ValueError, match="bad row 1"):
            prefetcher.take(1)
        with pytest.raises(IndexError, match="call begin"):
            prefetcher.take(len(rows))
    finally:
        prefetcher.close()

"""`BackgroundCall`: result, exception and a bounded wait."""

from __future__ import annotations

import threading

import pytest

from agrpo_sync._background_call import BackgroundCall


def test_result_and_exception_reach_the_waiting_thread():
    assert BackgroundCall(lambda a, b: a + b, 2, 3).start().wait(5) == 5
    failing = BackgroundCall(lambda: 1 / 0).start()
    assert failing.join(5) and failing.failed()
    with pytest.raises(ZeroDivisionError):
        failing.wait(0)


def test_a_call_that_does_not_return_times_out_without_blocking_the_caller():
    release = threading.Event()
    call = BackgroundCall(release.wait).start()
    with pytest.raises(TimeoutError, match="still running"):
        call.wait(0.05)
    assert not call.done() and not call.failed()
    release.set()
    assert call.wait(5) is True

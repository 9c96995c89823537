"""``PendingFutures`` (``ragen.llm.pending``): each future resolved once, by its answer or by close."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from ragen.llm.pending import PendingFutures, fail_closed
from ragen.llm.types import CLOSED_BEFORE_ANSWER


def test_a_future_is_settled_once_and_the_count_follows():
    counts = []
    pending = PendingFutures(on_count=counts.append)
    first, second = Future(), Future()
    pending.add([first, second])
    pending.settle(first, "answer")
    pending.settle(first, "again")  # no longer pending: nothing happens
    assert first.result() == "answer" and first not in pending
    assert second in pending and counts == [2, -1]


def test_close_takes_what_is_left_refuses_more_and_fails_it_on_request():
    pending = PendingFutures("the test engine is closed")
    answered, left, cancelled = Future(), Future(), Future()
    pending.add([answered, left, cancelled])
    pending.settle(answered, 1)
    cancelled.cancel()
    taken = pending.close()
    assert set(taken) == {left, cancelled} and pending.close() is None  # closed once
    pending.settle(left, "late")  # taken by close: the answer does not land
    fail_closed(taken)
    with pytest.raises(RuntimeError, match=CLOSED_BEFORE_ANSWER):
        left.result()
    assert cancelled.cancelled()
    with pytest.raises(RuntimeError, match="the test engine is closed"):
        pending.add([Future()])


def test_an_error_settles_a_future_with_it():
    pending = PendingFutures()
    future = Future()
    pending.add([future])
    pending.settle(future, error=ValueError("bad"))
    with pytest.raises(ValueError, match="bad"):
        future.result()

"""The coalescer: when the engine is called, and with which requests, decided
from plain inputs on a fake clock (no sockets, no threads, no sleeps)."""

from __future__ import annotations

from collections import deque

import pytest

from ragen.llm.types import GenerationRequest, SamplingParams
from ragen.serving import CallCostModel, Coalescer, Pending, StreamClock


def _requests(n, env0=0):
    return [GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down"}],
                              env_id=env0 + i, turn=0, seed=1) for i in range(n)]


def _arrive(c: Coalescer, conn, n, now, env0=0, ticket=0, sampling=None):
    c.arrive(Pending(conn, ticket, _requests(n, env0), sampling or SamplingParams(), now))


def _clock(turn_s, idle, last_request=0.0):
    return StreamClock(streams=len(idle), idle=deque(idle), last_request=last_request, turn_s=list(turn_s))


def _sizes(decision):
    return None if decision.batch is None else [len(p.requests) for p in decision.batch]


def test_coalescer_waits_only_for_workers_due_within_the_budget():
    c = Coalescer()
    deadline = 10.05
    # a worker that answers in 10 ms per stream, answered at t=10: due at 10.01
    c.clocks = {"w": _clock([0.01, None], [(10.0, True)])}
    assert c.expects_before(deadline)
    # one that needs 100 ms is not worth waiting for: go now
    c.clocks = {"w": _clock([0.1, None], [(10.0, True)])}
    assert not c.expects_before(deadline)
    # a worker serves its streams one after another: the second is due 20 ms after the answers
    assert _clock([0.01, None], [(10.0, True), (10.0, True)]).expected() == pytest.approx([10.01, 10.02])
    # its third would come after the deadline: the first two are still worth waiting for
    c.clocks = {"w": _clock([0.02, None], [(10.0, True)] * 3)}
    assert c.expects_before(deadline)
    # a stream still resetting its envs, with no estimate yet: wait
    c.clocks = {"w": _clock([0.01, None], [(10.0, False)])}
    assert c.expects_before(deadline)
    # resets are learned apart from env steps
    c.clocks = {"w": _clock([0.01, 0.5], [(10.0, False)])}
    assert not c.expects_before(deadline)


def test_call_cost_model_fits_the_fixed_cost_only_when_call_sizes_differ():
    model = CallCostModel()
    assert model.fixed_s() is None  # no calls yet
    for n in (8, 32, 64, 128) * 3:
        model.add(n, 0.002 + 0.0001 * n)
    assert model.fixed_s() == pytest.approx(0.002)
    # every call about the same size, times that vary with other things (prompt
    # lengths on a GPU): the intercept would be noise, so the cost is unknown
    alike = CallCostModel()
    for n, t in [(128, 2.9), (112, 2.1), (128, 3.3), (120, 2.2), (128, 2.6)] * 4:
        alike.add(n, t)
    assert alike.fixed_s() is None


def test_the_fixed_cost_is_fitted_on_calls_of_about_the_batch_size():
    """A CPU engine: a call of 128 costs four times one of 32, a call of 16
    as much as one of 32. The line through 32 and 128 says a call costs
    nothing fixed; the calls near 32 say it is unknown (too alike in size)."""
    model = CallCostModel()
    model.add(128, 37.9)
    model.add(32, 9.25)
    assert model.fixed_s() == 0.0  # the line through both
    assert model.fixed_s(near=32) is None and model.fixed_s(near=128) is None
    model.add(16, 7.4)
    assert model.fixed_s(near=24) == pytest.approx(2 * 7.4 - 9.25)  # the line through 16 and 32


def test_a_rollout_after_a_larger_validation_is_still_one_call_per_turn():
    """The default job: a validation of 128 envs in one call, then training
    rollouts of 2 streams x 16 requests. Each turn of every rollout is one
    engine call, the third rollout included (the fit through the calls of 128
    and 32 gave a fixed cost of 0, and split it in two)."""
    c = Coalescer()  # the manager's defaults
    c.connect("w1"), c.connect("w2")
    now, calls = 0.0, []
    for size, seconds in ((64, 37.9), (16, 9.25), (16, 7.4)):
        rollout = c.announce(2)
        c.open("w1", 1, rollout, now), c.open("w2", 1, rollout, now)
        now += 0.2  # env resets
        _arrive(c, "w1", size, now)
        decision = c.decide(now)
        if decision.batch is None:  # the second worker resets its envs a little later
            assert decision.until is not None and decision.until > now + 0.05
            now += 0.05
            _arrive(c, "w2", size, now, env0=size)
            decision = c.decide(now)
        calls.append(_sizes(decision))
        c.call_done(sum(calls[-1]), seconds, now + seconds)
        now += seconds
        c.answered({conn: 1 for conn in ("w1", "w2")}, now)
        c.close("w1", 1), c.close("w2", 1)
        c.withdraw(rollout)
    assert calls == [[64, 64], [16, 16], [16, 16]]


def test_worker_time_per_stream_is_learned_from_its_requests():
    clock = _clock([None, None], [(1.0, False), (1.0, False)], last_request=0.0)
    clock.request_arrived(1.2)  # first stream reset in 0.2 s
    clock.request_arrived(1.5)  # the second, after the first: 0.3 s
    assert clock.turn_s[1] == pytest.approx(0.7 * 0.2 + 0.3 * 0.3)
    assert clock.turn_s[0] is None
    clock.idle.append((2.0, True))
    clock.request_arrived(2.05)  # stepped in 50 ms after its answer
    assert clock.turn_s[0] == pytest.approx(0.05)
    assert clock.expected() == []


def test_every_open_stream_queued_calls_at_once():
    c = Coalescer(coalesce_wait_s=0.0, max_coalesce_wait_s=5.0)
    c.connect("a"), c.connect("b")
    c.open("a", 1, None, 0.0), c.open("b", 1, None, 0.0)
    _arrive(c, "a", 3, 0.1)
    assert c.decide(0.1).until == pytest.approx(5.1)  # "b" has not asked yet: wait, within the budget
    _arrive(c, "b", 2, 0.2, env0=3)
    assert _sizes(c.decide(0.2)) == [3, 2]
    assert not c.pending and c.decide(0.2).batch is None and c.decide(0.2).until is None  # nothing to do


def test_a_stream_later_than_predicted_is_still_waited_for_within_the_budget():
    c = Coalescer(coalesce_wait_s=0.0)
    for n in (2, 4, 6, 8):  # a fitted fixed cost of 0.5 s per call of this size
        c.cost.add(n, 0.5 + 0.001 * n)
    assert c.budget_s() == pytest.approx(0.5)
    c.connect("w")
    c.open("w", 2, None, 0.0)
    # turn 0: the worker resets its two streams 1 ms apart
    _arrive(c, "w", 3, 0.001)
    _arrive(c, "w", 2, 0.002, env0=3)
    assert _sizes(c.decide(0.002)) == [3, 2]
    c.call_done(5, 0.505, 0.507)  # as the model says: 0.5 s + 1 ms a request
    c.answered({"w": 2}, 0.507)
    # turn 1: the first comes at once, the second is 100 ms late (predicted: 1 ms)
    _arrive(c, "w", 3, 0.508)
    assert c.decide(0.508).until == pytest.approx(1.008)  # still waited for: due within the budget
    assert c.decide(0.55).batch is None
    _arrive(c, "w", 2, 0.608, env0=3)
    assert _sizes(c.decide(0.608)) == [3, 2]  # one call, not two


def test_a_stream_due_after_the_budget_is_not_waited_for():
    c = Coalescer(coalesce_wait_s=0.0)
    for n in (4, 8, 12, 16):  # fixed cost 10 ms per call of this size
        c.cost.add(n, 0.01 + 0.001 * n)
    c.connect("fast"), c.connect("slow")
    c.clocks["slow"] = _clock([1.0, 1.0], [(0.0, True)], last_request=0.0)  # one stream, back in 1 s
    c.open("fast", 1, None, 0.0)
    _arrive(c, "fast", 4, 0.0)
    assert _sizes(c.decide(0.0)) == [4]  # the slow worker would cost more than a call of its own


def test_an_engine_of_unknown_cost_waits_for_every_stream_expected():
    """Before the manager knows what a call costs, it waits (up to
    max_coalesce_wait_s) for the streams still resetting, instead of sending
    the first arrivals alone: on a GPU a split call costs a whole decode."""
    c = Coalescer(coalesce_wait_s=0.0, max_coalesce_wait_s=5.0)
    assert c.budget_s() == 5.0
    c.connect("w")
    c.open("w", 2, None, 0.0)
    _arrive(c, "w", 3, 0.0)
    assert c.decide(0.3).batch is None  # the second micro-batch is still resetting its envs
    _arrive(c, "w", 2, 0.3, env0=3)
    assert _sizes(c.decide(0.3)) == [3, 2]
    # the budget ends the wait: a stream that never asks does not hold the call longer
    c.answered({"w": 2}, 0.4)
    _arrive(c, "w", 1, 0.5)
    assert c.decide(0.5).until == pytest.approx(5.5)
    assert _sizes(c.decide(5.5)) == [1]


def test_streams_announced_by_the_driver_are_waited_for_before_their_worker_connects():
    c = Coalescer(coalesce_wait_s=0.0, max_coalesce_wait_s=5.0)
    rollout = c.announce(2)  # two shards of one stream each were dispatched
    c.connect("early")
    c.open("early", 1, rollout, 0.0)
    _arrive(c, "early", 3, 0.0)
    assert c.decide(0.2).batch is None  # the other shard's worker has not even connected
    c.connect("late")
    c.open("late", 1, rollout, 0.3)
    _arrive(c, "late", 2, 0.3, env0=3)
    assert _sizes(c.decide(0.3)) == [3, 2]
    # once the rollout is over, nothing of it is expected any more
    c.close("early", 1), c.close("late", 1)
    c.withdraw(rollout)
    assert c.announced == {} and c.open_streams == 0
    _arrive(c, "early", 1, 1.0)
    assert _sizes(c.decide(1.0)) == [1]


def test_withdraw_releases_the_open_streams_of_a_shard_given_up_on():
    c = Coalescer(coalesce_wait_s=0.0, max_coalesce_wait_s=5.0)
    given_up, current = c.announce(1), c.announce(1)
    c.connect("stuck"), c.connect("w")
    c.open("stuck", 1, given_up, 0.0)  # its worker sleeps in an env past the rollout's timeout
    c.open("w", 1, current, 0.0)
    c.withdraw(given_up)
    assert c.open_streams == 1
    _arrive(c, "w", 2, 1.0)
    assert _sizes(c.decide(1.0)) == [2]  # not held for the stuck stream


def test_a_batch_keeps_to_one_sampling_and_to_max_batch_size():
    c = Coalescer(max_batch_size=5, coalesce_wait_s=0.0, max_coalesce_wait_s=0.0)
    c.connect("w")
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    _arrive(c, "w", 3, 0.0, ticket=1, sampling=greedy)
    _arrive(c, "w", 2, 0.0, ticket=2, sampling=hot)
    _arrive(c, "w", 2, 0.0, ticket=3, sampling=greedy)
    _arrive(c, "w", 1, 0.0, ticket=4, sampling=greedy)
    first = c.decide(0.0).batch
    assert [p.ticket for p in first] == [1, 3]  # ticket 4 would make 6 > 5
    assert [p.ticket for p in c.decide(0.0).batch] == [2]
    assert [p.ticket for p in c.decide(0.0).batch] == [4]


def test_a_disconnected_worker_takes_its_streams_and_requests_with_it():
    c = Coalescer(coalesce_wait_s=0.0, max_coalesce_wait_s=5.0)
    c.connect("gone"), c.connect("w")
    c.open("gone", 2, None, 0.0), c.open("w", 1, None, 0.0)
    _arrive(c, "gone", 2, 0.0)
    c.disconnect("gone")
    assert c.open_streams == 1 and not c.pending
    _arrive(c, "w", 1, 0.1)
    assert _sizes(c.decide(0.1)) == [1]


@pytest.mark.parametrize("kw,key", [({"max_batch_size": 0}, "max_batch_size"),
                                    ({"coalesce_wait_s": -1}, "coalesce_wait_s")])
def test_bad_settings_name_the_parameter(kw, key):
    """The config reader refuses these first, naming agent_proxy's key; a
    coalescer built by hand names its own parameter."""
    with pytest.raises(ValueError, match=f"^{key} must be"):
        Coalescer(**kw)


def test_a_stream_opened_unannounced_leaves_the_announcement_waited_for():
    """A gateway call opens a stream under its worker's rollout tag that the rollout did not
    announce: the chunks still to connect are waited for as before."""
    c = Coalescer(coalesce_wait_s=0.0, max_coalesce_wait_s=5.0)
    rollout = c.announce(1)
    c.connect("gateway")
    c.open("gateway", 1, rollout, 0.0, announced=False)
    assert c.announced == {rollout: 1} and c.open_streams == 1
    _arrive(c, "gateway", 1, 0.0)
    assert c.decide(0.2).batch is None  # the announced chunk's worker has not connected
    c.connect("late")
    c.open("late", 1, rollout, 0.3)
    _arrive(c, "late", 2, 0.3, env0=3)
    assert _sizes(c.decide(0.3)) == [1, 2]

"""ScriptedStreamingEngine: the scripted policy timed as an engine that batches
continuously (engine.continuous_batching): the same answers, each back at the
decode step where its request ends."""

from __future__ import annotations

import threading
import time

import pytest

from ragen.llm import make_engine
from ragen.llm.scripted import DecodeModel, ScriptedEngine, ScriptedStreamingEngine
from ragen.llm.types import SamplingParams, StreamingEngine

from tests.test_llm_scripted import requests

SAMPLING = SamplingParams(seed=3)


def streaming(**decode) -> ScriptedStreamingEngine:
    return make_engine({"name": "scripted", "malformed_rate": 0.2,
                        "continuous_batching": {"step_s": 0.001, "tokens_median": 12, "tokens_sigma": 1.0, **decode}})


def finish_order(engine, reqs) -> tuple[list, list[int]]:
    """The futures of ``reqs``, and the request indexes in the order they were resolved."""
    order: list[int] = []
    futures = engine.submit(reqs, SAMPLING)
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _, i=i: order.append(i))
    for f in futures:
        f.result(timeout=30)
    return futures, order


@pytest.mark.timeout(60)
def test_the_same_answers_as_the_scripted_engine():
    reqs = requests(12)
    engine = streaming()
    try:
        assert isinstance(engine, StreamingEngine) and engine.streams and not ScriptedEngine.streams
        want = ScriptedEngine(malformed_rate=0.2).generate(reqs, SAMPLING)
        futures, _ = finish_order(engine, reqs)
        for got in ([f.result() for f in futures], engine.generate(reqs, SAMPLING)):
            assert [c.to_dict() for c in got] == [c.to_dict() for c in want]
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_the_answer_continues_after_its_prefix():
    reqs = requests(12, answer_prefix="<think>")
    engine = streaming()
    try:
        want = ScriptedEngine(malformed_rate=0.2).generate(reqs, SAMPLING)
        assert any(not c.text.startswith("<think>") and "</think>" in c.text for c in want)
        assert [c.to_dict() for c in engine.generate(reqs, SAMPLING)] == [c.to_dict() for c in want]
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_each_answer_returns_at_the_step_its_request_ends():
    reqs = requests(16)
    engine = streaming()
    try:
        steps = [engine.decode_steps(r, SAMPLING) for r in reqs]
        assert len(set(steps)) > 4  # lengths drawn per request, not one for all
        _, order = finish_order(engine, reqs)
        assert [steps[i] for i in order] == sorted(steps)  # the shortest first, none held for the longest
        # all joined at one step boundary: the engine ran as many steps as the longest request, and
        # each request was in the running batch for exactly its own steps
        assert engine.steps == max(steps) and engine.running_sum == sum(steps)
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_a_request_that_arrives_late_joins_the_running_batch():
    engine = streaming(step_s=0.005, tokens_median=40, tokens_sigma=1.5, tokens_max=400)
    try:
        pool = requests(64)
        steps = {r.env_id: engine.decode_steps(r, SAMPLING) for r in pool}
        long = max(pool, key=lambda r: steps[r.env_id])
        short = min(pool, key=lambda r: steps[r.env_id])
        assert steps[long.env_id] >= 10 * steps[short.env_id]
        first = engine.submit([long], SAMPLING)[0]
        time.sleep(steps[long.env_id] * 0.005 / 4)  # a quarter of the way through the long one
        assert not first.done()
        second = engine.submit([short], SAMPLING)[0]
        second.result(timeout=30)
        assert not first.done()  # the short one came back while the long one still ran
        first.result(timeout=30)
        assert engine.steps == steps[long.env_id]  # no step was added for it: it joined the running batch
        assert engine.running_sum == steps[long.env_id] + steps[short.env_id]
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_lengths_are_a_pure_function_of_the_request():
    reqs = requests(20)
    a, b = streaming(), streaming()
    try:
        assert [a.decode_steps(r, SAMPLING) for r in reqs] == [b.decode_steps(r, SAMPLING) for r in reversed(reqs)][::-1]
        assert [a.decode_steps(r, SAMPLING) for r in reqs] != [a.decode_steps(r, SamplingParams(seed=4)) for r in reqs]
    finally:
        a.close(), b.close()


def test_the_decode_model():
    model = DecodeModel(step_s=0.015, step_per_request_s=0.0001, tokens_median=100, tokens_sigma=1.0,
                        tokens_max=2048, time_scale=0.1)
    assert model.step_cost(0) == pytest.approx(0.0015) and model.step_cost(100) == pytest.approx(0.0025)
    draws = sorted(model.tokens(seed) for seed in range(2001))
    assert 80 <= draws[1000] <= 120  # the median
    assert 700 <= draws[1980] <= 1400  # p99 about 10x the median, as a lognormal of sigma 1 has
    assert min(draws) >= 1 and max(draws) <= 2048


@pytest.mark.timeout(60)
def test_close_fails_what_is_still_running_and_stops_the_engine():
    engine = streaming(tokens_median=5000, tokens_sigma=0.0, tokens_max=5000)
    future = engine.submit(requests(1), SAMPLING)[0]
    engine.close()
    with pytest.raises(RuntimeError, match="closed before this request was answered"):
        future.result(timeout=5)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(requests(1), SAMPLING)
    assert not any(t.name == "ragen-scripted-decode" for t in threading.enumerate())  # its thread ended


@pytest.mark.parametrize("options, message", [
    ({"continuous_batching": {"step_s": 0}}, "engine.continuous_batching.step_s"),
    ({"continuous_batching": {"tokens_median": -1}}, "engine.continuous_batching.tokens_median"),
    ({"continuous_batching": {"steps": 3}}, "engine.continuous_batching.steps is not a known key"),
    ({"continuous_batching": {}, "base_s": 0.1}, "engine.base_s and engine.per_token_s time whole calls"),
])
def test_bad_settings_name_the_key(options, message):
    with pytest.raises(ValueError, match=message):
        make_engine({"name": "scripted", **options})


@pytest.mark.timeout(60)
def test_a_streaming_request_is_told_its_answer_in_parts_before_its_future_resolves():
    """``submit_reporting``: each request with ``stream_tokens`` is told its answer in parts at its
    share of its decode steps, every part before its future resolves; the parts join to its ids."""
    from dataclasses import replace

    engine = streaming(tokens_median=40, tokens_sigma=0.0)
    try:
        reqs = [replace(r, stream_tokens=i == 0) for i, r in enumerate(requests(2))]
        events = []
        futures = engine.submit_reporting(reqs, SAMPLING, lambda new: events.append(dict(new)))
        futures[0].add_done_callback(lambda _: events.append("done"))
        got = [f.result(timeout=30) for f in futures]
        assert events[-1] == "done" and len(events) > 2
        assert all(set(report) == {0} for report in events[:-1])  # the other request is never told
        assert [i for report in events[:-1] for i in report[0]] == got[0].response_token_ids
        assert [c.response_token_ids for c in got] == [c.response_token_ids for c in engine.generate(reqs, SAMPLING)]
    finally:
        engine.close()

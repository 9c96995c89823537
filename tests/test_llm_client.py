"""The scheduler's client: streams that submit request lists for a future, over a transport that counts them."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from ragen.llm.scripted import ScriptedEngine, ScriptedStreamingEngine
from ragen.llm.types import EngineError, GenerationRequest, SamplingParams
from ragen.serving import DirectClient, LLMClient, StreamingDirectClient

pytestmark = pytest.mark.timeout(60)

SAMPLING = SamplingParams()


def _request(env_id: int = 0) -> GenerationRequest:
    return GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down"}], env_id=env_id)


class CountingTransport(DirectClient):
    """A direct transport that records the stream counts its client sends."""

    def __init__(self, engine=None) -> None:
        super().__init__(engine or ScriptedEngine())
        self.opened = self.closed = self.flushes = 0

    def open_streams(self, n: int) -> None:
        self.opened += n

    def close_stream(self, hold: bool = False) -> None:
        self.closed += 1

    def flush(self) -> None:
        self.flushes += 1


def test_streams_submit_for_futures_answered_in_order():
    transport = CountingTransport()
    client = LLMClient(transport)
    first, second = client.open(2)
    assert transport.opened == 2 and client.open_streams == 2
    future = first.submit([_request(0), _request(1)], SAMPLING)
    other = second.submit([_request(2)], SAMPLING)
    assert not future.done() and not other.done()
    assert client.wait(block=False) == []  # a direct transport answers only when waited for
    assert client.wait() == [first]
    assert [c.text for c in future.result()] and len(future.result()) == 2 and first.error() is None
    assert client.wait() == [second] and len(other.result()) == 1
    assert client.wait() == []  # nothing in flight: no endless wait


def test_a_stream_has_one_request_list_in_flight_and_none_once_closed():
    client = LLMClient(CountingTransport())
    (stream,) = client.open(1)
    stream.submit([_request()], SAMPLING)
    with pytest.raises(RuntimeError, match="one request list at a time"):
        stream.submit([_request()], SAMPLING)
    client.wait()
    stream.close()
    with pytest.raises(RuntimeError, match="none once closed"):
        stream.submit([_request()], SAMPLING)


def test_the_client_counts_streams_and_closes_those_left_open():
    transport = CountingTransport()
    client = LLMClient(transport)
    streams = client.open(3)
    chunk = client.open(2, opened=1)  # a chunk's first stream is opened by the manager as it hands it out
    assert transport.opened == 4 and client.open_streams == 5
    streams[0].close()
    streams[0].close()  # closing twice closes once
    assert transport.closed == 1 and client.open_streams == 4
    in_flight = chunk[1].submit([_request()], SAMPLING)
    client.close()
    assert transport.closed == 5 and client.open_streams == 0 and transport.flushes == 1
    assert all(s.closed for s in streams + chunk) and in_flight.cancelled()
    chunk[1].close()  # a handle closed by the client: closing it again sends nothing
    assert transport.closed == 5 and client.open_streams == 0
    with pytest.raises(RuntimeError, match="none once closed"):
        chunk[1].submit([_request()], SAMPLING)


def test_cancel_drops_the_request_and_cancels_its_future():
    transport = CountingTransport()
    client = LLMClient(transport)
    (stream,) = client.open(1)
    future = stream.submit([_request(), _request()], SAMPLING)
    stream.cancel()
    assert future.cancelled() and not transport._queue
    assert client.wait() == []
    stream.submit([_request()], SAMPLING)  # the stream goes on with a new request list
    assert client.wait() == [stream]


def test_an_engine_error_for_a_request_is_set_on_its_stream_future():
    class FailingStreaming(ScriptedStreamingEngine):
        def submit(self, requests, sampling):
            if requests[0].env_id != 1:
                return super().submit(requests, sampling)
            failed = Future()
            failed.set_exception(RuntimeError("the engine broke on env 1"))
            return [failed]

    engine = FailingStreaming()
    try:
        client = LLMClient(StreamingDirectClient(engine))
        good, bad = client.open(2)
        good.submit([_request(0)], SAMPLING)
        bad_future = bad.submit([_request(1)], SAMPLING)
        answered = []
        while len(answered) < 2:
            answered += client.wait(timeout=10)
        assert set(answered) == {good, bad}
        assert isinstance(bad.error(), EngineError) and "env 1" in str(bad.error())
        with pytest.raises(EngineError):
            bad_future.result()
        assert good.error() is None and good.future.result()[0].text
    finally:
        engine.close()

"""What the scheduler talks to for generations: ``LLMClient`` and its ``Stream``s.

A stream is a micro-batch of episodes with one request list in flight. The
scheduler ``open``s the streams it plays; each ``Stream`` has only
``submit(requests) -> future`` (of the requests' completions), ``cancel``
(what it has in flight) and ``close`` (it sends no more). ``LLMClient.wait``
resolves the futures as their answers arrive and names the streams answered,
in that order. The client counts the open streams for the coalescer behind its
``transport.Transport`` (a worker's ``SharedLLMClient``, or an engine in the
caller's process), and ``close`` closes those its user left open.
"""

from __future__ import annotations

from concurrent.futures import Future

from ragen.llm.types import Completion, EngineError, GenerationRequest, SamplingParams
from ragen.serving.transport import Transport


class Stream:
    """One micro-batch's requests through an ``LLMClient``: at most one request list in flight."""

    __slots__ = ("_client", "ticket", "future", "size", "closed")

    def __init__(self, client: LLMClient) -> None:
        self._client = client
        self.ticket: int | None = None  # of the request list in flight
        self.future: Future | None = None  # of the last request list's completions
        self.size = 0  # requests in the last request list
        self.closed = False

    def submit(self, requests: list[GenerationRequest], sampling: SamplingParams,
               hold: bool = False) -> Future:
        """A future of the requests' ``Completion``s, in order. ``wire.MessageTooLarge``, with nothing
        sent, when the transport cannot carry them. ``hold``: the message may wait (briefly)
        to share a frame with others."""
        return self._client._submit(self, requests, sampling, hold)

    def cancel(self) -> None:
        """Stop waiting for the request list in flight (the engine drops what it has not answered)."""
        self._client._cancel(self)

    def close(self, hold: bool = False) -> None:
        """The stream sends no more requests (once; a closed stream stays closed)."""
        self._client._close(self, hold)

    def error(self) -> EngineError | None:
        """What the engine raised for the answered request list; None when it answered."""
        if self.future is None or not self.future.done():
            raise RuntimeError("the stream has no answered request list")
        return self.future.exception()  # type: ignore[return-value]  # wait() sets only EngineErrors


class LLMClient:
    """Streams and futures over a ``Transport``. ``streams``: its engine answers each
    request as soon as it is done."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.streams = transport.streams
        self._open: dict[Stream, None] = {}  # opened and not closed yet, in order
        self._flight: dict[int, Stream] = {}  # by ticket

    @property
    def open_streams(self) -> int:
        """Streams opened and not closed yet."""
        return len(self._open)

    def open(self, n: int, opened: int = 0) -> list[Stream]:
        """``n`` new streams, the first ``opened`` of them already counted by the manager
        (a chunk of the rollout's queue opens its first stream as it is handed out)."""
        if n > opened:
            self.transport.open_streams(n - opened)
        streams = [Stream(self) for _ in range(n)]
        self._open.update(dict.fromkeys(streams))
        return streams

    def _submit(self, stream: Stream, requests: list[GenerationRequest], sampling: SamplingParams,
                hold: bool) -> Future:
        if stream.closed or stream.ticket is not None:
            raise RuntimeError("a stream submits one request list at a time, and none once closed")
        ticket = self.transport.submit(requests, sampling, hold=hold)
        stream.ticket, stream.future, stream.size = ticket, Future(), len(requests)
        self._flight[ticket] = stream
        return stream.future

    def _cancel(self, stream: Stream) -> None:
        if stream.ticket is not None and self._flight.pop(stream.ticket, None) is stream:
            self.transport.abandon(stream.ticket)
            stream.future.cancel()
        stream.ticket = None

    def _close(self, stream: Stream, hold: bool) -> None:
        if stream.closed:
            return
        self._cancel(stream)
        stream.closed = True
        del self._open[stream]
        self.transport.close_stream(hold)

    def wait(self, timeout: float | None = None, block: bool = True) -> list[Stream]:
        """The streams whose answers arrived, in the order they came: the next one, waited
        for up to ``timeout`` seconds (None: no limit; a transport that answers in the
        caller's thread makes its answer whatever the limit), and every other one already
        here. ``block=False``: only those already here. Empty when the wait ran out, or
        nothing is in flight. An ``EngineError`` the engine raised for a stream's request
        list is set on its future; any other (the transport failed) is raised."""
        got: list[Stream] = []
        while self._flight and ((block and not got) or self.transport.ready()):
            try:
                answer = self.transport.wait_any(timeout=None if got else timeout)
            except EngineError as exc:
                stream = self._flight.pop(exc.ticket, None) if exc.ticket is not None else None
                if stream is None:
                    raise
                stream.ticket = None
                stream.future.set_exception(exc)
                got.append(stream)
                continue
            if answer is None:
                break
            ticket, completions = answer
            stream = self._flight.pop(ticket)
            if len(completions) != stream.size:
                raise RuntimeError(f"engine answered {len(completions)} completions for {stream.size} requests")
            stream.ticket = None
            stream.future.set_result(completions)
            got.append(stream)
        return got

    def close(self) -> None:
        """Every stream left open closes (what it has in flight cancelled), and what was held back is sent."""
        for stream in list(self._open):
            self._close(stream, hold=True)
        self.transport.flush()

    def reset(self) -> None:
        """Forget the requests in flight (after a failure: their answers would be stale)."""
        self._flight.clear()
        self.transport.reset()

"""SharedLLMInferenceManager: the one engine in the driver, served to every worker.

The manager owns the engine (the one the trainer updates) and a lock around
every engine call (``engine_lock``; the trainer takes it to swap weights),
whose waits for requests are bounded by twice ``request_timeout_s``
(``EngineGate.for_requests``). It
listens on a socket (``address``), serves each peer on a connection of its
own (``connections``), and runs one batcher thread that turns the requests of
all workers into engine calls as the ``Coalescer`` decides. An engine that
fails, or answers with something other than one plain-data ``Completion`` per
request, gets its batch (or only the request lists it answered badly)
answered with errors, and the batcher goes on serving. The driver
``announce``s how many streams the work it dispatched will open, with that
work's ``Hooks``; the coalescer waits for those streams before they open.
Work that has what it needs before its end (an over-sampled rollout with
enough groups) is ``abort``ed: its requests are answered ``aborted``.
Answers are told to the observers just before they are sent, so a worker
cannot end its work before its answers are counted. An engine that batches
continuously (``Engine.streams``) gets each request list as it arrives,
through the ``Streamer``, instead of the coalescer. The requests that ask for
their ids as they are sampled (``stream_tokens``) get them as partials
(``partials``) during the engine call that samples them.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

from ragen.llm.types import ABORTED, Completion, Engine, GenerationRequest, SamplingParams
from ragen.serving import messages, wire
from ragen.serving.address import check_listen_address, is_loopback
from ragen.serving.coalescer import Coalescer, Pending
from ragen.serving.connections import Connection, Connections
from ragen.serving.gate import EngineGate
from ragen.serving.hooks import Hooks, Observer, Reply
from ragen.serving.partials import PartialSink, partial_sink
from ragen.serving.shared_client import SharedLLMClient
from ragen.serving.stats import ManagerStats
from ragen.serving.streamer import Streamer

__all__ = ["Hooks", "ManagerStats", "Observer", "Reply", "SharedLLMInferenceManager", "check_listen_address"]

logger = logging.getLogger(__name__)


class SharedLLMInferenceManager(Connections):
    """The driver's engine, served to every worker over authenticated
    connections, with the requests of all of them coalesced into engine calls."""

    def __init__(
        self,
        engine: Engine,
        max_batch_size: int = 256,
        coalesce_wait_s: float = 0.0005,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        handshake_timeout_s: float = 5.0,
        max_coalesce_wait_s: float = 1.0,
        max_pending_handshakes: int = 64,
        request_timeout_s: float | None = None,
        max_send_queue_bytes: int | None = None,
    ) -> None:
        self.coalescer = Coalescer(max_batch_size, coalesce_wait_s, max_coalesce_wait_s)
        check_listen_address(host, port)
        if max_pending_handshakes < 1:
            raise ValueError(f"max_pending_handshakes must be >= 1, got {max_pending_handshakes}")
        self.engine = engine
        self.engine_lock = EngineGate.for_requests(request_timeout_s)
        self.max_batch_size = self.coalescer.max_batch_size
        self.max_message_bytes = wire.check_max_message_bytes(max_message_bytes)
        # What waits to be sent to one peer that does not read, before it is
        # dropped (Connection.send_frame). By default room for a frame of the
        # largest size being sent and one more: a worker reads whenever it
        # waits for an answer, so what it leaves unread stays far below that.
        if max_send_queue_bytes is None:
            max_send_queue_bytes = 2 * max_message_bytes
        if isinstance(max_send_queue_bytes, bool) or not isinstance(max_send_queue_bytes, int) or \
                max_send_queue_bytes < 1:
            raise ValueError(f"max_send_queue_bytes must be a positive integer, got {max_send_queue_bytes!r}")
        self.max_send_queue_bytes = max_send_queue_bytes
        self.handshake_timeout_s = handshake_timeout_s
        # A thread per connection is fine for workers, not for any number of
        # peers that connect and say nothing. Every peer is accepted at once (a
        # worker never waits behind idle peers in the listen queue), and at
        # most this many are in their handshake: a new one closes the oldest,
        # so sockets and threads stay bounded (_accept_loop, _evict).
        self.max_pending_handshakes = max_pending_handshakes
        self._pending: OrderedDict[Connection, None] = OrderedDict()  # oldest first
        self._pending_lock = threading.Lock()
        self._evicted = 0  # connections closed in their handshake to make room (accept thread only)
        self.stats = ManagerStats()
        self._key = secrets.token_bytes(32)
        self._cond = threading.Condition()  # guards the coalescer and _conns
        self._conns: set[Connection] = set()
        self._closed = False
        # by announced tag; written under _cond, so a call's handler and withdraw never interleave
        self._hooks_lock = threading.Lock()
        self._hooks: dict[int, Hooks] = {}
        self._aborted: set[int] = set()  # tags whose requests are answered ABORTED (abort)
        # an engine that batches continuously gets each request list as it arrives
        self.streamer = Streamer(engine, self.engine_lock, self.stats, self._send_answers, request_timeout_s) \
            if getattr(engine, "streams", False) else None
        self._listen(host, port)

    def _listen(self, host: str, port: int) -> None:
        """Binds ``host:port`` and starts the accept and batcher threads."""
        self._listener = socket.create_server((host, port))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._threads = [
            threading.Thread(target=self._accept_loop, name="ragen-llm-accept", daemon=True),
            threading.Thread(target=self._batch_loop, name="ragen-llm-batcher", daemon=True),
        ]
        for t in self._threads:
            t.start()
        logger.info("shared LLM manager listening on %s:%d", *self.address)
        if not is_loopback(self.address[0]):
            # The key keeps strangers from being served, not from connecting,
            # holding handshake slots or reading the hello.
            logger.warning("the shared LLM manager listens on %s:%d, beyond this machine (llm_server.host): "
                           "firewall port %d so that only the machines of the rollout workers reach it",
                           self.address[0], self.address[1], self.address[1])

    def __repr__(self) -> str:  # never shows the key
        return f"SharedLLMInferenceManager(address={self.address}, engine={type(self.engine).__name__})"

    def client(self, timeout_s: float | None = None) -> SharedLLMClient:
        return SharedLLMClient(address=self.address, authkey=self._key, timeout_s=timeout_s,
                               max_message_bytes=self.max_message_bytes, streams=self.streamer is not None)

    def _arrive(self, pending: Pending) -> None:
        if pending.conn.tag in self._aborted:
            self._answer_aborted([pending])
            return
        if self.streamer is not None:
            self.streamer.submit(pending)
            return
        with self._cond:
            self.coalescer.arrive(pending)
            self._cond.notify_all()

    def _cancel(self, conn: Connection, ticket: int) -> None:
        if self.streamer is not None:
            self.streamer.cancel(conn, ticket)
        # a batch engine's call answers it anyway; the client drops the answer

    def _send_answers(self, answers: dict[Connection, list[dict[str, Any]]]) -> None:
        """The streamer's answers, told to the observers, then sent."""
        self._observe_answers(answers)
        self._reply(answers)

    def announce(self, n_streams: int, hooks: Hooks | None = None) -> int:
        """The driver dispatched work whose workers will open ``n_streams``
        streams: the coalescer waits for them (within its budget) before they
        connect, so a worker that starts late is not left out of the first
        call. ``hooks``: the calls, notes and observer of that work. Returns
        its tag, for ``SharedLLMClient.tag`` and ``withdraw``."""
        with self._cond:
            tag = self.coalescer.announce(n_streams)
            if hooks is not None:
                with self._hooks_lock:
                    self._hooks[tag] = hooks
            return tag

    def abort(self, tag: int) -> None:
        """The work of ``tag`` has what it needs (an over-sampled rollout has enough groups
        done): its request lists queued or in flight are answered ``ABORTED`` now (the engine
        drops what it can), and those it sends later at once, until it is withdrawn. A request
        list already in a batch engine's call is answered as usual."""
        with self._cond:
            self._aborted.add(tag)
            taken = self.coalescer.take_where(lambda p: p.conn.tag == tag)
        if self.streamer is not None:
            taken += self.streamer.take_where(lambda conn: conn.tag == tag)
        self._answer_aborted(taken)

    def _answer_aborted(self, pending: list[Pending]) -> None:
        """Each request list answered with empty completions whose finish reason is ``ABORTED``
        (not told to the observers: no request was answered)."""
        answers: dict[Connection, list[dict[str, Any]]] = {}
        version = self.engine.policy_version
        for p in pending:
            completions = [Completion(text="", prompt_token_ids=[], response_token_ids=[], finish_reason=ABORTED,
                                      policy_version=version, env_id=r.env_id, turn=r.turn) for r in p.requests]
            answers.setdefault(p.conn, []).append(messages.completions_answer(p.ticket, p.transit_in, completions,
                                                                              p.requests))
        if answers:
            self._reply(answers)

    def withdraw(self, tag: int) -> None:
        """The work of ``tag`` ended (or failed): expect none of its streams,
        and drop its hooks (a later call under it is answered None). Streams
        still open under it are work the driver gave up on (past its timeout,
        in a thread or a Dask task that cannot be stopped): waiting for them
        would hold every later engine call to its full wait budget. Their
        connection may still send requests; they are answered as usual."""
        with self._cond:
            self.coalescer.withdraw(tag)
            self._aborted.discard(tag)
            with self._hooks_lock:
                self._hooks.pop(tag, None)
            self._cond.notify_all()

    @property
    def hooked(self) -> tuple[int, ...]:
        """The tags whose hooks are in place (announced and not withdrawn)."""
        with self._hooks_lock:
            return tuple(self._hooks)

    def _observe(self, answered: dict[int | None, int], engine_call: int | None = None) -> None:
        """The observers: the size of the engine call starting, and the
        requests answered by tag."""
        with self._hooks_lock:
            observers = [(tag, h.observer) for tag, h in self._hooks.items() if h.observer is not None]
        for tag, observer in observers:
            try:
                if engine_call is not None:
                    observer.engine_call(engine_call)
                n = answered.get(tag, 0)
                if n:
                    observer.answered(n)
            except Exception:  # an observer never fails the manager
                logger.debug("the observer of tag %s failed", tag, exc_info=True)

    @property
    def open_streams(self) -> int:
        """Streams open over every connection (what the coalescer waits for)."""
        with self._cond:
            return self.coalescer.open_streams

    @property
    def announced(self) -> dict[int, int]:
        """Streams announced and not opened yet, by tag."""
        with self._cond:
            return dict(self.coalescer.announced)

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def _next_batch(self) -> list[Pending] | None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                decision = self.coalescer.decide(now)
                if decision.batch is not None:
                    held = now - max(decision.batch[0].arrived, self.coalescer.engine_free_at)
                    self.stats.add(coalesce_wait_s=max(0.0, held), streams_at_calls=self.coalescer.open_streams,
                                   calls_started=1)
                    return decision.batch
                # no bound needed: every change the decision depends on (a
                # request, a stream, a connection, close()) notifies
                self._cond.wait(None if decision.until is None else decision.until - time.monotonic())
            return None

    def _batch_loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                size = min(self.max_batch_size, sum(len(p.requests) for p in batch))
                self._observe({}, engine_call=size)  # the call about to run: shown while it runs
                answers = self._answers(batch)
                self._observe_answers(answers)  # before the reply: counted before a worker can end its work
                self._reply(answers)
            except Exception as exc:  # a bug here must not end the thread: every later request would wait forever
                logger.exception("the batcher failed on %d requests; answering them with an error", len(batch))
                answers: dict[Connection, list[dict[str, Any]]] = {}
                for p in batch:
                    answers.setdefault(p.conn, []).append(
                        {"ticket": p.ticket, "error": f"the LLM manager failed: {type(exc).__name__}: {exc}"})
                try:
                    self._reply(answers)
                except Exception:  # the batcher goes on whatever the reply failed with
                    logger.exception("could not answer %d requests", len(batch))

    def _answers(self, batch: list[Pending]) -> dict[Connection, list[dict[str, Any]]]:
        """One engine call for ``batch``: each request list's completions, or
        an error that says what was wrong with them."""
        requests = [r for p in batch for r in p.requests]
        answers: dict[Connection, list[dict[str, Any]]] = {}
        try:
            if logger.isEnabledFor(logging.DEBUG):
                turns = sorted({r.turn for r in requests})
                logger.debug("engine call: %d requests from %d streams, turns %s, %.4f s after the first arrived",
                             len(requests), len(batch), turns, time.monotonic() - batch[0].arrived)
            completions = self.generate(requests, batch[0].sampling, partial_sink(batch, self.stats))
        except Exception as exc:  # the engine failed: every waiting client hears it
            logger.exception("engine call failed for %d requests", len(requests))
            for p in batch:
                answers.setdefault(p.conn, []).append(messages.error_answer(p.ticket, exc))
            return answers
        i = 0
        for p in batch:
            part = completions[i: i + len(p.requests)]
            i += len(p.requests)
            answer = messages.completions_answer(p.ticket, p.transit_in, part, p.requests)
            answers.setdefault(p.conn, []).append(answer)
        return answers

    def _observe_answers(self, answers: dict[Connection, list[dict[str, Any]]]) -> None:
        """Tell the observers of one engine call the requests answered with
        completions, by the tag of their connection."""
        counts: dict[int | None, int] = {}
        for conn, conn_answers in answers.items():
            n = sum(len(a.get("completions", ())) for a in conn_answers)
            counts[conn.tag] = counts.get(conn.tag, 0) + n
        self._observe(counts)

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams,
                 on_tokens: PartialSink | None = None) -> list[Completion]:
        """One engine call (in chunks of ``max_batch_size``) under the engine lock; ``on_tokens``:
        where the new ids of the requests that stream go (None: nobody streams)."""
        out: list[Completion] = []
        with self.engine_lock:
            start = time.monotonic()
            t0 = time.perf_counter()
            sizes = []
            for i in range(0, len(requests), self.max_batch_size):
                chunk = requests[i: i + self.max_batch_size]
                got = self.engine.generate(chunk, sampling) if on_tokens is None else \
                    self.engine.generate_reporting(chunk, sampling, on_tokens.shifted(i))
                if not isinstance(got, (list, tuple)):
                    raise TypeError(f"the engine returned {type(got).__name__}, not a list of completions")
                if len(got) != len(chunk):
                    raise RuntimeError(f"engine returned {len(got)} completions for {len(chunk)} requests")
                out += got
                sizes.append(len(chunk))
            elapsed = time.perf_counter() - t0
            free_at = time.monotonic()
            with self._cond:
                self.coalescer.call_done(len(requests), elapsed, free_at)
            self.stats.record_call(sizes, (start, free_at), elapsed)
        return out

    def _reply(self, answers: dict[Connection, list[dict[str, Any]]]) -> None:
        """One frame per connection, all encoded before any is sent: a woken
        worker takes a core at once, and the other workers' answers must not
        wait behind it."""
        frames = [(conn, self._fitting(messages.answers_frame(a), a), len(a)) for conn, a in answers.items()
                  if conn.alive]
        with self._cond:
            self.coalescer.answered({conn: n for conn, _, n in frames}, time.monotonic())
        for conn, data, _ in frames:
            try:
                self.stats.add(bytes_out=conn.send_frame(data))
            except OSError:
                pass  # the client left; its cleanup runs in its own thread

    def _fitting(self, data: bytes, answers: list[dict[str, Any]]) -> bytes:
        """``data``, or, when it is longer than a client reads (the client would
        drop the connection and its other answers with it), the same answers
        with the largest turned into errors until the rest fit."""
        size = len(data) - wire.HEADER_BYTES
        if size <= self.max_message_bytes:
            return data
        sizes = [len(messages.answers_frame([a])) for a in answers]
        answers = list(answers)
        for i in sorted(range(len(answers)), key=sizes.__getitem__, reverse=True):
            logger.error("the answer to ticket %s from %d bytes of answers exceeds max_message_bytes=%d; answering "
                         "it with an error", answers[i].get("ticket"), size, self.max_message_bytes)
            answers[i] = {"ticket": answers[i].get("ticket"), "error": (
                f"the engine's answer ({sizes[i]} bytes) does not fit the limit of {self.max_message_bytes} bytes "
                "of a message (agent_proxy.max_message_bytes)")}
            data = messages.answers_frame(answers)
            if len(data) - wire.HEADER_BYTES <= self.max_message_bytes:
                break
        return data

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            conns = list(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        for c in conns:
            c.close()  # wakes its thread's read, and ends its sender
        if self.streamer is not None:
            self.streamer.close()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> "SharedLLMInferenceManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""The inference layer of the rollout: one engine in the driver, reached by every worker.

- ``wire``: frames of plain data and the mutual HMAC handshake; ``messages``:
  what a worker and the manager say in them, each field checked on arrival.
- ``coalescer``: when to call the engine and with which requests (a plain
  object, decided from plain inputs).
- ``server``: ``SharedLLMInferenceManager``, which owns the engine and its
  lock and runs the coalescer's decisions; ``connections``: its accept loop,
  handshakes and the messages of each connection; ``address``: where it may
  listen; ``stats``: its counters (``ManagerStats``); ``partials``: the sink of
  an engine call that sends the requests that stream their tokens their new ids.
- ``hooks``: what the work the manager is told of (``announce``) brings: its
  calls, notes and observer (``Hooks``).
- ``client``: the ``LLMClient`` the scheduler talks to: streams that submit
  requests for futures, over a ``transport``: the ``Transport`` protocol
  (request lists by ticket), with ``DirectClient`` and
  ``StreamingDirectClient`` (an engine in the caller's process); ``inflight``: a streaming engine's requests from their submit
  until they are done, for that client and the manager's ``streamer``;
  ``shared_client``: ``SharedLLMClient`` (a worker's handle on the manager).
"""

from ragen.llm.types import EngineError
from ragen.serving.address import check_listen_address
from ragen.serving.client import LLMClient, Stream
from ragen.serving.transport import DirectClient, StreamingDirectClient, Transport, direct_client
from ragen.serving.coalescer import CallCostModel, Coalescer, Decision, Pending, StreamClock
from ragen.serving.hooks import Hooks, Observer, Reply
from ragen.serving.server import SharedLLMInferenceManager
from ragen.serving.shared_client import SharedLLMClient
from ragen.serving.stats import ManagerStats
from ragen.serving.wire import AuthenticationError, ProtocolError

__all__ = [
    "AuthenticationError", "CallCostModel", "Coalescer", "Decision", "DirectClient", "EngineError", "Hooks",
    "LLMClient", "ManagerStats", "Observer", "Pending", "ProtocolError", "Reply", "SharedLLMClient",
    "SharedLLMInferenceManager", "Stream", "StreamingDirectClient", "StreamClock", "Transport", "check_listen_address", "direct_client",
]

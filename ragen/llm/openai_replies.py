"""The OpenAI engine's replies: a server's JSON read into a completion's text, ids and log-probs.

``ReplyReader`` reads one server's replies. A reply with no ``choices``, a
field of the wrong type, or token ids (prompt or response) that are not ids of
the model (negative, not integers, past 32 bits, or past ``vocab_size`` when
there is a tokenizer) is ``MalformedReply``, naming the server and route.

*Log-probs*: on ``/chat/completions`` they are the ``logprob`` of each entry
of ``choices[0].logprobs.content`` (one per generated token), on
``/completions`` ``choices[0].logprobs.token_logprobs``. What they mean is the
server's choice: OpenAI's are the sampled tokens' log-probs; ``vllm serve``
(V1) returns the raw model's (before temperature, top-k, top-p) unless it is
started with ``--logprobs-mode processed_logprobs`` (then those of the
distribution it sampled from, which is what off-policy correction wants; see
``ragen/llm/vllm_logprobs.py``). A reply without them (field missing or null),
or with anything but a list of numbers (or, when the server sends token ids,
not one per token), gives ``logprobs=None`` for that completion and one
warning per engine: off-policy correction then falls back to none.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Mapping

from ragen.llm.openai_http import MalformedReply, malformed
from ragen.llm.types import GenerationRequest, token_id_error

logger = logging.getLogger(__name__)


def finish_reason(choice: Mapping[str, Any]) -> str:
    """The completion's finish reason: ``length`` where the server says so, else ``stop``."""
    return "length" if choice.get("finish_reason") == "length" else "stop"


class ReplyReader:
    """Reads the replies of the server at ``base_url`` whose model knows ``vocab_size`` ids
    (None: unknown); see the module docstring. Each of its warnings is said once."""

    def __init__(self, base_url: str, vocab_size: int | None) -> None:
        self.base_url = base_url
        self.vocab_size = vocab_size
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def malformed(self, route: str, why: str) -> MalformedReply:
        return malformed(self.base_url, route, why)

    def choice(self, reply: Any, route: str) -> dict[str, Any]:
        """The reply's first choice; MalformedReply unless it is an object with a list of choices."""
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self.malformed(route, f"no choices (got {json.dumps(reply)[:200]})")
        return choices[0]

    def text(self, value: Any, route: str, field: str) -> str:
        """``value`` as the answer's text ("" when missing); MalformedReply unless a string."""
        if value is None:
            return ""
        if not isinstance(value, str):
            raise self.malformed(route, f"{field} is not a string (got {value!r:.80})")
        return value

    def ids(self, value: Any, route: str, field: str) -> list[int]:
        """``value`` as token ids; MalformedReply naming ``field`` unless it is a list of the
        model's ids: the rollout sends ids as unsigned 32-bit integers and trains on them."""
        error = token_id_error(value, self.vocab_size) if isinstance(value, list) else "not a list"
        if error is not None:
            raise self.malformed(route, f"{field}: {error}")
        return value

    def chat_logprobs(self, choice: Mapping[str, Any], response_ids: list[int]) -> list[float] | None:
        """The sampled tokens' log-probs from ``choice["logprobs"]["content"]``, or None
        (and the one warning) when the reply has none or they are malformed."""
        raw = choice.get("logprobs")
        content = raw.get("content") if isinstance(raw, dict) else None
        values = None
        if isinstance(content, list) and all(isinstance(entry, dict) for entry in content):
            values = [entry.get("logprob") for entry in content]
        return self.checked_logprobs(values, response_ids, raw)

    def checked_logprobs(self, values: Any, response_ids: list[int], raw: Any) -> list[float] | None:
        """``values`` as floats when they are a list of numbers, one per response token (when
        the server sent the tokens); else None and the one warning (about ``raw``)."""
        if isinstance(values, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            if not response_ids or len(values) == len(response_ids):  # not aligned: worse than none
                return [float(v) for v in values]
        if self._first("logprobs"):
            logger.warning(
                "OpenAIEngine: the server at %s returned no usable log-probs (got %.100r), so completions carry "
                "logprobs=None and off-policy correction falls back to none (said once per engine)",
                self.base_url, raw,
            )
        return None

    def prompt_ids(self, request: GenerationRequest, sent: list[int], echoed: Any, route: str) -> list[int]:
        """The ids the server sampled after: those it reports (``echoed``), else the ids ``sent``.
        Reported ids other than those sent warn once: the server changed the prompt (or the
        tokenizer and the server's model disagree), and the completion says what it sampled after."""
        if not echoed:
            return sent
        echoed = self.ids(echoed, route, "prompt_token_ids")
        if echoed != sent and self._first("prompt_ids"):
            logger.warning(
                "OpenAIEngine: the server at %s reports other prompt ids than those sent for env %s turn %s "
                "(%d sent, %d reported; first difference at %d): completions carry the ids it reports, those it "
                "sampled after; engine.tokenizer and the server's model may disagree (said once per engine)",
                self.base_url, request.env_id, request.turn, len(sent), len(echoed),
                next((i for i, (a, b) in enumerate(zip(sent, echoed)) if a != b), min(len(sent), len(echoed))))
        return echoed

    def _first(self, warning: str) -> bool:
        """Whether ``warning`` is said now for the first time (it is not said again)."""
        with self._lock:
            if warning in self._warned:
                return False
            self._warned.add(warning)
            return True

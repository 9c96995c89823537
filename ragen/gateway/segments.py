"""Exact tokens for one session's chat calls: each prompt appended to the ids so far where it can be.

A call *extends* the session's previous call when its messages are that call's
messages, then its answer as the assistant message (with its tool calls), then
new messages. Its prompt is then the previous prompt's ids, the ids the engine
sampled, and the template's tokens of the new messages (``ChatTokens.append``):
no answer is ever tokenized again. Any other call starts a new *segment*,
rendered whole, and says why (``BREAKS``).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from ragen.gateway.calls import ChatCall
from ragen.llm.chat_tokens import ChatTokens

# why a call starts a new segment
BREAKS = {
    "tools_changed": "the call's tools differ from the previous call's",
    "system_changed": "the call's system message differs from the previous call's",
    "history_truncated": "the call has fewer messages than the previous call and its answer (a history cut or "
                         "compacted)",
    "history_rewritten": "an earlier message (or the previous answer) differs from what the previous call had",
    "template_rewrites": "the chat template renders the earlier turns otherwise once later ones follow",
}


@dataclass(frozen=True)
class Prompt:
    """One call's prompt: its ids, its segment, why that segment started with it (None: the call
    extends the segment), how many of its ids the segment had before it (``start``), and how many
    of its messages (``held``: the previous call's and its answer; 0 for a new segment)."""

    ids: list[int]
    segment: int
    cause: str | None
    start: int
    held: int = 0

    @property
    def added(self) -> list[int]:
        return self.ids[self.start:]


@dataclass(frozen=True)
class _Said:
    """What a session's last answered call leaves: its messages and answer, tools, and the ids
    of its segment so far (its prompt, then the ids sampled)."""

    said: tuple[tuple[Any, ...], ...] | None  # None: a completions call (its prompt was ids, not messages)
    tools: str
    ids: list[int]
    segment: int


class SessionTokens:
    """The token history of one session's chat calls (thread-safe)."""

    def __init__(self, chat: ChatTokens) -> None:
        self.chat = chat
        self._last: _Said | None = None
        self._segments = 0
        self._lock = threading.Lock()

    def prompt(self, call: ChatCall) -> Prompt:
        """The call's prompt: appended to the last call's segment where the call extends it."""
        with self._lock:
            last = self._last
            cause = "first" if last is None else _break(last, call)
            if cause is None:
                ids, diverged = self.chat.append(last.ids, call.shown, len(last.said), tools=call.tools)
                if not diverged:
                    return Prompt(ids, last.segment, None, len(last.ids), len(last.said))
                cause = "template_rewrites"
            self._segments += 1
            return Prompt(self.chat.full(call.shown, "", call.tools), self._segments - 1, cause, 0)

    def text_prompt(self, ids: list[int]) -> Prompt:
        """A completions call's prompt: it extends the last call's segment when it starts with
        that call's ids (its prompt and the ids sampled)."""
        with self._lock:
            last = self._last
            if last is not None and len(ids) > len(last.ids) and ids[:len(last.ids)] == last.ids:
                return Prompt(list(ids), last.segment, None, len(last.ids))
            self._segments += 1
            return Prompt(list(ids), self._segments - 1, "first" if last is None else "history_rewritten", 0)

    def answered_text(self, prompt: Prompt, sampled: Sequence[int]) -> None:
        with self._lock:
            self._last = _Said(None, "", prompt.ids + list(sampled), prompt.segment)

    def answered(self, call: ChatCall, prompt: Prompt, sampled: Sequence[int], answer: tuple[Any, ...]) -> None:
        """The call was answered with the ids ``sampled``, shown to the client as ``answer``
        (``said_answer``): the next call extends it if it repeats it."""
        with self._lock:
            self._last = _Said(call.said + (answer,), _tools_key(call.tools), prompt.ids + list(sampled),
                               prompt.segment)


def said_answer(content: str, calls: Sequence[tuple[str, dict[str, Any]]]) -> tuple[Any, ...]:
    """An answer as a call that repeats it says it (``calls.ChatCall.said``)."""
    return ("assistant", content, tuple((n, json.dumps(a, sort_keys=True)) for n, a in calls))


def _break(last: _Said, call: ChatCall) -> str | None:
    """Why ``call`` does not extend ``last`` (a key of ``BREAKS``); None where it does."""
    if last.said is None:  # a completions call: no messages to extend
        return "history_rewritten"
    if _tools_key(call.tools) != last.tools:
        return "tools_changed"
    before, now = last.said, call.said
    if len(now) > len(before) and now[:len(before)] == before:
        return None
    if _system(now) != _system(before):
        return "system_changed"
    return "history_truncated" if len(now) <= len(before) else "history_rewritten"


def _system(said: tuple[tuple[Any, ...], ...]) -> Any:
    return said[0] if said and said[0][0] == "system" else None


def _tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools, sort_keys=True) if tools else ""

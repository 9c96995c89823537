"""``CallRecord``: what the gateway keeps of one call, and the session's prompts rebuilt from them.

A record holds what its call adds: the prompt ids after the ``prompt_start``
its segment had before it, and the ids sampled with their log-probs; a chat
call's messages after those its segment held (all of them for a segment's
first call; after the previous answer, as the client repeated it, for a call
that extends), its segment's tools (on the segment's first call), and the
answer as the client got it (the message a call that extends repeats). So a
session's records grow with its tokens and messages, not with their square.
``prompt_ids`` rebuilds any call's whole prompt from the records of its segment.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Sequence


@dataclass
class CallRecord:
    """One call of a session."""

    index: int  # the call's number in its session, from 0
    endpoint: str  # "chat.completions", "completions" or "responses"
    segment: int = -1  # -1: the call failed before it had a prompt
    cause: str | None = None  # why its segment started with it ("first", a key of segments.BREAKS); None: it extends
    prompt_start: int = 0  # ids of its segment before it: its prompt starts with them
    prompt_added: list[int] = field(default_factory=list)  # the prompt's ids after prompt_start
    response_ids: list[int] = field(default_factory=list)  # the ids the engine sampled
    logprobs: list[float] | None = None  # one per sampled id, under the distribution it was sampled from
    policy_version: int | None = None
    finish_reason: str | None = None  # "stop", "length", "tool_calls" as the client saw it; "error"
    replica: int = 0
    started_at: float = 0.0  # epoch seconds
    engine_s: float = 0.0  # from the request sent to the engine to its answer
    total_s: float = 0.0  # from the request read to the answer written
    overrides: dict[str, Any] = field(default_factory=dict)  # what the client asked that the rollout's settings won
    # a chat call's messages after those its segment held, as ``calls.ChatCall.kept`` (a completions call: none)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # the OpenAI function schemas, on a segment's first call only
    answer: dict[str, Any] | None = None  # a chat call's answer as the client got it: role, content, tool_calls
    error: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_start + len(self.prompt_added)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CallRecord":
        """The record ``to_dict`` wrote; ValueError naming a key it does not know or a missing one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"a call record has keys {unknown} that CallRecord does not know")
        missing = sorted({"index", "endpoint"} - set(data))
        if missing:
            raise ValueError(f"a call record lacks {missing}")
        return cls(**data)


def prompt_ids(records: Sequence[CallRecord], index: int) -> list[int]:
    """The whole prompt of call ``index``: its segment's ids before it (the prompts and sampled
    ids of the calls it extends, in order), then the ids it added."""
    record = records[index]
    ids: list[int] = []
    if record.prompt_start:
        earlier = [r for r in records[:index] if r.segment == record.segment and r.error is None]
        for r in earlier:
            ids = ids[:r.prompt_start] + r.prompt_added + r.response_ids
        ids = ids[:record.prompt_start]
    return ids + record.prompt_added

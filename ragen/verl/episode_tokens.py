"""One episode as verl's token record: ``play_tokens``.

The env side (``EnvSide``) plays the episode and asks for each turn's answer;
this side turns each request into prompt ids (``ChatTokens``, the episode's ids
so far and the template's tokens of the new message: ``token_history:
append``), asks ``generate`` for the answer's ids and log-probs, and keeps the
record verl trains on:

- ``prompt_ids``: the first turn's prompt;
- ``response_ids``: each answer's sampled ids (mask 1, their log-probs),
  followed by what the next prompt adds (mask 0, log-prob 0);
- the trajectory's reward (0 when it ended in error or timeout) and the
  episode's metrics.

``response_length`` bounds the whole record (verl pads every sample to it): an
answer is capped to what is left, and the episode ends when nothing is.

An agent program's episode has the same record (``agent_record``): its first
segment's calls in place of turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.types import Completion, token_id_error
from ragen.rollout.agent_samples import agent_rows, call_prompts
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.types import EnvSpec, StopReason, Trajectory, turn_prompts
from ragen.verl.env_side import EnvSide

# generate(prompt_ids, max_tokens) -> (token ids, their log-probs or None)
Generate = Callable[[list[int], int], Awaitable[tuple[Sequence[int], Sequence[float] | None]]]

# the same keys for every sample, env or agent episode: verl reads a batch's keys from its first sample
METRIC_KEYS = ("ragen/success", "ragen/error", "ragen/timeout", "ragen/truncated", "ragen/turns", "ragen/actions",
               "ragen/env_reward", "ragen/untrained_calls")


@dataclass
class EpisodeTokens:
    """One episode's record for verl, and its trajectory."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] | None = field(default_factory=list)
    trajectory: Trajectory | None = None
    truncated: bool = False  # the record reached response_length before the env ended
    untrained_calls: int = 0  # an agent episode's calls outside the record (its later segments)

    def add_prompt(self, ids: Sequence[int]) -> bool:
        """A later turn's prompt: what it adds after the episode's ids so far (the first
        prompt and the response), masked out; False, and nothing added, when it does not
        extend them (a prompt rendered whole)."""
        start, end = len(self.prompt_ids), len(self.prompt_ids) + len(self.response_ids)
        if list(ids[:start]) != self.prompt_ids or list(ids[start:end]) != self.response_ids:
            return False
        added = list(ids[end:])
        self.response_ids += added
        self.response_mask += [0] * len(added)
        if self.response_logprobs is not None:
            self.response_logprobs += [0.0] * len(added)
        return True

    def add_answer(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        """An answer's sampled ids, trained on, with their log-probs (None: the record has none)."""
        self.response_ids += ids
        self.response_mask += [1] * len(ids)
        if logprobs is None:
            self.response_logprobs = None
        elif self.response_logprobs is not None:
            self.response_logprobs += [float(x) for x in logprobs]

    @property
    def failed(self) -> bool:
        return self.trajectory.stop_reason.failed

    @property
    def reward(self) -> float:
        """The trajectory's reward (RAGEN's: env rewards and format penalties); 0 for an episode in error
        or with no response (verl puts the reward at the last response token)."""
        return 0.0 if self.failed or not self.response_ids else float(self.trajectory.reward)

    @property
    def num_turns(self) -> int:
        return len(self.trajectory.turns)

    def metrics(self) -> dict[str, float]:
        """The episode's metrics, the same keys for every episode (``METRIC_KEYS``)."""
        t = self.trajectory
        return {
            "ragen/success": float(bool(t.success)),
            "ragen/error": float(t.stop_reason == StopReason.ERROR),
            "ragen/timeout": float(t.stop_reason == StopReason.TIMEOUT),
            "ragen/truncated": float(self.truncated),
            "ragen/turns": float(len(t.turns)),
            "ragen/actions": float(t.num_actions),
            "ragen/env_reward": float(sum(turn.reward for turn in t.turns)),
            "ragen/untrained_calls": float(self.untrained_calls),
        }


def record_of(trajectory: Trajectory) -> EpisodeTokens:
    """The record a trajectory of our own rollout (``token_history: append``) implies:
    its first prompt, then each answer and what the next prompt adds; what
    ``play_tokens`` gives for the same episode. ValueError when a prompt does not
    extend the ids before it (a prompt rendered whole)."""
    record: EpisodeTokens | None = None
    for turn, whole in zip(trajectory.turns, turn_prompts(trajectory.turns)):
        if whole is None:
            raise ValueError(f"env {trajectory.env_id}: turn without prompt ids (the engine gave none)")
        if record is None:
            record = EpisodeTokens(prompt_ids=whole)
        elif not record.add_prompt(whole):
            raise ValueError(f"env {trajectory.env_id}: a prompt does not extend the episode's ids "
                             "(ctx_manager.token_history must be append)")
        record.add_answer(turn.response_ids, turn.logprobs)
    record = record or EpisodeTokens(prompt_ids=[])
    record.trajectory = trajectory
    return record


def agent_record(trajectory: Trajectory, prompt_length: int, response_length: int,
                 truncated: bool = False) -> EpisodeTokens:
    """An agent episode's record (``ragen.rollout.agent_episode``): its first segment, the first
    sample ``agent_rows`` makes of it (its first call's prompt, then each call's sampled ids and
    what the segment's next prompt adds); the calls of its other segments are counted in
    ``untrained_calls``. A record past ``response_length`` is cut there; one whose prompt is past
    ``prompt_length`` (calls of the first segment raced) is left empty. ``truncated``: a call
    was refused or cut for the sample's room."""
    turns = trajectory.turns
    run = agent_rows(turns, "segment")[0]["turns"] if turns else []
    prompts = list(call_prompts(turns))
    record = EpisodeTokens(prompt_ids=prompts[run[0]] if run else [], truncated=truncated)
    for k in run:
        if k != run[0] and not record.add_prompt(prompts[k]):
            raise AssertionError(f"call {k} of a segment does not extend its ids")  # agent_rows' runs do
        record.add_answer(turns[k].response_ids, turns[k].logprobs)
    if len(record.prompt_ids) > prompt_length:
        record = EpisodeTokens(prompt_ids=[], truncated=True)
    _cut(record, response_length)
    record.trajectory = trajectory
    record.untrained_calls = len(turns) - len(run)
    return record


async def play_tokens(spec: EnvSpec, config: LoopConfig, env: EnvSide, chat: ChatTokens,
                      decode: Callable[[list[int]], str], generate: Generate, *, response_length: int,
                      prompt_length: int, vocab_size: int | None = None) -> EpisodeTokens:
    """``spec``'s episode played on ``env`` with answers from ``generate``: its verl record.

    ``decode(ids)`` is the answer's text (special tokens skipped). A first prompt
    longer than ``prompt_length`` raises ValueError (a config error: every episode of
    the tag has it); a reply with ids the model does not have ends this episode in
    error."""
    key = env.new_key()
    step = await env.start(key, spec, config)
    record: EpisodeTokens | None = None
    ends = set(chat.end_texts)
    while step.request is not None:
        request = step.request
        ids, _ = chat.request_ids(request)
        if record is None:
            if len(ids) > prompt_length:
                await env.end(key, StopReason.ERROR, "prompt too long")
                raise ValueError(f"tag {spec.tag!r} (seed {spec.seed}): the first prompt has {len(ids)} tokens, "
                                 f"more than verl's data.max_prompt_length={prompt_length}: raise it")
            record = EpisodeTokens(prompt_ids=list(ids))
        elif not record.add_prompt(ids):  # token_history: append extends the ids so far
            step = await env.end(key, StopReason.ERROR, "the next prompt does not extend the episode's ids")
            break
        room = response_length - len(record.response_ids)
        if room <= 0:
            record.truncated = True
            step = await env.end(key, StopReason.MAX_TURNS)
            break
        limit = min(request.token_limit(config.sampling), room)
        try:
            # Unbounded here, for a reason: the server manager owns a request's lifetime (verl's
            # servers abort and retry it); a failure it raises ends this episode below.
            answer, logprobs = await generate(list(ids), limit)
        except Exception as exc:  # noqa: BLE001 - the server failed this request: this episode's error
            step = await env.end(key, StopReason.ERROR, f"the server could not answer turn {request.turn}: "
                                                        f"{type(exc).__name__}: {exc}")
            break
        answer = list(answer)
        problem = token_id_error(answer, vocab_size)
        if problem is None and logprobs is not None and len(logprobs) != len(answer):
            problem = f"{len(logprobs)} log-probs for {len(answer)} token ids"
        if problem is not None:
            step = await env.end(key, StopReason.ERROR, f"the server's reply to turn {request.turn}: {problem}")
            break
        if len(answer) >= limit == room:  # cut by what was left of response_length
            record.truncated = True
        record.add_answer(answer, logprobs)
        body = answer[:-1] if answer and answer[-1] in ends else answer
        finish = "stop" if (answer and answer[-1] in ends) or len(answer) < limit else "length"
        completion = Completion.answering(request, decode(body), list(ids), answer, finish, 0,
                                          None if logprobs is None else [float(x) for x in logprobs])
        step = await env.advance(key, completion)
    if record is None:  # ended before its first prompt (its reset failed)
        record = EpisodeTokens(prompt_ids=[])
    _cut(record, response_length)
    record.trajectory = step.trajectory
    return record


def _cut(record: EpisodeTokens, length: int) -> None:
    if len(record.response_ids) > length:
        record.truncated = True
        del record.response_ids[length:], record.response_mask[length:]
        if record.response_logprobs is not None:
            del record.response_logprobs[length:]

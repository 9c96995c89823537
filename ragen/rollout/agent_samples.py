"""An agent episode's training rows (``agent.sample_shape``), each exactly the ids the engine saw and sampled.

An agent episode's turns are its calls on the gateway (``ragen.rollout.agent_episode``). The calls of
a *segment* extend one token sequence; a call that rewrote its history starts another, so an episode
is not one sequence. ``segment``: a row per segment, its first prompt, then each call's sampled ids
(in the loss, with their log-probs) and what the segment's next prompt adds (not in the loss).
``call``: a row per call, its whole prompt, then its sampled ids. The episode's reward sits on each
row's last sampled token; the trainer gives every row the episode's advantage.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

from ragen.rollout.types import Turn

__all__ = ["agent_rows", "call_prompts"]


def call_prompts(turns: Sequence[Turn]) -> Iterator[list[int]]:
    """Each call's whole prompt, rebuilt as the gateway's ``record.prompt_ids`` does: the first
    ``prompt_start`` ids of its segment so far (the prompts and answers of its earlier calls), then
    the ids it added."""
    so_far: dict[Any, list[int]] = {}  # segment -> its ids up to its last call's answer
    for turn in turns:
        segment = turn.info.get("segment")
        prompt = so_far.get(segment, [])[:turn.prompt_start] + list(turn.prompt_ids)
        so_far[segment] = prompt + list(turn.response_ids)
        yield prompt


def agent_rows(turns: Sequence[Turn], shape: str) -> list[dict[str, Any]]:
    """The episode's rows, in the order of their first call; each row's ``turns`` are the turns it trains."""
    prompts = list(call_prompts(turns))
    if shape == "call":
        runs = [[k] for k in range(len(turns))]
    else:
        runs = _segment_runs(turns, prompts)
    reward = float(sum(t.reward + t.penalty for t in turns))
    return [_row(turns, prompts, run, reward) for run in runs]


def _segment_runs(turns: Sequence[Turn], prompts: list[list[int]]) -> list[list[int]]:
    """The turns of each segment, in order. A call whose prompt does not extend its segment's
    sequence so far (two calls in flight at once extend the same call) starts a run of its own
    there, so that every row stays one sequence; it extends whichever run its prompt starts with."""
    runs: list[tuple[Any, list[int], list[int]]] = []  # (segment, ids up to its last answer, turns)
    for k, (turn, prompt) in enumerate(zip(turns, prompts)):
        segment = turn.info.get("segment")
        for seg, ids, members in reversed(runs):
            if seg == segment and turn.prompt_start and prompt[:len(ids)] == ids:
                ids[len(ids):] = prompt[len(ids):] + list(turn.response_ids)
                members.append(k)
                break
        else:
            runs.append((segment, prompt + list(turn.response_ids), [k]))
    return [members for _, _, members in runs]


def _row(turns: Sequence[Turn], prompts: list[list[int]], run: list[int], reward: float) -> dict[str, Any]:
    ids: list[int] = []
    mask: list[int] = []
    behaviour: list[float] = []
    last = None  # the last sampled token
    for k in run:
        turn, added = turns[k], prompts[k][len(ids):]
        answer = list(turn.response_ids)
        logprobs = turn.logprobs if turn.logprobs is not None and len(turn.logprobs) == len(answer) else None
        ids += added + answer
        mask += [0] * len(added) + [1] * len(answer)
        behaviour += [math.nan] * len(added) + (list(logprobs) if logprobs is not None else [math.nan] * len(answer))
        if answer:
            last = len(ids) - 1
    rewards = [0.0] * len(ids)
    if last is not None:
        rewards[last] = reward
    return {"input_ids": ids, "loss_mask": mask, "token_rewards": rewards, "behaviour_logprobs": behaviour,
            "turns": list(run)}

"""A scripted policy: a deterministic stand-in for a language model.

``ScriptedEngine`` answers in the agent format ``<think>...</think><answer>...</answer>``
without any model, so the rollout machinery can be tested and benchmarked
without torch:

- *Choices* (which actions, how many, which arithmetic expression, whether the
  answer is malformed) come from a generator seeded by ``request_seed`` of
  (engine seed, sampling seed, request key): the same request gets the same
  answer in any batch, order or process. Nothing global is random.
- *Actions*: a prompt line ``Available actions: Up, Down, Left, Right`` gives
  the names; ``up to N actions`` the most per turn, joined by ``" || "``.
  Without such a line (language tasks such as Countdown), the answer is a short
  expression over integers from the last user message, e.g. ``3 + 5 * 2``.
- *Malformed answers* at rate ``malformed_rate``: no tags, empty answer,
  unknown action, unclosed tag or nested tags, so parsers meet every defect.
- *Tokens*: a byte-level tokenizer (utf-8 bytes) of a plain rendering of the
  messages; ``max_tokens`` truncates the response (finish reason ``length``).
- *Log-probs*: the log-probability of the choices that made the answer (each
  uniform among its options; the malformed draw at ``malformed_rate``), on
  the first response token, 0 on the rest (they follow from the choices).
- *Cost model* of a GPU engine: each ``generate`` call sleeps
  ``base_s + per_token_s * response tokens in the call`` (a sleep, so it holds
  no CPU, as a GPU-bound call would not).
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Any, Mapping, Sequence

import random

from ragen.llm.types import Completion, Engine, GenerationRequest, SamplingParams, request_seed

logger = logging.getLogger(__name__)

ACTION_SEPARATOR = " || "
MALFORMED_KINDS = ("no_tags", "empty_answer", "unknown_action", "unclosed_tag", "nested_tags")

_ACTIONS_LINE = re.compile(r"^[^\S\n]*Available actions\s*:[^\S\n]*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_MAX_ACTIONS = re.compile(r"up to (\d+) actions?", re.IGNORECASE)
_INTEGER = re.compile(r"\d+")
_THOUGHTS = (
    "Let me look at the state.",
    "I should move closer to the goal.",
    "Try something simple.",
    "Check the numbers first.",
)
_OPERATORS = ("+", "-", "*")


def render_messages(messages: Sequence[Mapping[str, str]]) -> str:
    """The plain text that the byte tokenizer encodes as the prompt."""
    parts = [f"<|{m.get('role', 'user')}|>\n{m.get('content', '')}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


def last_user_message(messages: Sequence[Mapping[str, str]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            return m.get("content", "")
    return messages[-1].get("content", "") if messages else ""


def parse_action_space(prompt: str) -> tuple[list[str], int]:
    """Action names and the most actions per turn (1 when not stated)."""
    match = _ACTIONS_LINE.search(prompt)
    if match is None:
        return [], 1
    names = [n.strip().strip(".").strip() for n in match.group(1).split(",")]
    names = [n for n in names if n]
    limit = _MAX_ACTIONS.search(prompt)
    return names, (max(1, int(limit.group(1))) if limit else 1)


class ScriptedEngine(Engine):
    """Deterministic fake policy; see the module docstring."""

    name = "scripted"
    returns_logprobs = True
    config_keys = ("seed", "malformed_rate", "base_s", "per_token_s", "think", "return_prompt_ids")

    def __init__(
        self,
        *,
        seed: int = 0,
        malformed_rate: float = 0.0,
        base_s: float = 0.0,
        per_token_s: float = 0.0,
        think: bool = True,
        return_prompt_ids: bool = True,
    ) -> None:
        super().__init__()
        if not 0.0 <= float(malformed_rate) <= 1.0:
            raise ValueError(f"engine.malformed_rate={malformed_rate} must be within [0, 1]")
        if base_s < 0 or per_token_s < 0:
            raise ValueError(f"engine.base_s={base_s} and engine.per_token_s={per_token_s} must be >= 0")
        self.seed = int(seed)
        self.malformed_rate = float(malformed_rate)
        self.base_s = float(base_s)
        self.per_token_s = float(per_token_s)
        self.think = bool(think)
        self.return_prompt_ids = bool(return_prompt_ids)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], model_path: str | None = None) -> "ScriptedEngine":
        return cls(**cfg)  # the scripted policy has no weights: model_path is unused

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        completions = [self._complete(r, sampling) for r in requests]
        n_tokens = sum(len(c.response_token_ids) for c in completions)
        delay = self.base_s + self.per_token_s * n_tokens
        if delay > 0:
            time.sleep(delay)
        return completions

    def answer_text(self, request: GenerationRequest, sampling: SamplingParams) -> str:
        """The full (untruncated) answer for a request; a pure function of its inputs."""
        return self._answer(request, sampling)[0]

    def _answer(self, request: GenerationRequest, sampling: SamplingParams) -> tuple[str, float]:
        """The full answer and the log-probability of the script's choices that made it."""
        # random.Random, not numpy: seeding one per request is much cheaper, and this
        # engine's own CPU time counts against the driver in benchmarks
        rng = random.Random(request_seed(self.seed, (sampling.seed, *request.key)))
        prompt = last_user_message(request.messages)
        names, max_actions = parse_action_space(prompt)
        if not names:  # instructions may sit in an earlier (system) message
            names, max_actions = parse_action_space("\n".join(m.get("content", "") for m in request.messages))
        answer, logp = self._actions(rng, names, max_actions) if names else self._expression(rng, prompt)
        thought = _THOUGHTS[rng.randrange(len(_THOUGHTS))]
        think = f"<think>{thought}</think>" if self.think else ""
        if self.think:
            logp -= math.log(len(_THOUGHTS))
        # Always drawn, so the well-formed answers do not shift with the rate.
        malformed = rng.random() < self.malformed_rate
        kind = MALFORMED_KINDS[rng.randrange(len(MALFORMED_KINDS))]
        if not malformed:
            return f"{think}<answer>{answer}</answer>", logp + math.log1p(-self.malformed_rate)
        logp += math.log(self.malformed_rate) - math.log(len(MALFORMED_KINDS))
        if kind == "no_tags":
            return answer, logp
        if kind == "empty_answer":
            return f"{think}<answer></answer>", logp
        if kind == "unknown_action":
            return f"{think}<answer>{'Jump' if names else 'banana'}</answer>", logp
        if kind == "unclosed_tag":
            return f"{think}<answer>{answer}", logp
        return f"{think}<answer><answer>{answer}</answer></answer>", logp

    def _complete(self, request: GenerationRequest, sampling: SamplingParams) -> Completion:
        text, logp = self._answer(request, sampling)
        response_ids = list(text.encode("utf-8"))
        limit = request.token_limit(sampling)
        finish_reason = "stop"
        if len(response_ids) > limit:
            response_ids = response_ids[: max(0, limit)]
            text = bytes(response_ids).decode("utf-8", errors="ignore")
            finish_reason = "length"
        prompt_ids = list(render_messages(request.messages).encode("utf-8")) if self.return_prompt_ids else []
        # the choices' log-probability on the first token (every later byte follows from
        # them with probability 1): the tokens' log-probs sum to the answer's
        logprobs = [logp] + [0.0] * (len(response_ids) - 1) if response_ids else []
        return Completion.answering(request, text, prompt_ids, response_ids, finish_reason, self.policy_version,
                                    logprobs)

    @staticmethod
    def _actions(rng: random.Random, names: list[str], max_actions: int) -> tuple[str, float]:
        count = rng.randint(1, max_actions)
        text = ACTION_SEPARATOR.join(names[rng.randrange(len(names))] for _ in range(count))
        return text, -math.log(max_actions) - count * math.log(len(names))

    @staticmethod
    def _expression(rng: random.Random, prompt: str) -> tuple[str, float]:
        numbers = _INTEGER.findall(prompt)
        if not numbers:
            return str(rng.randrange(10)), -math.log(10)
        drawn = rng.randint(2, 4)
        count = min(len(numbers), drawn)
        # every draw of 2..4 that min() maps to this count, then the ordered pick, then the operators
        logp = math.log(sum(min(len(numbers), d) == count for d in (2, 3, 4)) / 3)
        logp -= sum(math.log(len(numbers) - i) for i in range(count)) + (count - 1) * math.log(len(_OPERATORS))
        picked = [numbers[i] for i in rng.sample(range(len(numbers)), count)]
        parts = [picked[0]]
        for number in picked[1:]:
            parts += [_OPERATORS[rng.randrange(len(_OPERATORS))], number]
        return " ".join(parts), logp

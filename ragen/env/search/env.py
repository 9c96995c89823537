"""The search env: answer a question by searching a corpus over HTTP (RAGEN's SearchQA).

Concepts:

- **Question**: ``corpus.questions()[seed % len]``, made-up facts that only the
  corpus knows (one search, or two for a region's largest town).
- **Actions** (RAGEN's text form): ``search[<query>]`` asks the retrieval
  server (``server_url``) and shows the ``top_k`` documents; ``finish[<answer>]``
  answers and ends the episode. Anything else is invalid and changes nothing.
  With ``tool_calls``, the same as calls of the tools ``search(query)`` and
  ``finish(answer)``.
- **Reward**: on ``finish``, 1 for an exact match with the answer (SQuAD's
  normalisation: case, punctuation, articles), else with ``reward: f1`` the
  token F1 when at least ``f1_threshold``; 0 for a search. ``success``: an
  exact match. ``max_steps`` actions without an answer end the episode at 0.
- **Long queries**: a query over ``max_query_chars`` (the shipped server's
  bound, 2,000) is not sent: an invalid action whose observation names the
  limit (in the tool form, a call off the schema: the format penalty).
- **Server failures**: a search that fails raises ``RetrievalError`` naming
  the server (``RetrievalTimeout`` past ``timeout_s``): the rollout retries
  the env, then ends it in ``error`` or ``timeout``. ``preflight()`` says
  when the server does not answer ``/health`` (the env checker fails on it).
"""

from __future__ import annotations

import re
import string
import time
from collections import Counter
from typing import Any

from ..base import BaseLanguageBasedEnv, make_rng, tool_argument, unchanged_step
from .client import health, retrieve
from .config import SearchEnvConfig, warn_if_unreachable
from .corpus import Question, questions

__all__ = ["SearchEnv", "f1_score", "normalize_answer"]

ACTIONS_LINE = "Available actions: search[<query>], finish[<answer>]"
TOOLS_LINE = "Call the search tool to look things up, and the finish tool to give your answer."
_ACTION = re.compile(r"^\s*(search|finish)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def f1_score(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


class SearchEnv(BaseLanguageBasedEnv):
    """One question per episode, answered by searching the retrieval server."""

    config_cls = SearchEnvConfig

    def __init__(self, config: SearchEnvConfig | None = None) -> None:
        super().__init__(config if config is not None else SearchEnvConfig())
        warn_if_unreachable(self.config.server_url)  # once a process: the first env of a rollout's worker
        self.question: Question | None = None
        self.steps = 0
        self.render_cache = ""
        self._done = False
        self._success = False

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        seed, _ = make_rng(seed)
        table = questions()
        self.question = table[seed % len(table)]
        self.steps = 0
        self._done = self._success = False
        self.render_cache = f"Question: {self.question.question}\n{self._actions_line}"
        return self.render_cache

    @property
    def _actions_line(self) -> str:
        return TOOLS_LINE if self.config.tool_calls else ACTIONS_LINE

    def preflight(self) -> str | None:
        why = health(self.config.server_url)
        return None if why is None else (f"the retrieval server {self.config.server_url} is unreachable: it does not "
                                         f"answer /health ({why}); start it with python -m "
                                         "ragen.tools.retrieval_server, or set env_config.server_url")

    def _results(self, query: str) -> str:
        cfg = self.config
        t0 = time.perf_counter()
        found = retrieve(cfg.server_url, query, cfg.top_k, cfg.timeout_s, cfg.key_env)
        self.step_costs = {"retrieval_s": time.perf_counter() - t0}
        if not found:
            return "No relevant documents found for the query."
        shown = []
        for i, doc in enumerate(found[:cfg.top_k], 1):
            content = doc["content"]
            if len(content) > cfg.max_doc_chars:
                content = content[:cfg.max_doc_chars] + "..."
            shown.append(f"[Document {i}] (ID: {doc.get('id')})\n{content}")
        return "\n\n".join(shown)

    def compute_reward(self, answer: str) -> float:
        truth = self.question.answer
        if normalize_answer(answer) == normalize_answer(truth):
            return 1.0
        if self.config.reward == "f1":
            f1 = f1_score(answer, truth)
            return f1 if f1 >= self.config.f1_threshold else 0.0
        return 0.0

    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        if self.question is None:
            raise RuntimeError("SearchEnv.step() called before reset()")
        self.step_costs = None
        if isinstance(action, dict):  # a tool call: the text form of the same action
            kind = action.get("name")
            arg = tool_argument(action, kind, "query" if kind == "search" else "answer")
            action = f"{kind}[{arg}]" if arg is not None else None
        match = _ACTION.match(action) if isinstance(action, str) else None
        valid = match is not None and bool(match.group(2).strip())
        if not valid or self._done:
            return unchanged_step(self.render_cache, valid, self._done, self._success, self.config.invalid_act_score)
        kind, arg = match.group(1).lower(), match.group(2).strip()
        if kind == "search" and len(arg) > self.config.max_query_chars:  # the server would refuse it
            return self._too_long(len(arg))
        self.steps += 1
        if kind == "finish":
            reward = self.compute_reward(arg)
            self._success = reward == 1.0
            self._done = True
            self.render_cache = f"Your answer: {arg}. Reward: {reward:.2f}"
            return self.render_cache, reward, True, {"action_is_effective": True, "action_is_valid": True,
                                                     "success": self._success, "action_type": "finish"}
        results = self._results(arg)
        self._done = self.steps >= self.config.max_steps
        tail = "Maximum search steps reached. Episode ended without an answer." if self._done else self._actions_line
        self.render_cache = f"Search results for '{arg}':\n{results}\n\n{tail}"
        return self.render_cache, 0.0, self._done, {"action_is_effective": True, "action_is_valid": True,
                                                    "success": False, "action_type": "search"}

    def _too_long(self, n: int) -> tuple[str, float, bool, dict]:
        """An over-long query: the model's mistake, an invalid action that sends nothing and says why."""
        limit = self.config.max_query_chars
        self.render_cache = (f"Your query has {n} characters; a query may have at most {limit}. Nothing was "
                             f"searched: search again with a shorter query.\n{self._actions_line}")
        return self.render_cache, self.config.invalid_act_score, False, {
            "action_is_valid": False, "action_is_effective": False, "success": False, "action_type": "search"}

    def render(self, mode: str | None = None) -> str:
        return self.render_cache

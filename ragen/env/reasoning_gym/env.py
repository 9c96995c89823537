"""A reasoning-gym dataset as an env: the seed picks the question, the dataset scores the answer.

Concepts:

- **Item**: ``create_dataset(dataset, seed=<reset seed>, size=1, **options)[0]``.
  reasoning-gym draws item ``i`` of a dataset seeded ``s`` from
  ``Random(s + i)``, so the reset seed alone decides the question: same seed,
  same question, in any process. A few datasets draw from the global
  generators too: the env seeds them with the reset seed, privately
  (``ragen.env.global_rng.own_rng``), so those are seeded as well and the
  caller's generators are untouched.
- **Observation**: the item's question; after a wrong answer with attempts
  left, its score and the question again. A dataset's options have no bound of
  their own, so a scorer process makes the question first (``question_chars``):
  a question that takes longer than ``item_wall_s`` to make, or more than the
  scorer's memory, or is longer than ``max_observation_chars``, fails the reset
  naming the dataset and its options, and this process never makes it. While
  this process waits for that scorer it holds no lock and no interpreter, so
  the rollout's ``env_timeout_s`` ends a longer reset on time.
- **Action**: the answer text (what the model writes inside ``<answer>``).
- **Reward**: the dataset's own ``score_answer(answer, item)`` (0..1) for the
  answer that ends the episode; ``success`` is a score of 1. With
  ``attempts: 1`` (the default) one answer ends it; with more, a wrong answer
  scores 0 and the episode goes on until an answer scores 1 or none are left.
- **Scoring**: never in this process. Some scorers evaluate the answer as
  code, and any may compute for long on it, so a sandboxed scorer process
  scores it (``scoring.py``, within ``scorer_wall_s``); an answer such a scorer
  would evaluate must first be an allowed expression (``answers.py``). An
  answer refused, too slow to score, or that makes its scorer raise or die
  scores 0, and ``info["score_error"]`` says why.
"""

from __future__ import annotations

import logging
from typing import Any

from ..base import BaseLanguageBasedEnv, make_rng, unchanged_step
from ..global_rng import GlobalRngState, own_rng
from ..observation_bound import check_observation
from .answers import refusal
from .config import ReasoningGymEnvConfig
from .scoring import QuestionError, Score, scorer_pool

__all__ = ["ReasoningGymEnv"]

logger = logging.getLogger(__name__)


class ReasoningGymEnv(BaseLanguageBasedEnv):
    """One reasoning-gym question per episode, scored by its dataset."""

    config_cls = ReasoningGymEnvConfig

    def __init__(self, config: ReasoningGymEnvConfig | None = None) -> None:
        super().__init__(config if config is not None else ReasoningGymEnvConfig())
        self.dataset: Any = None
        self.item: dict[str, Any] | None = None
        self.seed: int | None = None
        self.attempts_left = 0
        self.render_cache = ""
        self._done = False
        self._success = False

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        self.dataset = self.item = None
        self.seed, _ = make_rng(seed)
        cfg = self.config
        source = f"reasoning-gym's {cfg.dataset} with options {cfg.options} (seed {self.seed})"
        try:  # made in a scorer first: there its time and memory are bounded
            chars = scorer_pool(cfg.scorer_limits()).question_chars(cfg.dataset, cfg.options, self.seed,
                                                                   cfg.item_wall_s)
        except QuestionError as exc:
            raise RuntimeError(f"{source} gave no question: {exc} (a question's bounds: item_wall_s="
                               f"{cfg.item_wall_s:g}, scorer_memory_mb={cfg.scorer_memory_mb})") from None
        check_observation(chars, cfg.max_observation_chars, source)
        with own_rng(GlobalRngState(), seed=self.seed):
            self.item = self._dataset()[0]
        check_observation(len(self.item["question"]), cfg.max_observation_chars, source)  # this process's
        self.attempts_left = self.config.attempts
        self.render_cache = self.item["question"]
        self._done = False
        self._success = False
        return self.render_cache

    def _dataset(self) -> Any:
        """The dataset seeded with the reset seed (built again after unpickling)."""
        if self.dataset is None:
            import reasoning_gym

            cfg = self.config
            self.dataset = reasoning_gym.create_dataset(cfg.dataset, seed=self.seed, size=1, **cfg.options)
        return self.dataset

    def compute_reward(self, action: Any) -> float:
        """The dataset's score of the answer, 0..1."""
        return self.score(action).value

    def score(self, action: str) -> Score:
        """The dataset's score of the answer, by a sandboxed scorer; 0 with the reason when it gives none."""
        cfg, answer = self.config, action.strip()
        why = refusal(cfg.dataset, answer, self.item)
        if why is not None:
            logger.debug("%s: the answer %r scores 0: %s", cfg.dataset, answer[:100], why)
            return Score(0.0, why)
        pool = scorer_pool(cfg.scorer_limits())
        return pool.score(cfg.dataset, cfg.options, self.seed, self.item, answer, cfg.scorer_wall_s)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its dataset object (some hold lambdas): it is built again from the seed."""
        state = dict(self.__dict__)
        state["dataset"] = None
        return state

    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        if self.item is None:
            raise RuntimeError("ReasoningGymEnv.step() called before reset()")
        valid = isinstance(action, str)
        if not valid or self._done:
            return unchanged_step(self.render_cache, valid, self._done, self._success, self.config.invalid_act_score)
        scored = self.score(action)
        score = scored.value
        self.attempts_left -= 1
        self._success = score >= 1.0
        self._done = self._success or self.attempts_left == 0
        if self._done:
            self.render_cache = f"Your answer scored {score:g}."
            reward = score
        else:
            left = self.attempts_left
            self.render_cache = (f"Your answer scored {score:g}. {left} attempt{'s' if left > 1 else ''} left.\n"
                                 f"{self.item['question']}")
            reward = 0.0
        info = {"action_is_effective": True, "action_is_valid": True, "success": self._success, "score": score}
        if scored.error is not None:
            info["score_error"] = scored.error
        return self.render_cache, reward, self._done, info

    def render(self, mode: str | None = None) -> str:
        return self.render_cache

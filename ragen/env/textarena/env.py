"""A TextArena single-player game as an env.

Concepts:

- **Game**: ``textarena.make(env_id, **options)``, reset with one player and the
  reset seed. TextArena's games draw from Python's global ``random``; each env
  keeps its own generator states and swaps them in around the game's calls
  (``ragen.env.global_rng.own_rng``), so episodes are deterministic in any
  interleaving and the caller's global generators are untouched.
- **Observation**: what the game shows the player: at reset its whole text,
  after a move the text the move added (the game's answer and, for board
  games, the board). One longer than ``max_observation_chars`` fails the
  call, naming the game's options. The game runs in this process, in Python:
  the rollout's ``env_timeout_s`` bounds a reset's or a step's time.
- **Action**: the answer text, passed to the game as the player's move.
- **Reward**: 0 while the game goes on; when it ends, the player's reward from
  the game (``close()``); ``success`` is a reward of 1 or more.
- **Seeds**: the seed decides the hidden state (Mastermind's code, the mines);
  where the first screen does not show it, every seed's first observation is
  the same (and TowerOfHanoi has no randomness at all).
"""

from __future__ import annotations

from typing import Any

from ..base import BaseLanguageBasedEnv, make_rng, unchanged_step
from ..global_rng import GlobalRngState, own_rng
from ..observation_bound import check_observation
from .config import TextArenaEnvConfig, import_textarena

__all__ = ["TextArenaEnv"]


class TextArenaEnv(BaseLanguageBasedEnv):
    """One single-player TextArena game per episode."""

    config_cls = TextArenaEnvConfig

    def __init__(self, config: TextArenaEnvConfig | None = None) -> None:
        super().__init__(config if config is not None else TextArenaEnvConfig())
        self.game: Any = None
        self.seed: int | None = None
        self._rng = GlobalRngState()
        self._shown = ""
        self.render_cache = ""
        self._done = False
        self._success = False

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        ta = import_textarena()
        self.seed, _ = make_rng(seed)
        self._rng = GlobalRngState()
        with own_rng(self._rng, seed=self.seed):  # seeded before the game is built: some draw then
            self.game = ta.make(env_id=self.config.env_id, **self.config.options)
            self.game.reset(num_players=1, seed=self.seed)
            _, text = self.game.get_observation()
        self._shown = ""
        self.render_cache = self._new_text(text)
        self._done = False
        self._success = False
        return self.render_cache

    def _new_text(self, text: Any) -> str:
        """What the player has not been shown yet (TextArena's observation holds it all)."""
        text = text if isinstance(text, str) else str(text)
        new = text[len(self._shown):] if text.startswith(self._shown) else text
        self._shown = text
        new = new.strip("\n") or text
        check_observation(len(new), self.config.max_observation_chars, f"{self.config.source()} (seed {self.seed})")
        return new

    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        if self.game is None:
            raise RuntimeError("TextArenaEnv.step() called before reset()")
        valid = isinstance(action, str)
        if not valid or self._done:
            return unchanged_step(self.render_cache, valid, self._done, self._success, self.config.invalid_act_score)
        with own_rng(self._rng):
            done, _ = self.game.step(action=action)
            _, text = self.game.get_observation()
            reward, info = 0.0, {}
            if done:
                rewards, game_info = self.game.close()
                reward = _number(rewards.get(0) if isinstance(rewards, dict) else None)
                info = game_info.get(0, {}) if isinstance(game_info, dict) else {}
        self._done = bool(done)
        self._success = self._done and reward >= 1.0
        self.render_cache = self._new_text(text)
        invalid = bool(info.get("invalid_move"))
        return self.render_cache, reward, self._done, {
            "action_is_valid": True, "action_is_effective": not invalid, "success": self._success}

    def render(self, mode: str | None = None) -> str:
        return self.render_cache

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its game (TextArena's wrappers do not unpickle): an unpickled
        env starts again from ``reset``."""
        state = dict(self.__dict__)
        state["game"] = None
        return state


def _number(value: Any) -> float:
    """The game's reward as a number: 0 for none, or for a text some games put there
    (the reason an invalid move ended the game)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0

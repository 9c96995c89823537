"""``EnvStateManager``: RAGEN's env state manager, for scripts written against RAGEN.

``EnvStateManager(config, mode="train")`` builds the envs of
``es_manager.<mode>`` (``env_groups`` x ``group_size``, a ``custom_envs`` tag
per group; the config needs no other split) and steps them from the calling
thread, as RAGEN's does:

- ``envs``: one entry per env, ``{"tag", "group_id", "env_id", "env",
  "config", "status", "max_actions_per_traj"}``; ``status`` is an
  ``EnvStatus`` (``seed``, ``num_actions``, ``rewards``, ``terminated``,
  ``truncated``).
- ``reset(seed=None)``: every env reset; group ``g`` gets ``seed + g``. With
  no seed, ``train`` starts at ``seed.train`` and advances ``env_groups`` a
  reset; ``val`` uses ``seed.val`` every time. Returns the rollout cache: per
  env ``{"env_id", "group_id", "tag", "penalty", "history"}``, the history a
  list of ``{"state", "actions_left", ...}``.
- ``step(inputs)``: ``inputs`` are ``{"env_id", "actions", "llm_response",
  "llm_raw_response"}`` (an env_id not in ``envs``, or of an env that ended
  since the last reset, is a ValueError naming it, and then no env steps);
  the actions are applied as the rollout applies an answer's
  (``turn.apply_actions``): those the env's lookup names (any case) run,
  within the env's action budget; an answer with no valid action, or with
  invalid ones, adds ``es_manager.format_penalty``. Returns the caches of the
  envs that play on.
- ``get_rollout_states()``: the caches with per-env ``metrics`` (``<tag>/success``,
  ``<tag>/num_actions``, the mean of each numeric ``info`` value over the turns,
  ``<tag>/pass@<group_size>``); ``render()``; ``close()``.

Each env's episode is ``play_episode`` (``ragen.rollout.episode``), as in
the rollouts of this package, driven here by RAGEN's env inputs: the same
reset and answer-applying code, in the calling thread.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping

from ragen.config_reader import to_plain
from ragen.llm.types import Completion
from ragen.rollout.config import read_rollout_sections
from ragen.rollout.env_calls import KeptEnvs, reset_env
from ragen.rollout.envs import EnvSpecMaker
from ragen.rollout.episode import EnvTurns
from ragen.rollout.episode_state import Episode
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.turn import Played, apply_actions
from ragen.rollout.types import StopReason


@dataclass
class EnvStatus:
    """One env's state in RAGEN's terms: the seed it was reset with, its actions, rewards and end."""

    truncated: bool = False  # done, not a success
    terminated: bool = False  # done
    num_actions: int = 0
    rewards: list[float] = field(default_factory=list)  # one a turn
    seed: int | None = None


class EnvStateManager:
    """RAGEN's manager of one split's envs (see the module docstring)."""

    def __init__(self, config: Mapping[str, Any], mode: str = "train") -> None:
        from ragen.env import make_env

        if mode not in ("train", "val"):
            raise ValueError(f"EnvStateManager mode must be 'train' or 'val', got {mode!r}")
        plain = to_plain(config)
        sections = read_rollout_sections(plain)
        self.sys_config = plain
        self.mode = mode
        self.format_penalty = sections["es_manager"].format_penalty
        self.base_seed: int = getattr(sections["seed"], mode)
        self.seed_counter = 0
        # only this mode's split, as RAGEN's: a config for it may leave out the other
        maker = EnvSpecMaker(mode, sections["es_manager"].split(mode), plain.get("custom_envs") or {},
                             self.base_seed)
        self.env_groups, self.group_size = maker.env_groups, maker.group_size
        self.envs: list[dict[str, Any]] = []
        self._specs = maker.make_specs(0)
        for spec in self._specs:
            env = make_env(spec.env_type, spec.env_config, config_type=spec.config_type, tag=spec.tag)
            self.envs.append({"tag": spec.tag, "group_id": spec.group_id, "env_id": spec.env_id, "env": env,
                              "config": getattr(env, "config", None), "status": EnvStatus(),
                              "max_actions_per_traj": spec.max_actions_per_traj})
        self._turns = _GivenActions(LoopConfig(format_penalty=self.format_penalty,
                                               max_abs_reward=sections["es_manager"].max_abs_reward,
                                               env_timeout_s=None, env_retries=0), KeptEnvs(), isolate=False)
        self._episodes: list[Episode] = []  # each env's episode since the last reset
        self.rollout_cache: list[dict[str, Any]] | None = None

    def reset(self, seed: int | None = None) -> list[dict[str, Any]]:
        if seed is None:
            if self.mode == "train":
                seed = self.base_seed + self.seed_counter
                self.seed_counter += self.env_groups
            else:
                seed = self.base_seed
        elif self.mode == "train":
            self.seed_counter = seed - self.base_seed + 1  # RAGEN's rule for an explicit seed
        cache, self._episodes = [], []
        for spec, entry in zip(self._specs, self.envs):
            env_seed = seed + entry["group_id"]
            episode = self._turns.start(dataclasses.replace(spec, seed=env_seed))  # the spec's mode is self.mode
            episode.env = entry["env"]
            episode.advance()  # reset
            self._episodes.append(episode)
            entry["status"] = EnvStatus(seed=env_seed)
            cache.append({"env_id": entry["env_id"], "history": [], "group_id": entry["group_id"],
                          "tag": entry["tag"], "penalty": 0})
        for c, entry in zip(cache, self.envs):
            c["history"].append({"state": entry["env"].render(), "actions_left": entry["max_actions_per_traj"]})
        self.rollout_cache = cache
        return cache

    def step(self, all_env_inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.rollout_cache is None:
            raise RuntimeError("EnvStateManager.step before reset()")
        for env_input in all_env_inputs:  # every id first: a bad one steps no env
            self._check_env_id(env_input["env_id"])
            if self._episodes[env_input["env_id"]].ended:
                raise ValueError(f"env_id {env_input['env_id']} has ended since the last reset (done, out of "
                                 "actions, or its env raised): reset before stepping it again")
        return [self.rollout_cache[i["env_id"]] for i in all_env_inputs if not self._step_one(i)]

    def _step_one(self, env_input: dict[str, Any]) -> bool:
        """One env's turn, recorded in its cache and status; whether the env ended (done, or out of
        actions)."""
        env_id = env_input["env_id"]
        entry, cache, episode = self.envs[env_id], self.rollout_cache[env_id], self._episodes[env_id]
        status = entry["status"]
        episode.advance(env_input)
        turn = episode.traj.turns[-1]
        cache["penalty"] += turn.penalty
        status.num_actions += len(turn.executed_actions)
        status.rewards.append(turn.reward)
        if not episode.active:  # done (truncated unless a success), or out of actions (truncated)
            status.terminated = True
            status.truncated = episode.traj.stop_reason != StopReason.DONE or not turn.info.get("success", False)
        executed = [episode.lookup[a.lower()] for a in turn.executed_actions] if episode.lookup is not None \
            else list(turn.executed_actions)  # RAGEN's history holds the ids stepped
        cache["history"][-1].update({"actions": executed, "reward": turn.reward, "info": turn.info,
                                     "llm_response": env_input.get("llm_response"),
                                     "llm_raw_response": env_input.get("llm_raw_response")})
        cache["history"].append({"state": entry["env"].render(),
                                 "actions_left": entry["max_actions_per_traj"] - status.num_actions})
        return not episode.active

    def _check_env_id(self, env_id: Any) -> None:
        """ValueError naming ``env_id`` unless it is one of the envs' ids (their index in ``envs``;
        a negative one would index from the end)."""
        # numpy's ints too: RAGEN's proxy takes the ids from a numpy array
        if isinstance(env_id, bool) or not isinstance(env_id, numbers.Integral) or not 0 <= env_id < len(self.envs):
            raise ValueError(f"env_id {env_id!r} is not an env of this EnvStateManager: its env ids are 0 to "
                             f"{len(self.envs) - 1}")

    def get_rollout_states(self) -> list[dict[str, Any]]:
        if self.rollout_cache is None:
            raise RuntimeError("EnvStateManager.get_rollout_states before reset()")
        for entry, cache in zip(self.envs, self.rollout_cache):
            status = entry["status"]
            metrics: dict[str, float] = {"success": float(status.terminated and not status.truncated),
                                         "num_actions": status.num_actions}
            per_turn: dict[str, list[float]] = {}
            for turn in cache["history"]:
                for k, v in turn.get("info", {}).items():
                    if k != "success" and isinstance(v, (int, float)):  # a text (a reason, a status) has no mean
                        per_turn.setdefault(k, []).append(float(v))
            for k, values in per_turn.items():  # the mean over turns (the last entry is a state, not a turn)
                metrics[k] = sum(values) / max(1, len(cache["history"]) - 1)
            cache["history"][-1]["metrics"] = per_turn
            cache["metrics"] = {f"{entry['tag']}/{k}": v for k, v in metrics.items()}
        groups: dict[tuple[str, int], bool] = {}
        for entry, cache in zip(self.envs, self.rollout_cache):
            key = (entry["tag"], entry["group_id"])
            groups[key] = groups.get(key, False) or bool(cache["metrics"][f"{entry['tag']}/success"])
        for entry, cache in zip(self.envs, self.rollout_cache):
            cache["metrics"][f"{entry['tag']}/pass@{self.group_size}"] = float(groups[(entry["tag"], entry["group_id"])])
        return self.rollout_cache

    def render(self) -> list[Any]:
        return [entry["env"].render() for entry in self.envs]

    def close(self) -> None:
        for entry in self.envs:
            entry["env"].close()


class _GivenActions(EnvTurns):
    """The turns of an ``EnvStateManager``'s episodes: each env is the manager's own, reset
    in the calling thread; an answer is RAGEN's env input, whose actions its caller parsed
    (RAGEN's ``ContextManager`` builds the prompts, so the episode asks for none); an env's
    exception reaches the caller, as in RAGEN's."""

    max_turn = None  # RAGEN's proxy decides how many turns it asks for

    def reset(self, episode: Episode) -> None:
        reset_env(episode, self.call)

    def request(self, episode: Episode) -> None:  # type: ignore[override]
        return None

    def apply(self, episode: Episode, env_input: dict[str, Any]) -> Played:  # type: ignore[override]
        answer = Completion(text=env_input.get("llm_response") or "", prompt_token_ids=[], response_token_ids=[],
                            finish_reason="stop", policy_version=0, env_id=int(env_input["env_id"]))
        return apply_actions(episode, list(env_input.get("actions", [])), answer, self.config.format_penalty,
                             self.call, max_abs_reward=self.config.max_abs_reward)

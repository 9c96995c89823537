"""EnvSpecMaker: which envs a rollout plays, with which seeds, and what their
trajectories add up to (RAGEN's ``EnvStateManager`` interface, over the same
seeds, is ``ragen.rollout.env_state``).

One maker per split (``train`` / ``val``), from ``es_manager.<split>``:
``env_groups`` groups of ``group_size`` envs; ``env_configs.tags`` with
``n_groups`` (summing to ``env_groups``) says which ``custom_envs`` tag each
group plays. Members of a group share one seed (so one initial state, as
GRPO needs); groups differ: group ``g`` gets ``seed.<split> + g``. As in
RAGEN, training seeds advance ``env_groups`` every rollout, and validation
plays the same seeds every time (one fixed validation set).

``make_specs()`` returns the ``EnvSpec`` list of the next rollout (plain data,
sent to workers); the scheduler in ``ragen.rollout.scheduler`` plays them;
``compute_metrics`` reduces the trajectories to stable metric names.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, defaultdict
from typing import Any, Mapping, Sequence

from ragen.config_reader import read, to_plain
from ragen.errors import ConfigError
from ragen.llm.tool_calls import declared_tools
from ragen.rollout.config import EnvSplitConfig, EnvTagConfig
from ragen.rollout.context import ContextConfig
from ragen.rollout.types import AGENT_ENV_TYPE, EnvSpec, StopReason, Trajectory

logger = logging.getLogger(__name__)


class EnvSpecMaker:
    """Makes the ``EnvSpec``s of one split's env set: which tag each group plays and which seed it gets.

    It holds the split's group layout (``env_groups`` x ``group_size``, a tag
    per group) and a count of rollouts made, from which seeds advance;
    ``state_dict`` is that count. The envs themselves are built and stepped by
    the turn loop in the workers, from the plain specs made here
    (``make_specs`` for a whole rollout, ``group_specs`` for the fully-async
    stream of groups).
    """

    def __init__(self, split: str, split_cfg: EnvSplitConfig | Mapping, custom_envs: Mapping, seed: int) -> None:
        self.split = split
        key = f"es_manager.{split}"
        cfg = read(EnvSplitConfig, split_cfg, key)
        cfg.check_env_count(key)
        self.env_groups = cfg.env_groups
        self.group_size = cfg.group_size
        tags = list(cfg.env_configs.tags)
        n_groups = list(cfg.env_configs.n_groups)
        if not tags:
            raise ValueError(f"{key}.env_configs.tags is empty: name at least one tag of custom_envs")
        if len(tags) != len(n_groups):
            raise ValueError(f"{key}.env_configs: {len(tags)} tags but {len(n_groups)} n_groups entries")
        if sum(n_groups) != self.env_groups:
            raise ValueError(
                f"{key}.env_configs.n_groups sums to {sum(n_groups)} but {key}.env_groups is {self.env_groups}"
            )
        custom_envs = to_plain(custom_envs) or {}
        self.tag_specs: dict[str, dict[str, Any]] = {}
        for tag in tags:
            if tag not in custom_envs:
                raise ValueError(
                    f"{key}.env_configs.tags: tag {tag!r} is not in custom_envs (known: {sorted(custom_envs)})"
                )
            self.tag_specs[tag] = _validate_tag(tag, custom_envs[tag], custom_envs)
        self.group_tags = [tag for tag, n in zip(tags, n_groups) for _ in range(n)]
        self.base_seed = int(seed)
        self._rollouts = 0
        self._lock = threading.Lock()
        self.quarantine = None  # a ragen.rollout.fill.Quarantine: its (tag, seed) are dealt another seed
        self._refill_at = self._refill_end = 0  # the seeds set aside for refills (refill_specs), by index

    def check_context(self, context: ContextConfig) -> None:
        """ValueError naming the key when the prompt settings cannot play a tag: a tool env's
        conversation (its tool messages) is shown whole."""
        for tag, ts in self.tag_specs.items():
            if ts["tools"] and context.context_window_mode != "full":
                raise ValueError(f"custom_envs.{tag} declares tools, whose results are tool messages in the whole "
                                 f"conversation: set agent_proxy.context_window_mode=full (it is "
                                 f"{context.context_window_mode})")

    def check_agents(self, ap: Any) -> None:
        """``ConfigError`` naming the key where ``agent_proxy`` (an ``AgentProxyConfig``) asks of this
        split's agent tags what they do not do: be carried unfinished to the next rollout
        (over-sampling), or stream as groups in flight (fully-async)."""
        agents = sorted(tag for tag, ts in self.tag_specs.items() if ts["env_type"] == AGENT_ENV_TYPE)
        if not agents:
            return
        if ap.rollout_mode == "fully_async":
            raise ConfigError(f"agent_proxy.rollout_mode=fully_async: the agent tags {agents} of es_manager."
                              f"{self.split} play whole rollouts; use rollout_mode=sync (async_generation_ratio "
                              "generates batches ahead with them)")
        if ap.over_sample > 1 and self.split == "train":
            raise ConfigError(f"agent_proxy.over_sample={ap.over_sample:g}: an agent program cannot be stopped and "
                              f"carried into the next rollout, and es_manager.train plays the agent tags {agents}; "
                              "set over_sample=1.0")

    @property
    def num_envs(self) -> int:
        return self.env_groups * self.group_size

    def make_specs(self, rollout_index: int | None = None) -> list[EnvSpec]:
        """Specs of the next rollout (training seeds advance by ``env_groups``
        each time; validation's stay), or of rollout number ``rollout_index``
        (same index, same seeds)."""
        if rollout_index is None:
            with self._lock:
                rollout_index = self._rollouts if self.split == "train" else 0
                self._rollouts += 1
        return [s for g in range(self.env_groups) for s in self._group(rollout_index, g, group_id=g)]

    def group_specs(self, index: int) -> list[EnvSpec]:
        """Group number ``index`` of an endless stream of groups (fully-async
        rollout): group ``g`` of rollout ``r`` is number ``r * env_groups + g``,
        with that rollout's seed; group ids and env_ids are unique in the stream."""
        rollout_index, g = divmod(index, self.env_groups)
        return self._group(rollout_index, g, group_id=index)

    def refill_specs(self, tags: Sequence[str], first_group_id: int) -> list[EnvSpec]:
        """Fresh groups of ``tags``, one each, numbered from ``first_group_id`` (refills, and the
        groups an over-sampled rollout starts past ``env_groups``). Their seeds follow one
        another through blocks of a training rollout's seeds set aside for them (a block used
        up sets the next one aside), so these groups never take the seeds of a slot, which
        share their remainder by env_groups, nor a seed twice."""
        taken = []
        with self._lock:
            for _ in tags:
                if self._refill_at >= self._refill_end:  # the next training rollout's seeds, for refills
                    self._refill_at = self._rollouts * self.env_groups
                    self._refill_end = self._refill_at + self.env_groups
                    self._rollouts += 1
                taken.append(self._refill_at)
                self._refill_at += 1
        return [s for k, (tag, at) in enumerate(zip(tags, taken))
                for s in self._group(at // self.env_groups, at % self.env_groups, group_id=first_group_id + k,
                                     tag=tag)]

    def _group(self, rollout_index: int, g: int, group_id: int, tag: str | None = None) -> list[EnvSpec]:
        """Group ``g`` of rollout ``rollout_index``, of its slot's tag or ``tag``."""
        tag = tag or self.group_tags[g]
        seed = dealt = self.base_seed + rollout_index * self.env_groups + g
        # a quarantined seed: the same slot of a later rollout (bounded: each step passes one held key)
        while self.quarantine is not None and self.quarantine.holds(tag, seed):
            seed += self.env_groups
        return [spec_of(tag, self.tag_specs[tag], seed, env_id=group_id * self.group_size + m, group_id=group_id,
                        mode=self.split, replaces_seed=dealt if seed != dealt else None)
                for m in range(self.group_size)]

    def group_seeds(self, rollout_index: int) -> list[tuple[str, int]]:
        """(tag, seed) of each group of rollout number ``rollout_index``, in group order."""
        return [(tag, self.base_seed + rollout_index * self.env_groups + g) for g, tag in enumerate(self.group_tags)]

    def state_dict(self) -> dict[str, int]:
        """The rollouts made, and where the seeds set aside for refills stand (a checkpoint's)."""
        return {"rollouts": self._rollouts, "refill_at": self._refill_at, "refill_end": self._refill_end}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self._rollouts = int(state["rollouts"])
        self._refill_at, self._refill_end = int(state.get("refill_at", 0)), int(state.get("refill_end", 0))


def tag_spec(tag: str, custom_envs: Mapping) -> dict[str, Any]:
    """What every env of ``tag`` shares, read from ``custom_envs[tag]`` (ValueError naming
    the tag when it is not there or its entry is bad)."""
    custom_envs = to_plain(custom_envs) or {}
    if tag not in custom_envs:
        raise ValueError(f"tag {tag!r} is not in custom_envs (known: {sorted(custom_envs)})")
    return _validate_tag(tag, custom_envs[tag], custom_envs)


def spec_of(tag: str, ts: Mapping[str, Any], seed: int, env_id: int = 0, group_id: int = 0,
            mode: str = "train", replaces_seed: int | None = None) -> EnvSpec:
    """The ``EnvSpec`` of one env of ``tag`` (its ``tag_spec`` ``ts``) with ``seed``."""
    return EnvSpec(env_id=env_id, group_id=group_id, tag=tag, seed=seed,
                   env_type=ts["env_type"], env_config=ts["env_config"], config_type=ts["config_type"],
                   max_actions_per_traj=ts["max_actions_per_traj"], env_instruction=ts["env_instruction"],
                   state_legend=ts["state_legend"], action_names=ts["action_names"],
                   max_tokens=ts["max_tokens"], format_example=ts["format_example"],
                   env_threads=ts["env_threads"], mode=mode, tools=ts["tools"], replaces_seed=replaces_seed)


def _validate_tag(tag: str, spec: Any, custom_envs: Mapping[str, Any]) -> dict[str, Any]:
    from ragen.env import make_env_config

    key = f"custom_envs.{tag}"
    served = _served_tag(spec, custom_envs)
    if served is not None:  # what the remote tag leaves out is the served tag's
        spec = {**{k: v for k, v in served.items() if k not in ("env_type", "config_type", "env_config")}, **spec}
    cfg = read(EnvTagConfig, spec, key)
    env_config = cfg.env_config or {}
    if cfg.env_type == AGENT_ENV_TYPE:
        return _agent_tag(tag, cfg, env_config)
    # Builds (and so validates) the config now, before any model loads.
    built = make_env_config(cfg.env_type, env_config, config_type=cfg.config_type, tag=tag)
    if served is not None:
        served_type, served_config_type = served.get("env_type"), served.get("config_type")
        served_built = make_env_config(served_type, served.get("env_config") or {}, config_type=served_config_type,
                                       tag=env_config["tag"])
        legend, action_names = _prompt_parts(served_type, served_config_type, env_config["tag"], served_built)
        tools = declared_tools(served_built, key)
    else:
        legend, action_names = _prompt_parts(cfg.env_type, cfg.config_type, tag, built)
        tools = declared_tools(built, key)
    example = cfg.format_example
    if example is not None:
        if not isinstance(example, dict) or not isinstance(example.get("observation"), str) \
                or not isinstance(example.get("answer"), str):
            raise ValueError(f"{key}.format_example must have 'observation' and 'answer' strings")
        unknown = sorted(set(example) - {"observation", "answer"})
        if unknown:
            raise ValueError(f"{key}.format_example.{unknown[0]}: unknown key; it takes 'observation' and 'answer'")
        example = (example["observation"], example["answer"])
    return {
        "format_example": example,
        "env_type": cfg.env_type,
        "config_type": cfg.config_type,
        "env_config": env_config,
        "max_actions_per_traj": cfg.max_actions_per_traj,
        "env_instruction": cfg.env_instruction or "",
        "state_legend": legend,
        "action_names": action_names,
        "max_tokens": cfg.max_tokens,
        "env_threads": cfg.max_workers if cfg.parallel_friendly else 1,
        "tools": tools,
    }


def _agent_tag(tag: str, cfg: EnvTagConfig, env_config: Mapping[str, Any]) -> dict[str, Any]:
    """An ``env_type: agent`` tag's spec fields, its program and tasks checked now (a ``ConfigError``
    naming the key: an entry that does not import, a tasks file missing, empty or with a bad line)."""
    from ragen.agents.config import AgentConfig

    if cfg.max_tokens is not None:
        raise ConfigError(f"custom_envs.{tag}.max_tokens: an agent's answers are bounded by the max_tokens of its "
                          "own calls and ctx_manager.generation.response_length; leave this key out")
    agent = AgentConfig.read(tag, env_config)
    env_config = agent.portable(env_config)  # its files as the driver found them
    return {"format_example": None, "env_type": AGENT_ENV_TYPE, "config_type": None, "env_config": env_config,
            "max_actions_per_traj": cfg.max_actions_per_traj, "env_instruction": "", "state_legend": "",
            "action_names": None, "max_tokens": cfg.max_tokens, "env_threads": 1, "tools": None}


def _served_tag(spec: Any, custom_envs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``custom_envs`` entry of the tag a remote tag plays (``env_type: remote``,
    ``env_config.tag``), when this config has it and it is not remote itself: the
    remote tag takes its prompt (instruction, legend, action names) and the tag keys
    it does not set (``max_actions_per_traj``, ``max_tokens``, ...) from it, so that
    it plays what the local tag plays."""
    if not isinstance(spec, Mapping) or spec.get("env_type") != "remote":
        return None
    env_config = spec.get("env_config")
    name = env_config.get("tag") if isinstance(env_config, Mapping) else None
    served = custom_envs.get(name) if isinstance(name, str) else None
    if not isinstance(served, Mapping) or served.get("env_type") in (None, "remote"):
        return None
    return dict(served)


COORD_HINT = ("\nStates are provided as coordinate lists using zero-based indexing with the format (row, col) for "
              "each entity type: Walls, Targets, Boxes, Boxes on target, Player, and Player on target when applicable.")


def _prompt_parts(env_type: str, config_type: str | None, tag: str,
                  built: Any) -> tuple[str, tuple[str, ...] | None]:
    """What RAGEN adds to a tag's system message: the meaning of the grid
    symbols (``observation_format: grid``) or the coordinate hint (``coord``),
    and the action names. As in RAGEN, these come from the DEFAULTS of the
    env's config class, not from the tag's config (``built``, read only for a
    config class that has no defaults for its required fields). An env
    without a config class (RAGEN needs one) lists its class's ``ACTION_LOOKUP``."""
    from ragen.env import make_env_config, resolve_env_type

    env_cls, config_cls = resolve_env_type(env_type, config_type, tag)
    if config_cls is None:
        lookup = getattr(env_cls, "ACTION_LOOKUP", None)
        return "", (tuple(str(v) for v in lookup.values()) if isinstance(lookup, Mapping) and lookup else None)
    try:
        defaults = make_env_config(env_type, None, config_type=config_type, tag=tag)
    except ValueError:
        defaults = built
    get = defaults.get if isinstance(defaults, Mapping) else (lambda key: getattr(defaults, key, None))
    fmt = get("observation_format") or "grid"
    vocab, lookup = get("grid_vocab"), get("action_lookup")
    legend = ""
    if fmt == "grid" and vocab:
        legend = "\nThe meaning of each symbol in the state is:\n" + ", ".join(f"{k}: {v}" for k, v in vocab.items())
    if fmt == "coord":
        legend = COORD_HINT
    # a user's env type (ours follow RAGEN's: Bandit's observation names its arms)
    if not lookup and ":" in env_type and isinstance(getattr(env_cls, "ACTION_LOOKUP", None), Mapping):
        logger.warning("custom_envs.%s: the prompt does not list the actions of %s.ACTION_LOOKUP, as in RAGEN: "
                       "its config class %s has no action_lookup default (add one to list them)",
                       tag, env_cls.__name__, config_cls.__name__)
    return legend, (tuple(str(v) for v in lookup.values()) if lookup else None)


def compute_metrics(trajectories: Sequence[Trajectory], prefix: str = "rollout") -> dict[str, float]:
    """Stable metric names: ``<prefix>/success``, ``<prefix>/<tag>/success``,
    ``<prefix>/stop/<reason>``, ... over one rollout's trajectories, and what their steps
    cost (``cost_metrics``)."""
    m: dict[str, float] = {}
    if not trajectories:
        return m
    n = len(trajectories)
    by_tag: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_tag[t.tag].append(t)

    def reduce(trajs: Sequence[Trajectory], p: str) -> None:
        k = len(trajs)
        m[f"{p}/success"] = sum(t.success for t in trajs) / k
        m[f"{p}/reward"] = sum(t.reward for t in trajs) / k
        m[f"{p}/num_actions"] = sum(t.num_actions for t in trajs) / k
        m[f"{p}/num_turns"] = sum(len(t.turns) for t in trajs) / k
        parsed = sum(len(tn.actions) for t in trajs for tn in t.turns)
        executed = sum(len(tn.executed_actions) for t in trajs for tn in t.turns)
        m[f"{p}/valid_action_ratio"] = executed / parsed if parsed else 0.0
        m[f"{p}/n_trajectories"] = float(k)

    reduce(trajectories, prefix)
    for tag, trajs in sorted(by_tag.items()):
        reduce(trajs, f"{prefix}/{tag}")
    stops = Counter(t.stop_reason for t in trajectories)
    for reason in StopReason:
        m[f"{prefix}/stop/{reason.value}"] = float(stops.get(reason, 0))
    m[f"{prefix}/env_steps"] = float(sum(t.num_actions for t in trajectories))
    assert sum(stops.values()) == n
    m.update(cost_metrics(trajectories))
    return m


def cost_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """What envs said their steps cost (``Turn.costs``): each name's ``costs/<name>_sum``, ``_n``
    and nearest-rank percentiles ``_p50``, ``_p90``, ``_p99``."""
    values: dict[str, list[float]] = {}
    for t in trajectories:
        for turn in t.turns:
            for name, costs in turn.costs.items():
                values.setdefault(name, []).extend(costs)
    m: dict[str, float] = {}
    for name, v in sorted(values.items()):
        v.sort()
        m[f"costs/{name}_sum"] = sum(v)
        m[f"costs/{name}_n"] = float(len(v))
        for q in (50, 90, 99):  # nearest rank
            m[f"costs/{name}_p{q}"] = v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]
    return m

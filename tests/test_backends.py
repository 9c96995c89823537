"""The rollout backends: one interface, one factory, the same trajectories from every one."""

from __future__ import annotations

import logging
import re
import socket

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm_agent import AgentSetup, LLMAgentProxy
from ragen.rollout.backends import (FullyAsync, FullyAsyncSettings, GenerateAhead, ParallelRolloutManager,
                                    ParallelSettings, RolloutBackend, SequentialRollout, SyncBackend, make_backend)
from ragen.rollout.config import RolloutPlan

from tests.rollout_helpers import agent_setup

MODES = {
    "sequential": ({}, SequentialRollout, SequentialRollout),
    "parallel": ({"use_parallel_rollout": True}, ParallelRolloutManager, ParallelRolloutManager),
    "generate_ahead": ({"async_generation_ratio": 1}, GenerateAhead, SequentialRollout),
    "parallel_ahead": ({"use_parallel_rollout": True, "async_generation_ratio": 2}, GenerateAhead,
                       ParallelRolloutManager),
    "fully_async": ({"rollout_mode": "fully_async", "parallel_backend": "threading"}, FullyAsync,
                    SequentialRollout),
}


def setup_for(**agent_proxy) -> AgentSetup:
    return agent_setup(**agent_proxy)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_factory_builds_the_backend_the_config_names(mode):
    keys, outer, inner = MODES[mode]
    setup = setup_for(**keys)
    backend = make_backend(setup.agent_proxy, ScriptedEngine(), setup.llm_server, setup.cluster)
    try:
        assert isinstance(backend, RolloutBackend) and type(backend) is outer
        assert type(getattr(backend, "inner", backend)) is inner
        # the shared manager exists where workers need it (parallel, fully-async), and only there
        needs_serving = keys.get("use_parallel_rollout", False) or mode == "fully_async"
        assert (backend.serving is not None) == needs_serving
    finally:
        backend.close()
    if needs_serving:  # the shared manager built for it stops listening with it
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(backend.serving.address, timeout=5).close()


@pytest.mark.parametrize("keys,plan", [
    ({}, RolloutPlan()),
    ({"use_parallel_rollout": True}, RolloutPlan(workers=True)),
    ({"async_generation_ratio": 2}, RolloutPlan(ahead="batches", bound=2)),
    ({"use_parallel_rollout": True, "async_generation_ratio": 1}, RolloutPlan(True, "batches", 1)),
    ({"rollout_mode": "fully_async"}, RolloutPlan(ahead="groups", bound=1)),
    ({"rollout_mode": "fully_async", "async_generation_ratio": 3, "use_parallel_rollout": True},
     RolloutPlan(True, "groups", 3)),
])
def test_ragens_three_knobs_map_once_into_one_plan(keys, plan):
    """Where episodes run, and how far generation runs ahead (and so whether a shared manager serves)."""
    from ragen.config_reader import read
    from ragen.rollout.config import AgentProxyConfig

    assert read(AgentProxyConfig, keys, "agent_proxy").plan == plan
    assert plan.serves == (plan.workers or plan.ahead == "groups")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["parallel", "fully_async"])
def test_a_backend_gets_its_frozen_settings_and_its_serving_at_construction(mode, monkeypatch):
    """Each backend is built with one frozen settings record cut from the config, and the shared
    manager it talks to; nothing is set on it afterwards."""
    import dataclasses

    keys, _, _ = MODES[mode]
    ap = setup_for(**keys, rollout_timeout_s=30.0, max_concurrent_rollouts=2).agent_proxy
    built: list = []
    real_init = SyncBackend.__init__

    def recording_init(self, *args, **kw):
        real_init(self, *args, **kw)
        built.append((self, self.serving))  # what the backend has when its construction ends

    monkeypatch.setattr(SyncBackend, "__init__", recording_init)
    backend = make_backend(ap, ScriptedEngine())
    monkeypatch.undo()
    try:
        (sync, serving_at_construction), = built
        assert serving_at_construction is not None and serving_at_construction is backend.serving
        if mode == "parallel":
            assert sync is backend and backend.settings == ParallelSettings.of(ap)
            assert (backend.settings.rollout_timeout_s, backend.settings.max_concurrent_rollouts) == (30.0, 2)
            with pytest.raises(dataclasses.FrozenInstanceError):
                backend.settings.n_jobs = 3
        else:
            assert sync is backend.inner and isinstance(sync, SequentialRollout)
            assert sync.engine_lock is backend.serving.engine_lock
            assert backend._flight == FullyAsyncSettings.of(ap) and backend.bound.bound == ap.plan.bound
    finally:
        backend.close()


@pytest.mark.timeout(300)
def test_every_backend_plays_a_list_of_specs_to_the_same_trajectories():
    """Validation passes a list of specs: every backend plays exactly those,
    with the same results as RAGEN's sequential loop."""
    results = {}
    for mode, (keys, _, _) in sorted(MODES.items()):
        with LLMAgentProxy(setup_for(**keys), ScriptedEngine()) as proxy:
            results[mode] = proxy.rollout("val", rollout_index=2)
    reference = results.pop("sequential")
    for mode, result in results.items():
        assert result.specs == reference.specs, mode
        assert result.trajectories == reference.trajectories, mode


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["generate_ahead", "fully_async"])
def test_an_asynchronous_backend_draws_from_one_env_set(mode):
    keys, _, _ = MODES[mode]
    setup = setup_for(**keys)
    with LLMAgentProxy(setup, ScriptedEngine()) as proxy:
        batch = proxy.next_train_batch(0)
        assert len(batch.trajectories) == setup.es["train"].num_envs
        with pytest.raises(ValueError, match="one env set"):
            proxy.backend.rollout(setup.es["val"], setup.val_loop)


def _test_hooks_in(path) -> list[str]:
    """Where the code of ``path`` names a ``fault``: a parameter, a field or an attribute."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.arg) and node.arg == "fault" \
                or isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "fault" \
                or isinstance(node, ast.Attribute) and node.attr == "fault" \
                or isinstance(node, ast.keyword) and node.arg == "fault":
            found.append(f"{path}:{node.lineno}")
    return found


def test_no_production_signature_carries_a_fault_to_inject():
    """Faults are injected by envs (tests/fault_envs.py) or hooks the tests install, never by an
    argument of the rollout, the scheduler or a worker task."""
    import inspect
    from pathlib import Path

    import ragen
    from ragen.rollout.backends.base import AsyncBackend, SyncBackend
    from ragen.rollout.scheduler import Scheduler, run_envs
    from ragen.rollout.workers.task import WorkerTask

    for fn in (LLMAgentProxy.rollout, RolloutBackend.rollout, SyncBackend.rollout, AsyncBackend.rollout, run_envs):
        assert "fault" not in inspect.signature(fn).parameters, fn.__qualname__
    for record in (WorkerTask, Scheduler):
        assert "fault" not in inspect.signature(record).parameters, record.__name__
    assert [hit for path in sorted(Path(ragen.__file__).parent.rglob("*.py")) for hit in _test_hooks_in(path)] == []


@pytest.mark.timeout(120)
def test_the_engine_counts_that_matter_at_zero_are_reported_as_zero_and_the_log_says_what_is_summed(caplog):
    """docs/engines.md names engine/token_prompt_fallbacks as a rollout metric: 0 (every prompt went as
    token ids) is an answer, not an absent key. The summary line's env and waiting times add up the
    workers' and may pass the rollout's wall time: it says so."""
    caplog.set_level(logging.INFO, logger="ragen.rollout.backends.base")
    with LLMAgentProxy(setup_for(), ScriptedEngine()) as proxy:
        result = proxy.rollout("val", rollout_index=0)
    assert result.metrics["engine/token_prompt_fallbacks"] == 0.0
    assert result.metrics["engine/history_divergences"] == 0.0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("[Rollout] val:"))
    assert re.search(r"\| summed over workers: env [\d.]+ s, waiting for the model [\d.]+ s \|", line), line


@pytest.mark.timeout(120)
def test_with_replicas_the_summary_line_counts_failovers_even_without_later_turns(caplog):
    """One-turn episodes have no later turns to route back, but failovers still happen and 0 is news."""
    from ragen.llm.replicas import ReplicatedEngine

    caplog.set_level(logging.INFO, logger="ragen.rollout.backends.base")
    engine = ReplicatedEngine([ScriptedEngine(), ScriptedEngine()])
    try:
        with LLMAgentProxy(setup_for(max_turn=1), engine) as proxy:
            result = proxy.rollout("val", rollout_index=0)
    finally:
        engine.close()
    assert "engine/replica_affinity" not in result.metrics and result.metrics["engine/replica_failovers"] == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("[Rollout] val:"))
    assert "| replicas: 0 failovers |" in line, line

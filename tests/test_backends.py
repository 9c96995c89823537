"""The rollout backends: one interface, one factory, the same trajectories from every one."""

from __future__ import annotations

import socket

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm_agent import AgentSetup, LLMAgentProxy
from ragen.rollout.backends import (FullyAsync, GenerateAhead, ParallelRolloutManager, RolloutBackend,
                                    SequentialRollout, make_backend)

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


@pytest.mark.timeout(120)
def test_fault_injection_needs_the_parallel_backend():
    with LLMAgentProxy(setup_for(), ScriptedEngine()) as proxy:
        with pytest.raises(ValueError, match="use_parallel_rollout"):
            proxy.rollout("val", fault={"worker": 0, "exit_at_turn": 1})

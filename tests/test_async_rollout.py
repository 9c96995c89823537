"""Asynchronous rollout: generate-ahead bounded by policy lag, and the
fully-async rollout that never loses or duplicates a group."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm_agent import AgentSetup, LLMAgentProxy
from ragen.rollout.backends import SequentialRollout
from ragen.rollout.backends.ahead import RolloutAhead, staleness

from tests.rollout_helpers import custom_envs


def setup_for(**agent_proxy) -> AgentSetup:
    cfg = {
        "custom_envs": custom_envs(),
        "seed": {"train": 5, "val": 9},
        "agent_proxy": {"max_turn": 3, "parallel_n_jobs": 2, "pipeline_depth": 1, **agent_proxy},
        "es_manager": {
            "train": {"env_groups": 4, "group_size": 2,
                      "env_configs": {"tags": ["SimpleSokoban", "FrozenLake"], "n_groups": [2, 2]}},
            "val": {"env_groups": 2, "group_size": 1, "env_configs": {"tags": ["Bandit"], "n_groups": [2]}},
        },
    }
    return AgentSetup.from_config(cfg)


def update(proxy, engine):
    with proxy.engine_lock:
        return engine.bump_policy_version()


def test_k0_is_the_synchronous_pipeline():
    threads_before = set(threading.enumerate())
    a, b = ScriptedEngine(), ScriptedEngine()
    with LLMAgentProxy(setup_for(), a) as sync, LLMAgentProxy(setup_for(async_generation_ratio=0), b) as k0:
        for _ in range(3):
            assert k0.next_train_batch(b.policy_version).trajectories == sync.rollout("train").trajectories
            update(sync, a), update(k0, b)
        assert isinstance(k0.backend, SequentialRollout)  # no backend around it that generates ahead
        new_threads = [t.name for t in set(threading.enumerate()) - threads_before]
        assert "ragen-rollout-ahead" not in new_threads  # k = 0 generates nothing in the background
        assert "async/produced" not in k0.async_metrics()


def test_k1_never_trains_on_data_more_than_one_version_old():
    engine = ScriptedEngine(base_s=0.01)
    with LLMAgentProxy(setup_for(async_generation_ratio=1, use_parallel_rollout=True), engine) as proxy:
        seeds = []
        for step in range(6):
            batch = proxy.next_train_batch(engine.policy_version)
            assert staleness(batch.trajectories, engine.policy_version) <= 1
            seeds.append(batch.trajectories[0].seed)
            time.sleep(0.05)  # the "training step"
            if step == 2:
                with proxy.generation_paused():
                    proxy.rollout("val")
            update(proxy, engine)
        m = proxy.async_metrics()
    assert seeds == sorted(set(seeds))  # batches come in order, none repeated
    # the first batch is not ready when the trainer first asks: it waits for a whole rollout
    assert m["async/staleness_max"] <= 1 and m["async/trainer_wait_s"] > 0 and "async/generator_wait_s" in m
    # every batch handed out or dropped was produced; at most k = 1 more waits in the queue
    assert 6 + m["async/dropped_stale"] <= m["async/produced"] <= 6 + m["async/dropped_stale"] + 1


def test_ahead_drops_batches_older_than_k():
    class Fake:
        def __init__(self, version):
            self.trajectories = [type("T", (), {"turns": [type("U", (), {"policy_version": version, "response_ids": (1, 2)})()]})()]

    versions = iter([0, 0, 5, 5])
    ahead = RolloutAhead(lambda: Fake(next(versions)), 1)
    try:
        got = ahead.get(5)  # versions 0 are 5 behind: dropped until a fresh batch comes
        assert staleness(got.trajectories, 5) == 0 and ahead.bound.dropped == 2 and ahead.bound.tokens_dropped == 4
    finally:
        ahead.close()


def _get_within(ahead: RolloutAhead, version: int, within_s: float = 5.0):
    """``ahead.get(version)`` in a helper thread: its result or its exception,
    or a failure if it has not returned within ``within_s`` (a blocked get)."""
    out: dict = {}

    def run():
        try:
            out["result"] = ahead.get(version)
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within_s)
    assert not t.is_alive(), f"RolloutAhead.get blocked for more than {within_s} s"
    return out


@pytest.mark.timeout(30)
def test_ahead_after_a_failed_rollout_raises_on_every_get():
    """The batches made before the failure come first; then the failure, on
    this get and every later one (the second one blocked for good)."""
    class Fake:
        trajectories: list = []

    calls = iter([Fake(), RuntimeError("rollout failed"), Fake()])

    def produce():
        item = next(calls)
        if isinstance(item, BaseException):
            raise item
        return item

    ahead = RolloutAhead(produce, 2)
    try:
        assert isinstance(_get_within(ahead, 0).get("result"), Fake)
        for _ in range(3):
            error = _get_within(ahead, 0).get("error")
            assert isinstance(error, RuntimeError) and "rollout failed" in str(error)
        assert ahead.stats.produced == 1  # nothing generated after the failure
    finally:
        ahead.close()
    # after close: an error, not a wait for a batch that will never come
    assert isinstance(_get_within(ahead, 0).get("error"), RuntimeError)


@pytest.mark.timeout(120)
def test_fully_async_in_flight_groups_far_above_the_cores_cap_its_workers_with_a_warning(caplog):
    import joblib

    from ragen.rollout.config import MAX_JOBS_PER_CORE

    cap = MAX_JOBS_PER_CORE * joblib.cpu_count()
    engine = ScriptedEngine()
    setup = setup_for(rollout_mode="fully_async", max_inflight_groups=10**6, parallel_backend="threading",
                      async_generation_ratio=1)
    with caplog.at_level(logging.WARNING, logger="ragen.rollout.config"):
        with LLMAgentProxy(setup, engine) as proxy:
            batch = proxy.next_train_batch(engine.policy_version)
            workers = threading.active_count()
    assert len({t.group_id for t in batch.trajectories}) == setup.es["train"].env_groups
    assert workers < cap + 20  # the pool's threads, and the few of the manager and the scheduler
    assert any(f"agent_proxy.max_inflight_groups={10**6}" in r.getMessage() and f"capped at {cap}" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("backend", ["loky", "threading"])
def test_fully_async_loses_and_duplicates_nothing(backend):
    engine = ScriptedEngine(base_s=0.01)
    setup = setup_for(rollout_mode="fully_async", max_inflight_groups=6, parallel_backend=backend,
                      async_generation_ratio=1)
    seen: list[int] = []
    with LLMAgentProxy(setup, engine) as proxy:
        for _ in range(5):
            batch = proxy.next_train_batch(engine.policy_version)
            groups = sorted({t.group_id for t in batch.trajectories})
            assert len(groups) == setup.es["train"].env_groups
            for t in batch.trajectories:  # whole groups, never half-done
                assert sum(x.group_id == t.group_id for x in batch.trajectories) == 2
                versions = [x.policy_version for x in t.turns]
                assert not versions or max(versions) - min(versions) <= 1  # at most max_version_span apart
            seen += groups
            time.sleep(0.02)
            update(proxy, engine)
    m = proxy.async_metrics()  # after close: the scheduler has stopped, the counts are final
    started = m["async/groups_started"]
    completed = m["async/groups_completed"]
    restarted = m["async/groups_restarted"]
    handed_out = m["async/groups_handed_out"]
    queued = m["async/queued_groups"]
    dropped = m["async/dropped_stale"]
    assert len(seen) == len(set(seen))  # no group trained twice
    # every started group: restarted, trained, still queued, dropped as stale, or in flight at close
    assert completed <= started - restarted
    assert started - restarted - completed <= setup.agent_proxy.max_inflight_groups  # in flight at close
    assert completed >= len(seen) + dropped
    assert handed_out == len(seen) + dropped  # each group handed out is trained on or dropped
    assert queued == completed - handed_out  # each completed group is handed out or still queued
    # the lowest-numbered groups come first
    assert seen[: setup.es["train"].env_groups] == sorted(seen[: setup.es["train"].env_groups])


def _children() -> set[int]:
    me = os.getpid()
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        out.add(int(pid))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_shutdown_mid_step_leaves_nothing_behind():
    before_threads = {t.ident for t in threading.enumerate()}
    before_children = _children()
    engine = ScriptedEngine(base_s=0.05)
    proxy = LLMAgentProxy(setup_for(rollout_mode="fully_async", max_inflight_groups=4), engine)
    proxy.next_train_batch(0)
    ahead_proxy = LLMAgentProxy(setup_for(async_generation_ratio=2, use_parallel_rollout=True), engine)
    ahead_proxy.next_train_batch(0)
    time.sleep(0.1)  # both are generating in the background now
    proxy.close()
    ahead_proxy.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        extra_threads = [t for t in threading.enumerate() if t.ident not in before_threads and t.is_alive()
                         and t.name.startswith("ragen")]
        extra_children = _children() - before_children
        if not extra_threads and not extra_children:
            break
        time.sleep(0.2)
    assert not extra_threads, extra_threads
    assert not extra_children, extra_children


class UpdatedEveryCall(ScriptedEngine):
    """A weight update lands after every engine call: every group of several turns is interrupted
    between each two of its turns."""

    def generate(self, requests, sampling):
        completions = super().generate(requests, sampling)
        self.bump_policy_version()
        return completions


@pytest.mark.timeout(180)
def test_fully_async_partial_rollouts_go_on_across_weight_updates():
    """A group interrupted by weight updates is completed, not restarted: its early turns carry the
    old versions and its later turns the new ones (with their own log-probs); no group is
    restarted, dropped, lost or trained on twice."""
    engine = UpdatedEveryCall(base_s=0.005)
    setup = setup_for(rollout_mode="fully_async", max_inflight_groups=4, parallel_backend="threading",
                      async_generation_ratio=1, partial_rollout=True)
    seen: list[int] = []
    spans = []
    with LLMAgentProxy(setup, engine) as proxy:
        for _ in range(4):
            batch = proxy.next_train_batch(engine.policy_version)
            seen += sorted({t.group_id for t in batch.trajectories})
            for t in batch.trajectories:
                versions = [x.policy_version for x in t.turns]
                assert versions == sorted(set(versions))  # every turn after an update: a newer policy
                assert all(x.logprobs for x in t.turns)  # each turn keeps how it was sampled
                spans.append(versions[-1] - versions[0])
    m = proxy.async_metrics()
    assert max(spans) >= 2  # groups went on across two updates or more
    assert m["async/groups_restarted"] == 0 and m["async/tokens_restarted"] == 0
    assert m["async/dropped_stale"] == 0
    assert len(seen) == len(set(seen)) == m["async/groups_handed_out"]  # each handed out once, trained on
    assert m["async/queued_groups"] == m["async/groups_completed"] - m["async/groups_handed_out"]
    # every group drawn is completed or was in flight at close: none lost
    assert m["async/groups_started"] - m["async/groups_completed"] <= setup.agent_proxy.max_inflight_groups
    assert m["async/tokens_generated"] > 0


@pytest.mark.timeout(180)
def test_fully_async_without_partial_rollouts_restarts_groups_that_span_updates():
    """partial_rollout: false: a group whose turns span more than the bound (1) restarts from its
    first turn, its tokens counted as thrown away; when updates come faster than its turns it can
    never finish, and after max_restarts the rollout fails with the reason (no hang)."""
    engine = UpdatedEveryCall(base_s=0.005)
    setup = setup_for(rollout_mode="fully_async", max_inflight_groups=4, parallel_backend="threading",
                      async_generation_ratio=1, partial_rollout=False)
    with LLMAgentProxy(setup, engine) as proxy:
        with pytest.raises(RuntimeError, match=r"failed 4 times: weight updates landed mid-group"):
            for _ in range(4):
                proxy.next_train_batch(engine.policy_version)
        m = proxy.async_metrics()
    assert m["async/groups_restarted"] >= 3 and m["async/tokens_restarted"] > 0


@pytest.mark.timeout(120)
def test_fully_async_generates_no_further_ahead_than_the_bound():
    """A trainer that takes one batch and no more: generation stops once `bound` batches of groups
    beyond it are drawn, instead of queueing groups without limit."""
    engine = ScriptedEngine(base_s=0.005)
    setup = setup_for(rollout_mode="fully_async", max_inflight_groups=3, parallel_backend="threading",
                      async_generation_ratio=2)
    envs_groups = setup.es["train"].env_groups
    with LLMAgentProxy(setup, engine) as proxy:
        proxy.next_train_batch(engine.policy_version)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the groups ahead have all completed
            m = proxy.async_metrics()
            if m["async/groups_completed"] - m["async/groups_handed_out"] >= 2 * envs_groups:
                break
            time.sleep(0.05)
        time.sleep(0.5)  # time to start more, were generation unbounded
        m = proxy.async_metrics()
    assert m["async/groups_started"] == 3 * envs_groups  # the batch taken, and 2 batches ahead
    assert m["async/groups_completed"] - m["async/groups_handed_out"] == 2 * envs_groups

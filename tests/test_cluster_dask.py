"""ParallelRolloutManager on Dask (joblib's dask backend): the sequential
trajectories, envs kept on their workers between rollouts, a worker lost
mid-rollout survived, and the manager's key kept out of every log."""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass

import pytest

pytest.importorskip("distributed")

import dask  # noqa: E402
from distributed import LocalCluster  # noqa: E402

from ragen.llm.scripted import ScriptedEngine  # noqa: E402
from ragen.rollout.proxy import AgentSetup, LLMAgentProxy  # noqa: E402
from ragen.rollout.workers.cluster import ClusterConfig, open_cluster  # noqa: E402
from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings  # noqa: E402
from ragen.serving import SharedLLMInferenceManager  # noqa: E402
from tests.fault_envs import FaultEnv, FaultEnvConfig, exiting_group  # noqa: E402
from tests.rollout_helpers import (  # noqa: E402
    custom_envs, fault_tag, loop_config, rollouts_at_once, sequential, specs_for, streaming_engine)


# ----- a counting env: proves that workers keep their envs -------------------------

@dataclass
class CountingEnvConfig(FaultEnvConfig):
    log: str = ""  # one line "<pid>" per env instance created


class CountingEnv(FaultEnv):
    def __init__(self, config: CountingEnvConfig | None = None) -> None:
        super().__init__(config or CountingEnvConfig())
        if self.config.log:
            with open(self.config.log, "a") as f:
                f.write(f"{os.getpid()}\n")


def counting_tag(log: str) -> dict:
    return {**fault_tag(), "env_type": f"{__name__}:CountingEnv",
            "config_type": f"{__name__}:CountingEnvConfig", "env_config": {"log": log}}


# ----- fixtures --------------------------------------------------------------------

@pytest.fixture(scope="module")
def scheduler_address():
    """A cluster reached by address, as a remote one is: 2 single-threaded
    worker processes; one retry on another worker, as the README advises."""
    with dask.config.set({"distributed.scheduler.allowed-failures": 1}):
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                               dashboard_address=None, host="127.0.0.1")
    yield cluster.scheduler_address
    cluster.close()


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine(malformed_rate=0.1)


@pytest.fixture(scope="module")
def mixed_specs():
    return specs_for(["SimpleSokoban", "FrozenLake", "Bandit", "Countdown"], [2, 2, 2, 1], 2, custom_envs())


@pytest.fixture(scope="module")
def reference(mixed_specs, engine):
    return sequential(mixed_specs, loop_config(), engine)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _gone(pid: int, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


# ----- same trajectories -----------------------------------------------------------

def test_local_cluster_for_the_run_gives_the_sequential_trajectories(mixed_specs, reference, engine):
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.005) as shared:
        prm = ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="dask"))
        try:
            assert prm.n_workers == 2
            worker_pids = list(prm._cluster.client.run(os.getpid).values())
            for depth in (1, 2):
                prm.pipeline_depth = depth
                result = prm.rollout(mixed_specs, loop_config())
                assert result.trajectories == reference
                assert result.metrics["parallel/fallbacks"] == 0
                # on the cluster's workers (pull-based: one that starts late may find every group taken)
                assert result.metrics["parallel/workers_used"] in (1, 2)
        finally:
            prm.close()
    # the cluster started for the run is gone with it
    assert prm._cluster is None
    assert all(_gone(pid) for pid in worker_pids)


def test_scheduler_address_gives_the_sequential_trajectories(scheduler_address, mixed_specs, reference, engine):
    with SharedLLMInferenceManager(engine) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(backend="dask"),
                                   cluster=ClusterConfig(dask_scheduler_address=scheduler_address)) as prm:
        assert prm.n_workers == 2  # the cluster's threads, whatever n_jobs says
        for depth in (1, 2):
            prm.pipeline_depth = depth
            assert prm.rollout(mixed_specs, loop_config()).trajectories == reference


@pytest.mark.timeout(120)
def test_env_level_turns_on_the_cluster_give_the_sequential_trajectories(scheduler_address, mixed_specs, reference):
    """An engine that batches continuously: each env's next turn as soon as its own answer is in."""
    engine = streaming_engine()
    try:
        with SharedLLMInferenceManager(engine) as shared, \
                ParallelRolloutManager(shared, ParallelSettings(backend="dask"),
                                       cluster=ClusterConfig(dask_scheduler_address=scheduler_address)) as prm:
            result = prm.rollout(mixed_specs, loop_config())
    finally:
        engine.close()
    assert result.trajectories == reference
    assert result.metrics["engine/requests"] == result.metrics["engine/calls"]  # a request a message: env-level


@pytest.mark.timeout(120)
def test_two_rollouts_at_once_on_one_cluster(scheduler_address, mixed_specs, reference, engine):
    """max_concurrent_rollouts: 2 on one Dask cluster: both rollouts give the
    sequential trajectories and neither is taken for a failure (one
    joblib.Parallel used by both at once refused the second call: "already
    running", taken for a dead worker)."""
    with SharedLLMInferenceManager(engine) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(backend="dask"),
                                   cluster=ClusterConfig(dask_scheduler_address=scheduler_address)) as prm:
        for _ in range(3):
            for result in rollouts_at_once(prm, 2, mixed_specs, loop_config(), within_s=60):
                assert result.trajectories == reference
                assert result.metrics["parallel/fallbacks"] == 0
                assert result.metrics["parallel/retried_tasks"] == 0


def test_workers_keep_their_envs_between_rollouts(scheduler_address, tmp_path, engine):
    log = tmp_path / "created"
    specs = specs_for(["Counting"], [6], 2, custom_envs(Counting=counting_tag(str(log))))
    ref = sequential(specs, loop_config(), engine)
    log.unlink()  # the driver's envs of the reference
    with SharedLLMInferenceManager(engine) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(backend="dask"),
                                   cluster=ClusterConfig(dask_scheduler_address=scheduler_address)) as prm:
        worker_pids = set(prm._cluster.client.run(os.getpid).values())
        for _ in range(4):
            result = prm.rollout(specs, loop_config())
            assert result.trajectories == ref
            assert result.metrics["parallel/fallbacks"] == 0  # played on the workers
    created = [int(line) for line in log.read_text().split()]
    # every env was built on a worker, and each worker built at most as many as
    # it ever held at once (at most all 12; the chunks it takes vary from rollout
    # to rollout) over 4 rollouts: later rollouts reused them (48 otherwise)
    assert set(created) <= worker_pids
    assert len(created) <= 2 * 12
    assert all(created.count(pid) <= 12 for pid in worker_pids)


# ----- a worker lost mid-rollout ---------------------------------------------------

def _recovered(metrics) -> float:
    """Shards the rollout manager ran again after their worker was lost."""
    return metrics["parallel/fallbacks"] + metrics.get("parallel/retried_tasks", 0.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["exit_step", "kill_step"])
def test_worker_killed_by_an_env_the_rollout_is_the_fault_free_one(scheduler_address, tmp_path, fault):
    # the first attempt kills its worker process; Dask runs the task again elsewhere, and
    # the groups the lost worker had taken are run again by the rollout manager
    clean = specs_for(["Fault"], [6], 2, custom_envs(Fault=fault_tag()))
    faulty = specs_for(["Fault"], [6], 2, custom_envs(Fault=fault_tag(
        fault, fault_seed=clean[4].seed, marker=str(tmp_path / "marker"))))
    engine = ScriptedEngine()
    ref = sequential(clean, loop_config(), engine)
    t0 = time.monotonic()
    with SharedLLMInferenceManager(engine) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(backend="dask"),
                                   cluster=ClusterConfig(dask_scheduler_address=scheduler_address)) as prm:
        result = prm.rollout(faulty, loop_config())
    assert int((tmp_path / "marker").read_text()) != os.getpid()  # a worker died, not the driver
    assert _recovered(result.metrics) == 1
    assert result.trajectories == ref
    assert time.monotonic() - t0 < 60


@pytest.fixture
def give_up_at_once_address():
    """A cluster on which Dask gives up on a task when its worker dies once
    (allowed-failures 0): giving up then does not hang on the task's retry
    finding its groups already taken by the other worker."""
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                               dashboard_address=None, host="127.0.0.1")
    yield cluster.scheduler_address
    cluster.close()


@pytest.mark.timeout(120)
def test_worker_lost_on_every_try_dask_gives_up_and_nothing_hangs(give_up_at_once_address, mixed_specs, reference,
                                                                  engine, caplog, tmp_path):
    # the envs of group 0 kill the worker that plays them at their second step,
    # on the one try Dask allows; Dask gives up (KilledWorker), which must reach
    # joblib's Parallel as an error (not a callback never called: a hang). The
    # rollout manager then runs the groups not played again: nothing is lost or
    # hangs, and the next rollout is parallel again (one group per worker at a
    # time: max_env_num_per_worker).
    caplog.set_level(logging.WARNING, logger="ragen.rollout.backends.parallel")
    t0 = time.monotonic()
    with SharedLLMInferenceManager(engine) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(backend="dask", max_env_num_per_worker=2),
                                   cluster=ClusterConfig(dask_scheduler_address=give_up_at_once_address)) as prm:
        worker_pids = set(prm._cluster.client.run(os.getpid).values())
        assert len(worker_pids) == 2
        result = prm.rollout(exiting_group(mixed_specs, 0, at_step=2, marker=str(tmp_path / "exited")),
                             loop_config())
        assert result.trajectories == reference
        # a worker died: one of the two processes is gone (reaped by its nanny), the other lives
        deadline = time.monotonic() + 15
        while len(alive := {pid for pid in worker_pids if _alive(pid)}) == 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(alive) == 1, f"worker processes {sorted(worker_pids)} all still alive: no worker died"
        # Dask gave up on the task, and the rollout manager re-ran its groups in parallel
        retries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[Retry] a worker died")]
        assert len(retries) == 1 and "KilledWorker" in retries[0], retries
        assert result.metrics["parallel/retried_tasks"] >= 1  # task 0, and task 1 when it had not ended
        assert result.metrics["parallel/fallbacks"] == 0  # the parallel retry played them all
        caplog.clear()
        again = prm.rollout(mixed_specs, loop_config())
        assert again.metrics["parallel/fallbacks"] == 0
        assert again.metrics["parallel/retried_tasks"] == 0
        assert again.trajectories == reference
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert time.monotonic() - t0 < 60


# ----- the manager's endpoint ------------------------------------------------------

def test_wildcard_host_is_advertised_and_the_key_stays_out_of_logs(scheduler_address, mixed_specs, reference,
                                                                    engine, caplog, tmp_path):
    caplog.set_level(logging.DEBUG)
    with SharedLLMInferenceManager(engine, host="0.0.0.0") as shared:
        key = shared._key
        cluster = open_cluster("dask", ClusterConfig(dask_scheduler_address=scheduler_address))
        try:
            found = cluster.worker_client(shared.client())
            assert found.address[0] not in ("0.0.0.0", "") and found.address[1] == shared.address[1]
            explicit = open_cluster("dask", ClusterConfig(dask_scheduler_address=scheduler_address,
                                                          advertise_host="localhost"))
            assert explicit.worker_client(shared.client()).address == ("localhost", shared.address[1])
            explicit.close()
            with ParallelRolloutManager(shared, ParallelSettings(backend="dask"),
                                        cluster=ClusterConfig(dask_scheduler_address=scheduler_address)) as prm:
                assert prm.rollout(mixed_specs, loop_config()).trajectories == reference
                # the group that opens the queue's second chunk (GroupQueue(7, 2).sizes: [4, 2, 1])
                exiting = exiting_group(mixed_specs, 4, at_step=1, marker=str(tmp_path / "exited"))
                assert prm.rollout(exiting, loop_config()).trajectories == reference
            logs = [caplog.text, repr(cluster.client.get_scheduler_logs(n=10_000))]
            logs += [repr(v) for v in cluster.client.get_worker_logs(n=10_000).values()]
        finally:
            cluster.close()
    for text in logs:
        assert key.hex() not in text and repr(key)[2:-1] not in text


def test_agent_proxy_reads_the_cluster_keys(scheduler_address):
    cfg = {
        "agent_proxy": {"use_parallel_rollout": True, "parallel_backend": "dask", "max_turn": 3, "pipeline_depth": 1},
        "custom_envs": custom_envs(),
        "es_manager": {"train": {"env_groups": 4, "group_size": 2, "env_configs": {"tags": ["Bandit"], "n_groups": [4]}},
                       "val": {"env_groups": 2, "group_size": 1, "env_configs": {"tags": ["Bandit"], "n_groups": [2]}}},
        "dask": {"scheduler_address": scheduler_address, "n_workers": None},
        "llm_server": {"host": "127.0.0.1", "port": 0, "advertise_host": None},
    }
    setup = AgentSetup.from_config(cfg)
    assert setup.cluster == ClusterConfig(dask_scheduler_address=scheduler_address)
    engine = ScriptedEngine()
    with LLMAgentProxy(setup, engine) as proxy:
        parallel = proxy.rollout("train")
    seq_setup = AgentSetup.from_config({**cfg, "agent_proxy": {**cfg["agent_proxy"], "use_parallel_rollout": False}})
    with LLMAgentProxy(seq_setup, engine) as proxy:
        assert parallel.trajectories == proxy.rollout("train").trajectories
    with pytest.raises(ValueError, match="dask.n_workers"):
        AgentSetup.from_config({**cfg, "dask": {"n_workers": 0}})
    with pytest.raises(ValueError, match="dask.scheduler_address"):
        AgentSetup.from_config({**cfg, "dask": {"scheduler_address": 8786}})


def test_without_dask_distributed_the_config_check_names_the_package_and_the_extra(monkeypatch):
    """The package is looked for when the config is read (AgentSetup.from_config, before an
    engine or model exists), not when the first rollout opens the cluster."""
    monkeypatch.setitem(sys.modules, "dask.distributed", None)  # as if it were not installed
    cfg = {"custom_envs": custom_envs(), "agent_proxy": {"use_parallel_rollout": True, "parallel_backend": "dask"},
           "es_manager": {split: {"env_groups": 1, "group_size": 1,
                                  "env_configs": {"tags": ["Bandit"], "n_groups": [1]}} for split in ("train", "val")}}
    with pytest.raises(ValueError, match=r"agent_proxy\.parallel_backend=dask needs dask\.distributed, which is not "
                                         r"installed: pip install 'dask\[distributed\]' \(or pip install -e "
                                         r"'\.\[dask\]'\)"):
        AgentSetup.from_config(cfg)
    cfg["agent_proxy"]["use_parallel_rollout"] = False  # the backend is not used: nothing to look for
    AgentSetup.from_config(cfg)

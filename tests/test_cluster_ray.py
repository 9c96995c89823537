"""ParallelRolloutManager on Ray (Ray's joblib backend): the sequential
trajectories, envs kept on their workers between rollouts, a worker lost
mid-rollout survived. Skipped when ray is not installed."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

ray = pytest.importorskip("ray")

from joblib.pool import PicklingPool  # noqa: E402

from ragen.llm.scripted import ScriptedEngine  # noqa: E402
from ragen.rollout.workers.cluster import ClusterConfig  # noqa: E402
from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings  # noqa: E402
from ragen.serving import SharedLLMInferenceManager  # noqa: E402
from tests.fault_envs import FaultEnv, FaultEnvConfig  # noqa: E402
from tests.rollout_helpers import (  # noqa: E402
    custom_envs, fault_tag, loop_config, rollouts_at_once, sequential, specs_for, streaming_engine)

pytestmark = pytest.mark.timeout(180)


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


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine(malformed_rate=0.1)


@pytest.fixture(scope="module")
def mixed_specs():
    return specs_for(["SimpleSokoban", "FrozenLake", "Bandit", "Countdown"], [2, 2, 2, 1], 2, custom_envs())


@pytest.fixture(scope="module")
def reference(mixed_specs, engine):
    return sequential(mixed_specs, loop_config(), engine)


def _strip(trajs):
    return [(t.env_id, t.stop_reason, [(x.response, x.reward) for x in t.turns]) for t in trajs]


def test_local_ray_gives_the_sequential_trajectories_and_keeps_envs(mixed_specs, reference, engine, tmp_path):
    assert not ray.is_initialized()
    bases = PicklingPool.__bases__
    log = tmp_path / "created"
    counting = specs_for(["Counting"], [4], 2, custom_envs(Counting=counting_tag(str(log))))
    counting_ref = sequential(counting, loop_config(), engine)
    log.unlink()  # the driver's envs of the reference
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.005) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="ray")) as prm:
        assert prm.n_workers == 2
        for depth in (1, 2):
            prm.pipeline_depth = depth
            result = prm.rollout(mixed_specs, loop_config())
            assert result.trajectories == reference
            assert result.metrics["parallel/fallbacks"] == 0
            # on the cluster's workers (pull-based: one that starts late may find every group taken)
            assert result.metrics["parallel/workers_used"] in (1, 2)
        # env-level turns, on an engine that batches continuously: the same trajectories
        streaming = streaming_engine()
        try:
            with SharedLLMInferenceManager(streaming) as streamed, \
                    ParallelRolloutManager(streamed, ParallelSettings(n_jobs=2, backend="ray")) as env_level:
                result = env_level.rollout(mixed_specs, loop_config())
        finally:
            streaming.close()
        assert result.trajectories == reference
        assert result.metrics["engine/requests"] == result.metrics["engine/calls"]
        for _ in range(3):
            result = prm.rollout(counting, loop_config())
            assert result.trajectories == counting_ref
            assert result.metrics["parallel/fallbacks"] == 0  # played on the actors
        # max_concurrent_rollouts: 2 (each rollout on an actor pool of its own)
        for result in rollouts_at_once(prm, 2, mixed_specs, loop_config(), within_s=120):
            assert result.trajectories == reference
            assert result.metrics["parallel/fallbacks"] == 0
            assert result.metrics["parallel/retried_tasks"] == 0
    created = [int(line) for line in log.read_text().split()]
    assert os.getpid() not in created
    # 2 actors, each built at most one instance per env (the groups each takes vary), reused after
    assert len(set(created)) <= 2 and len(created) <= 2 * len(mixed_specs)
    # ray started for the run is stopped with it; joblib's own pool is given back
    assert not ray.is_initialized()
    assert PicklingPool.__bases__ == bases


def _ray_command() -> str | None:
    """The `ray` script of this Python's environment: pip puts it next to the
    interpreter, a folder not on PATH when a venv's python is run without
    activating the venv; else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "ray")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("ray")


def _reload_ray_auth() -> None:
    """Ray's driver reads its auth mode (at import) and token (at first use)
    once: read both again from the environment, as ray.init does when it
    turns token authentication on for a local cluster."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    """A Ray cluster started by `ray start --head`, reached by address."""
    exe = _ray_command()
    if exe is None:
        pytest.skip(f"no ray command next to {sys.executable} nor on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Token authentication on, with a token of the test's own, for the head and
    # the driver alike: `ray start` turns it on only when it finds a token (one
    # an earlier local ray.init left in ~/.ray), and a driver whose mode differs
    # from the head's aborts the whole test process.
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env = {**os.environ, **auth, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "tests")]
                                                               + [p for p in sys.path if p])}
    log = tmp_path_factory.mktemp("ray") / "head.log"
    with open(log, "w") as out:
        head = subprocess.Popen([exe, "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                                 "--include-dashboard=false", "--disable-usage-stats"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        with pytest.MonkeyPatch.context() as mp:
            for name, value in auth.items():
                mp.setenv(name, value)
            _reload_ray_auth()
            yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _reload_ray_auth()
        os.killpg(head.pid, signal.SIGTERM)  # our own session: the head and what it started
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def _connect(address: str, shared, **kw) -> ParallelRolloutManager:
    return ParallelRolloutManager(shared, ParallelSettings(backend="ray", **kw),
                                  cluster=ClusterConfig(ray_address=address))


def test_ray_address_gives_the_sequential_trajectories(ray_address, mixed_specs, reference, engine):
    with SharedLLMInferenceManager(engine) as shared:
        with _connect(ray_address, shared) as prm:
            assert prm.n_workers == 2
            for depth in (1, 2):
                prm.pipeline_depth = depth
                assert prm.rollout(mixed_specs, loop_config()).trajectories == reference
        assert not ray.is_initialized()  # disconnected; the cluster itself goes on


def test_worker_killed_during_a_rollout_the_rollout_is_the_fault_free_one(ray_address, tmp_path):
    clean = specs_for(["Fault"], [6], 2, custom_envs(Fault=fault_tag()))
    faulty = specs_for(["Fault"], [6], 2, custom_envs(Fault=fault_tag(
        "exit_step", fault_seed=clean[4].seed, marker=str(tmp_path / "marker"))))
    engine = ScriptedEngine()
    ref = sequential(clean, loop_config(), engine)
    t0 = time.monotonic()
    with SharedLLMInferenceManager(engine) as shared, _connect(ray_address, shared) as prm:
        result = prm.rollout(faulty, loop_config())  # ActorDiedError: the manager runs the shards again
        assert int((tmp_path / "marker").read_text()) != os.getpid()  # a worker died, not the driver
        assert result.metrics["parallel/fallbacks"] + result.metrics.get("parallel/retried_tasks", 0.0) >= 1
        assert result.trajectories == ref
        again = prm.rollout(clean, loop_config())  # a new actor pool
        assert again.metrics["parallel/fallbacks"] == 0
        assert again.trajectories == ref
    assert time.monotonic() - t0 < 60


def test_without_ray_the_config_check_names_the_package_and_the_extra(monkeypatch):
    from ragen.rollout.proxy import AgentSetup

    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    cfg = {"custom_envs": custom_envs(), "agent_proxy": {"use_parallel_rollout": True, "parallel_backend": "ray"},
           "es_manager": {split: {"env_groups": 1, "group_size": 1,
                                  "env_configs": {"tags": ["Bandit"], "n_groups": [1]}} for split in ("train", "val")}}
    with pytest.raises(ValueError, match=r"agent_proxy\.parallel_backend=ray needs ray, which is not installed: "
                                         r"pip install 'ray\[default\]' \(or pip install -e '\.\[ray\]'\)"):
        AgentSetup.from_config(cfg)

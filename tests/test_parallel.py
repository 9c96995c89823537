"""ParallelRolloutManager: the same trajectories as the sequential loop, on
every backend and layout, and nothing lost when workers fail."""

from __future__ import annotations

import threading
import time
from operator import attrgetter

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings, RolloutError
from ragen.serving import DirectClient
from ragen.rollout.batching import Lockstep
from ragen.rollout.scheduler import KeptEnvs, run_envs
from ragen.rollout.backends import parallel as parallel_rollout
from ragen.rollout.workers.schedule import CHUNK_WORK_S, chunk_sizes, min_chunk_groups
from ragen.serving import SharedLLMInferenceManager
from ragen.rollout.types import StopReason

from tests.fault_envs import exiting_group
from tests.rollout_helpers import custom_envs, fault_tag, loop_config, rollouts_at_once, sequential, specs_for


def sampled(trajectories):
    """What the trajectories' equality leaves out: each turn's token ids and their log-probs."""
    return [[(t.response_ids, t.logprobs) for t in traj.turns] for traj in trajectories]


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine(malformed_rate=0.1)


@pytest.fixture(scope="module")
def mixed_specs():
    # 7 groups over several tags, uneven over 2 or 3 workers
    envs = custom_envs()
    return specs_for(["SimpleSokoban", "FrozenLake", "Bandit", "Countdown"], [2, 2, 2, 1], 2, envs)


@pytest.fixture(scope="module")
def reference(mixed_specs, engine):
    return sequential(mixed_specs, loop_config(), engine)


@pytest.mark.timeout(60)
def test_a_worker_result_is_frozen_plain_data_and_combines_its_parts():
    import dataclasses
    import pickle

    from ragen.rollout.workers.task import WorkerResult
    from ragen.rollout.scheduler import LoopStats
    from ragen.rollout.types import Trajectory

    a = WorkerResult(task=2, trajectories=[Trajectory(env_id=1, group_id=0, tag="t", seed=5)],
                    stats=LoopStats(env_step_s=0.5, envs_created=2), pid=123, wall_s=1.5)
    b = WorkerResult(task=2, trajectories=[Trajectory(env_id=0, group_id=0, tag="t", seed=5)],
                    stats=LoopStats(env_step_s=0.25, env_retries=1))
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.error = "x"
    both = WorkerResult.combine(2, [a, b])
    assert [t.env_id for t in both.trajectories] == [1, 0]  # in the parts' order
    assert both.stats == LoopStats(env_step_s=0.75, envs_created=2, env_retries=1)
    assert (both.task, both.error, both.pid, both.wall_s, both.cause) == (2, None, -1, 0.0, None)


@pytest.mark.parametrize("backend,n_jobs", [
    ("loky", 1), ("loky", 2), ("loky", 3), ("loky", -1), ("loky", "auto"),
    ("threading", 2), ("threading", 3), ("threading", "auto"), ("multiprocessing", 2), ("multiprocessing", -1),
    ("sequential", 1),
])
def test_parallel_equals_sequential(backend, n_jobs, mixed_specs, reference, engine):
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.005) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=n_jobs, backend=backend)) as prm:
        for depth in (1, 2, 2):  # auto: the second and third rollouts run on its choice
            prm.pipeline_depth = depth
            result = prm.rollout(mixed_specs, loop_config())
            assert result.trajectories == reference
            # the log-probs too, to the bit (the scripted engine's answers do not depend on the batch)
            assert sampled(result.trajectories) == sampled(reference)
            assert all(t.logprobs for traj in reference for t in traj.turns)
            assert result.metrics["parallel/fallbacks"] == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["multiprocessing", "sequential"])
def test_two_rollouts_at_once_on_a_joblib_backend(backend, mixed_specs, reference, engine):
    """max_concurrent_rollouts: 2 on the backends behind one joblib.Parallel:
    both rollouts return the sequential trajectories, and neither is taken for
    a failure (a Parallel used by two calls at once never returned one of
    them, or tore the other down as a "dead worker")."""
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.005) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend=backend)) as prm:
        for _ in range(2):
            for result in rollouts_at_once(prm, 2, mixed_specs, loop_config(), within_s=60):
                assert result.trajectories == reference
                assert result.metrics["parallel/fallbacks"] == 0
                assert result.metrics["parallel/retried_tasks"] == 0
        assert prm.rollout(mixed_specs, loop_config()).trajectories == reference  # and one alone after


def test_auto_sizes_each_rollout_from_the_last_and_says_why(mixed_specs, reference, engine, caplog):
    """parallel_n_jobs: auto: the first rollout on every core, each later one
    on the workers and depth chosen from the last one's measurements; the
    choice is logged with its reason and returned as metrics."""
    import logging

    with SharedLLMInferenceManager(engine) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs="auto")) as prm:
        with caplog.at_level(logging.INFO, logger="ragen.rollout.workers.autosize"):
            first = prm.rollout(mixed_specs, loop_config())
            second = prm.rollout(mixed_specs, loop_config())
    assert first.trajectories == second.trajectories == reference
    assert first.metrics["auto/workers"] == prm.n_workers and "auto/pipeline_depth" not in first.metrics
    assert 1 <= second.metrics["auto/workers"] <= prm.n_workers
    assert second.metrics["auto/pipeline_depth"] in (1.0, 2.0) and second.metrics["auto/predicted_s"] > 0
    said = [r.getMessage() for r in caplog.records if "[Auto]" in r.getMessage()]
    assert len(said) == 2 and "engine" in said[0] and "predicted" in said[0]


@pytest.mark.parametrize("n_jobs", [0, -2, "two", 1.5, True, None])
def test_a_bad_parallel_n_jobs_is_refused_naming_the_key(n_jobs, engine):
    from ragen.config_reader import read
    from ragen.rollout.config import AgentProxyConfig

    with pytest.raises(ValueError, match="agent_proxy.parallel_n_jobs"):
        read(AgentProxyConfig, {"parallel_n_jobs": n_jobs}, "agent_proxy")
    with SharedLLMInferenceManager(engine) as shared:
        with pytest.raises(ValueError, match="agent_proxy.parallel_n_jobs must be auto"):
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=n_jobs))


@pytest.mark.parametrize("group_size,n_groups", [(1, [5, 2]), (16, [2, 1])])
def test_group_sizes(group_size, n_groups, engine):
    specs = specs_for(["SimpleSokoban", "FrozenLake"], n_groups, group_size, custom_envs())
    ref = sequential(specs, loop_config(), engine)
    with SharedLLMInferenceManager(engine) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=3, backend="loky")) as prm:
        assert prm.rollout(specs, loop_config()).trajectories == ref
    # group members share their initial state
    for t in ref:
        first = next(r for r in ref if r.group_id == t.group_id)
        assert t.turns[0].observation == first.turns[0].observation


def test_workers_keep_their_envs_between_rollouts(engine):
    specs = specs_for(["Bandit"], [4], 2, custom_envs())
    with SharedLLMInferenceManager(engine) as shared, ParallelRolloutManager(shared, ParallelSettings(n_jobs=2)) as prm:
        first = prm.rollout(specs, loop_config())
        second = prm.rollout(specs, loop_config())
        assert first.trajectories == second.trajectories
        third = prm.rollout(specs, loop_config())
        assert third.trajectories == first.trajectories
        # reset with new seeds, not rebuilt: a worker builds only envs beyond the most it held before
        # (the groups each takes vary), so each worker builds at most one per env over all rollouts
        created = sum(r.metrics["parallel/envs_created"] for r in (first, second, third))
        assert created <= 2 * len(specs) < 3 * len(specs)
        pids = {k: v for k, v in second.metrics.items() if k.startswith("worker/")}
        assert pids  # per-shard timings are reported


# ----- faults -------------------------------------------------------------------

def _fault_run(tmp_path, fault, transient, backend="loky", **prm_kw):
    marker = str(tmp_path / "marker") if transient else ""
    clean = specs_for(["Fault"], [6], 2, custom_envs(Fault=fault_tag()))
    faulty = specs_for(["Fault"], [6], 2, custom_envs(Fault=fault_tag(fault, fault_seed=clean[4].seed,
                                                                          marker=marker, hang_s=30)))
    engine = ScriptedEngine()
    ref = sequential(clean, loop_config(), engine)
    with SharedLLMInferenceManager(engine) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend=backend, fallback_env_timeout_s=2,
                                   **prm_kw)) as prm:
        result = prm.rollout(faulty, loop_config())
    return ref, result, clean[4].group_id


def _strip(trajs):
    return [(t.env_id, t.stop_reason, [(x.response, x.reward) for x in t.turns]) for t in trajs]


@pytest.mark.parametrize("fault", ["exit_step", "kill_step", "raise_step", "raise_reset"])
def test_transient_fault_gives_the_fault_free_rollout(tmp_path, fault):
    ref, result, _ = _fault_run(tmp_path, fault, transient=True)
    if fault.startswith("raise"):  # an env raising: retried alone, in its worker; the shard goes on
        assert result.metrics["rollout/env_retries"] == 1 and result.metrics["parallel/fallbacks"] == 0
    else:  # a dead worker: a parallel retry of the shards it took down
        assert result.metrics["parallel/fallbacks"] + result.metrics["parallel/retried_tasks"] >= 1
    assert _strip(result.trajectories) == _strip(ref)


@pytest.mark.parametrize("fault", ["exit_step", "raise_step", "raise_reset"])
def test_persistent_fault_ends_only_that_group_in_error(tmp_path, fault):
    ref, result, bad_group = _fault_run(tmp_path, fault, transient=False)
    assert len(result.trajectories) == len(ref)
    for got, want in zip(result.trajectories, ref):
        if got.group_id == bad_group:
            assert got.stop_reason == StopReason.ERROR and got.error
        else:
            assert _strip([got]) == _strip([want])


def test_hanging_env_times_out_and_nothing_hangs(tmp_path):
    t0 = time.monotonic()
    ref, result, bad_group = _fault_run(tmp_path, "hang_step", transient=False, rollout_timeout_s=5)
    assert time.monotonic() - t0 < 25
    for got, want in zip(result.trajectories, ref):
        if got.group_id == bad_group:
            assert got.stop_reason == StopReason.TIMEOUT
        else:
            assert _strip([got]) == _strip([want])


def test_transient_hang_recovers(tmp_path):
    ref, result, _ = _fault_run(tmp_path, "hang_step", transient=True, rollout_timeout_s=5)
    assert _strip(result.trajectories) == _strip(ref)


def test_fallback_off_raises(tmp_path):
    # a worker that dies (an env raising no longer fails its shard: it ends in error alone)
    with pytest.raises(RolloutError, match="not played"):
        _fault_run(tmp_path, "exit_step", transient=False, fallback_to_sequential=False)


def test_injected_worker_exit_recovers(engine, mixed_specs, reference, tmp_path):
    exiting = exiting_group(mixed_specs, 0, at_step=2, marker=str(tmp_path / "exited"))
    with SharedLLMInferenceManager(engine) as shared, ParallelRolloutManager(shared, ParallelSettings(n_jobs=2)) as prm:
        result = prm.rollout(exiting, loop_config())
        assert result.metrics["parallel/retried_tasks"] >= 1
        assert result.trajectories == reference
        # the executor is rebuilt and the next rollout is parallel again
        again = prm.rollout(mixed_specs, loop_config())
        assert again.metrics["parallel/fallbacks"] == 0
        assert again.trajectories == reference


@pytest.mark.timeout(120)
def test_injected_worker_exit_recovers_on_multiprocessing_without_a_timeout(engine, mixed_specs, reference,
                                                                               tmp_path):
    """The multiprocessing backend sees a worker that exits mid-rollout, as
    loky does: no rollout_timeout_s is needed for its groups to be re-run."""
    exiting = exiting_group(mixed_specs, 0, at_step=2, marker=str(tmp_path / "exited"))
    with SharedLLMInferenceManager(engine) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="multiprocessing")) as prm:
        assert prm.settings.rollout_timeout_s is None
        result = prm.rollout(exiting, loop_config())
        assert result.metrics["parallel/retried_tasks"] >= 1
        assert result.trajectories == reference
        again = prm.rollout(mixed_specs, loop_config())  # on a rebuilt pool
        assert again.metrics["parallel/fallbacks"] == 0 and again.metrics["parallel/retried_tasks"] == 0
        assert again.trajectories == reference


def test_hf_greedy_parallel_equals_sequential(tiny_model_path):
    """A real transformers engine, greedy: batches differ between the modes
    (padding, composition), the trajectories do not."""
    from dataclasses import replace

    from ragen.llm.hf import HFEngine

    engine = HFEngine(tiny_model_path, device="cpu")
    specs = specs_for(["SimpleSokoban", "Bandit", "Countdown"], [2, 2, 1], 2, custom_envs())
    config = loop_config(max_turn=2)
    config = replace(config, sampling=replace(config.sampling, temperature=0.0, max_tokens=12))
    ref = sequential(specs, config, engine)
    # the sequential loop batches all 10 envs per call; here no call holds more than 3
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.0, max_batch_size=3) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="loky")) as prm:
        result = prm.rollout(specs, config)  # two streams a worker
    assert result.trajectories == ref
    # the same tokens; their log-probs as close as float32 kernels over other batches give
    # (left padding and batch size change the rounding of a matmul, not its value)
    got, want = sampled(result.trajectories), sampled(ref)
    assert [[ids for ids, _ in traj] for traj in got] == [[ids for ids, _ in traj] for traj in want]
    diffs = [abs(a - b) for g, w in zip(got, want) for (_, la), (_, lb) in zip(g, w) for a, b in zip(la, lb)]
    print("largest log-prob difference, parallel vs sequential:", max(diffs))
    assert max(diffs) < 1e-4
    assert result.metrics["engine/max_batch_size"] <= 3


def assert_same_until_a_near_tie(got, want, tolerance=1e-4):
    """Each pair of trajectories equal, or equal until a turn whose prompt is the same and
    whose answers agree, ids and log-probs (within ``tolerance``), up to a sampled token
    that differs: a flip of float rounding at a near-tie, not another distribution. At most
    one env in four may flip."""
    flips = 0
    for a, b in zip(got, want, strict=True):
        if a == b:
            continue
        k = next(i for i, (x, y) in enumerate(zip(a.turns, b.turns)) if x != y)
        x, y = a.turns[k], b.turns[k]
        assert (x.prompt_start, x.prompt_ids) == (y.prompt_start, y.prompt_ids), (a.env_id, k)
        n = next((i for i, (p, q) in enumerate(zip(x.response_ids, y.response_ids)) if p != q),
                 min(len(x.response_ids), len(y.response_ids)))
        assert all(abs(p - q) < tolerance for p, q in zip(x.logprobs[:n], y.logprobs[:n])), (a.env_id, k)
        flips += 1
    assert flips <= len(got) // 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hf_turn_cache_keeps_multi_turn_trajectories(tiny_model_path, temperature):
    """Episodes of several turns, each turn starting from the episode's cache of the last: the
    trajectories of an engine that recomputes every prompt, with most prompt tokens reused."""
    from dataclasses import replace

    from ragen.llm.hf import HFEngine

    specs = specs_for(["SimpleSokoban", "FrozenLake"], [2, 2], 2, custom_envs())
    config = loop_config(max_turn=3)
    config = replace(config, sampling=replace(config.sampling, temperature=temperature, max_tokens=12, seed=3))
    kept = HFEngine(tiny_model_path, device="cpu")
    within_calls = HFEngine(tiny_model_path, device="cpu", turn_cache_mb=0)
    full = HFEngine(tiny_model_path, device="cpu", prefix_cache=False)
    trajectories = sequential(specs, config, kept)
    recomputed = sequential(specs, config, full)
    assert recomputed == sequential(specs, config, within_calls)
    if temperature == 0.0:
        assert trajectories == recomputed
    else:
        # A cached answer's keys and values come from its decode steps, equal to a prefill's up to
        # float rounding: a token sampled at a near-tie may flip. Up to there, the same ids and
        # log-probs (and the envs' other episodes the same).
        assert_same_until_a_near_tie(trajectories, recomputed)
    assert max(len(t.turns) for t in trajectories) == 3
    if trajectories == recomputed:
        assert kept.stats().tokens_prefilled + kept.stats().tokens_reused == full.stats().tokens_prefilled
    # each turn after the first computes what is new since the episode's last call (a random
    # model's answers come back as other tokens now and then, which are computed again)
    assert kept.stats().tokens_prefilled < 0.6 * within_calls.stats().tokens_prefilled < 0.6 * full.stats().tokens_prefilled


def test_engine_idle_splits_a_rollout_around_its_engine_calls():
    from ragen.rollout.metrics import engine_idle as _engine_idle

    spans = [(0.5, 0.9), (10.0, 10.5), (10.7, 11.0), (11.5, 12.0)]  # the first belongs to an earlier rollout
    m = _engine_idle(spans, start=9.0, end=12.25)
    assert m["timing/engine_idle_before_s"] == pytest.approx(1.0)
    assert m["timing/engine_idle_between_s"] == pytest.approx(0.2 + 0.5)
    assert m["timing/engine_idle_after_s"] == pytest.approx(0.25)
    assert _engine_idle(spans, start=13.0, end=14.0) == {}


def test_answers_that_arrive_while_envs_reset_are_handled_between_resets(mixed_specs, reference, engine):
    log = []

    class EagerClient(DirectClient):  # its answers are ready as soon as asked for
        def ready(self):
            return bool(self._queue)

        def wait_any(self, timeout=None):
            ticket, completions = super().wait_any()
            log.append("answer")
            return ticket, completions

    class LoggingKeptEnvs(KeptEnvs):
        def acquire(self, spec):
            log.append("reset")
            return super().acquire(spec)

    trajectories, _ = run_envs(mixed_specs, EagerClient(engine), loop_config(), kept_envs=LoggingKeptEnvs(),
                               batching=Lockstep(depth=3))
    assert trajectories == reference
    # the first micro-batch's answers were stepped before the last micro-batch was reset
    assert log.index("answer") < len(log) - 1 - log[::-1].index("reset")


@pytest.mark.timeout(60)
def test_streams_of_taken_chunks_merge_back_into_pipeline_depth_once_answered_together(engine):
    """A worker opens a stream per chunk it takes; the chunks past its first
    pipeline_depth streams ("riders") join the next request of a stream
    answered in the same engine call and close their own. Every turn after the
    first is then at most pipeline_depth request lists, every opened stream
    is closed exactly once, and the trajectories are the sequential loop's."""
    from collections import deque

    from ragen.rollout.workers.schedule import groups_of

    specs = specs_for(["SimpleSokoban", "FrozenLake", "Bandit"], [4, 4, 4], 1, custom_envs())
    config = loop_config(max_turn=4)
    reference = sequential(specs, config, engine)

    class OneCallClient(DirectClient):
        """Answers every request list queued so far in one engine call, whose
        answers then arrive together (as one frame of the shared manager)."""

        def __init__(self, engine):
            super().__init__(engine)
            self.arrived, self.calls, self.opened, self.closed = deque(), [], 0, 0

        def wait_any(self, timeout=None):
            if not self.arrived:
                self.calls.append(len(self._queue))  # request lists in this call
                while self._queue:
                    self.arrived.append(super().wait_any())
            return self.arrived.popleft()

        def ready(self):
            return bool(self.arrived)

        def open_streams(self, n):
            self.opened += n

        def close_stream(self, hold=False):
            self.closed += 1

    client = OneCallClient(engine)
    groups = groups_of(specs)
    chunks = deque()
    start = 0
    for size in chunk_sizes(len(groups), 1, depth=2):  # one worker: chunks of 6, 3, 2 and 1 groups
        chunks.append([s for g in groups[start:start + size] for s in g])
        start += size

    def take():
        chunk = chunks.popleft() if chunks else []
        client.opened += bool(chunk)  # the manager opens a stream per chunk taken
        return chunk

    trajectories, stats = run_envs([], client, config, kept_envs=KeptEnvs(), take=take, batching=Lockstep(depth=2))
    assert stats.chunks == 4
    assert sorted(trajectories, key=lambda t: t.env_id) == reference
    assert client.opened == client.closed == 4
    assert client.calls[0] == 4  # each chunk's first request list
    assert len(client.calls) == config.max_turn and max(client.calls[1:]) <= 2  # merged into pipeline_depth


def test_groups_are_dealt_out_over_micro_batches():
    from ragen.rollout.batching import split_streams

    specs = specs_for(["SimpleSokoban", "FrozenLake"], [4, 4], 1, custom_envs())
    streams = split_streams(specs, 2, group_id=attrgetter("group_id"))
    assert [{s.tag for s in stream} for stream in streams] == [{"SimpleSokoban", "FrozenLake"}] * 2


@pytest.mark.timeout(60)
def test_micro_batches_get_groups_dealt_in_turn_in_order():
    """Group k of n goes to micro-batch k % n, and each keeps the groups'
    order: the exact layout, so results and worker load stay as they were."""
    from ragen.rollout.batching import split_streams
    from ragen.utils import deal

    specs = specs_for(["Bandit"], [7], 2, custom_envs())
    streams = split_streams(specs, 2, group_id=attrgetter("group_id"))
    assert [[s.group_id for s in stream] for stream in streams] == [
        [0, 0, 2, 2, 4, 4, 6, 6], [1, 1, 3, 3, 5, 5]]
    assert deal("abcdefg", 3) == [["a", "d", "g"], ["b", "e"], ["c", "f"]]
    assert deal([1, 2], 4) == [[1], [2], [], []]


def test_an_engine_with_a_large_cost_per_call_sees_the_sequential_loops_batches():
    """A GPU engine pays about a whole decode per call, whatever its size: a
    turn split over two calls costs a turn. With 4 workers and 2 micro-batches
    each, every turn is still one call, as in the sequential loop, although
    the workers start their shards, and send their streams, at times that
    vary from rollout to rollout and turn to turn."""
    engine = ScriptedEngine(base_s=0.3)  # every call costs 0.3 s, its size next to nothing
    specs = specs_for(["SimpleSokoban", "FrozenLake"], [8, 8], 1, custom_envs())
    config = loop_config(max_turn=3)
    counting = DirectClient(engine)
    run_envs(specs, counting, config, kept_envs=KeptEnvs())  # RAGEN's loop (the workers: two streams each)
    with SharedLLMInferenceManager(engine) as shared, ParallelRolloutManager(shared, ParallelSettings(n_jobs=4)) as prm:
        prm.rollout(specs, config)  # the worker processes start (that can take longer than any wait)
        for _ in range(3):
            result = prm.rollout(specs, config)
            assert result.metrics["engine/calls"] == counting.engine_calls


def test_every_chunk_is_announced_and_a_worker_holds_at_most_max_env_num_per_worker_envs():
    """Each chunk a worker takes is a stream the manager waits for (within its
    budget) before it is taken; with ``max_env_num_per_worker`` a worker
    takes another chunk only when its envs have ended, so at most that many
    envs per worker play at once (here one each: two streams open at most)."""
    announced, most_open = [], []

    class Recording(SharedLLMInferenceManager):
        def announce(self, n_streams, hooks=None):
            announced.append(n_streams)
            return super().announce(n_streams, hooks)

    specs = specs_for(["Bandit", "SimpleSokoban"], [6, 2], 1, custom_envs())
    with Recording(ScriptedEngine(base_s=0.002)) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, max_env_num_per_worker=1)) as prm:
        prm.rollout(specs, loop_config(max_turn=2))  # workers started
        done = threading.Event()

        def watch():
            while not done.is_set():
                most_open.append(shared.open_streams)
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            result = prm.rollout(specs, loop_config(max_turn=2))
        finally:
            done.set()
            watcher.join(10)
    assert result.metrics["parallel/chunks"] == 8  # one group each
    assert announced == [8, 8]
    assert max(most_open) <= 2
    assert shared.announced == {}  # withdrawn when the rollout ended


def _worker_gc_state():
    import gc

    from ragen.rollout.workers.executors import freeze_once

    freeze_once()  # what run_worker does first
    return gc.get_threshold()[0], gc.get_freeze_count() > 0


@pytest.mark.timeout(120)
def test_loky_workers_collect_less_often_and_leave_their_imports_out_of_full_collections(engine):
    import gc

    from ragen.rollout.backends.lease import ExecutorLease

    before = gc.get_threshold()
    with SharedLLMInferenceManager(engine) as shared, ParallelRolloutManager(shared, ParallelSettings(n_jobs=1)) as prm:
        executors = ExecutorLease(prm)
        try:
            assert executors.workers.get().submit(_worker_gc_state).result(timeout=60) == (10_000, True)
        finally:
            executors.close()
    assert gc.get_threshold() == before  # the driver's collector is the user's


@pytest.mark.timeout(120)
def test_cheap_groups_are_handed_out_in_fewer_chunks_once_their_cost_is_measured(engine, monkeypatch):
    """The first rollout knows nothing of its groups' cost: guided
    self-scheduling down to single groups. Later rollouts measured groups far
    cheaper than handing out a chunk costs, so chunks are as large as an even
    share of workers x pipeline_depth; the trajectories stay the same. The
    measured cost is pinned (a busy machine measures more): what the rollout
    manager measures from is checked, and the chunk sizes that follow."""
    cheap_s = CHUNK_WORK_S / 10
    measured = []

    def pinned_cost(trajectories):
        measured.append(sorted(t.env_id for t in trajectories))
        return cheap_s if trajectories else None

    monkeypatch.setattr(parallel_rollout, "group_cost_s", pinned_cost)
    specs = specs_for(["Bandit"], [16], 1, custom_envs())
    config = loop_config(max_turn=2)
    with SharedLLMInferenceManager(engine) as shared, ParallelRolloutManager(shared, ParallelSettings(n_jobs=2)) as prm:
        first = prm.rollout(specs, config)
        second = prm.rollout(specs, config)
    assert measured[0] == list(range(16))  # the first rollout's trajectories, as its workers returned them
    assert first.metrics["parallel/chunks"] == len(chunk_sizes(16, 2, 2)) == 8
    assert min_chunk_groups(cheap_s) == 10
    assert second.metrics["parallel/chunks"] == len(chunk_sizes(16, 2, 2, min_groups=10)) == 4  # [4, 4, 4, 4]
    assert second.trajectories == first.trajectories == sequential(specs, config, engine)



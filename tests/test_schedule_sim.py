"""Pull-based chunks (ragen.rollout.workers.schedule) and the schedule simulator
(benchmarks/schedule_sim.py) on hand-made costs: no rollouts."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest

from ragen.rollout.workers.schedule import GroupQueue, chunk_sizes, groups_of
from ragen.rollout.types import EnvSpec

ROOT = Path(__file__).resolve().parent.parent


def _load_sim():
    spec = importlib.util.spec_from_file_location("schedule_sim", ROOT / "benchmarks" / "schedule_sim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sim = _load_sim()


def make_specs(n_groups: int, group_size: int = 1) -> list[EnvSpec]:
    return [EnvSpec(env_id=g * group_size + i, group_id=g, tag="T", seed=g, env_type="t", env_config={})
            for g in range(n_groups) for i in range(group_size)]


# --------------------------- chunk_sizes ---------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [0, 1, 3, 7, 16, 100, 128, 1000])
@pytest.mark.parametrize("workers,depth", [(1, 1), (2, 1), (4, 2), (8, 2), (15, 2), (3, 4)])
def test_chunk_sizes_cover_groups_and_shrink_to_one(n, workers, depth):
    sizes = chunk_sizes(n, workers, depth)
    slots = workers * depth
    assert sum(sizes) == n and all(s >= 1 for s in sizes)
    assert sizes == sorted(sizes, reverse=True)
    if n:
        assert sizes[0] == -(-n // slots)
        if slots == 1:
            assert sizes == [n]
        else:  # the tail is single groups: once at most `slots` remain, and at least slots - 1 of them
            tail = min(n, slots - 1)
            assert sizes[-tail:] == [1] * tail
            remaining = [n - sum(sizes[:i]) for i in range(len(sizes))]
            assert all(size == 1 for size, left in zip(sizes, remaining) if left <= slots)
    else:
        assert sizes == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cap", [1, 2, 3, 5])
def test_chunk_sizes_respect_max_groups(cap):
    sizes = chunk_sizes(128, 2, 1, max_groups=cap)
    assert sum(sizes) == 128 and max(sizes) <= cap
    assert chunk_sizes(128, 2, 1, max_groups=None) == chunk_sizes(128, 2, 1)


@pytest.mark.timeout(60)
def test_chunk_sizes_known_values_and_bad_arguments():
    assert chunk_sizes(16, 4, 2) == [2, 2, 2, 2] + [1] * 8
    assert chunk_sizes(8, 2, 1) == [4, 2, 1, 1]
    for bad in [(-1, 2, 1), (4, 0, 1), (4, 2, 0), (4, 2, 1, None, 0)]:
        with pytest.raises(ValueError, match="chunk_sizes"):
            chunk_sizes(*bad)


@pytest.mark.timeout(60)
def test_chunk_sizes_with_a_floor_stay_above_it_up_to_an_even_share():
    assert chunk_sizes(128, 2, 2, min_groups=5) == [32, 24, 18, 14, 10, 8, 6, 5, 5, 5, 1]
    assert chunk_sizes(128, 2, 2, min_groups=87) == [32, 32, 32, 32]  # never coarser than one chunk a slot
    assert chunk_sizes(10, 3, 1, min_groups=100) == [4, 4, 2]
    assert chunk_sizes(128, 2, 2, max_groups=10, min_groups=48) == [10] * 12 + [8]  # the memory cap wins
    for n in (1, 7, 128, 1000):
        for floor in (1, 2, 9, 50):
            sizes = chunk_sizes(n, 4, 2, min_groups=floor)
            assert sum(sizes) == n and all(s >= min(floor, -(-n // 8)) for s in sizes[:-1])


@pytest.mark.timeout(60)
def test_the_floor_comes_from_a_measured_group_cost():
    from ragen.rollout.workers.schedule import CHUNK_WORK_S, group_cost_s, min_chunk_groups
    from ragen.rollout.types import Trajectory, Turn

    assert min_chunk_groups(None) == min_chunk_groups(0.0) == min_chunk_groups(float("nan")) == 1
    assert min_chunk_groups(CHUNK_WORK_S) == 1 and min_chunk_groups(10 * CHUNK_WORK_S) == 1  # costly groups
    assert min_chunk_groups(CHUNK_WORK_S / 40) == 40

    def traj(group: int, reset_s: float, *env_s: float) -> Trajectory:
        turns = [Turn(observation="", actions_left=1, response="", actions=[], executed_actions=[], reward=0.0,
                      penalty=0.0, info={}, policy_version=0, env_s=s) for s in env_s]
        return Trajectory(env_id=0, group_id=group, tag="T", seed=0, turns=turns, reset_s=reset_s)

    # group 0: two envs, 0.001 + 0.002 + 0.003 s; group 1: 0.004 s
    assert group_cost_s([traj(0, 0.001, 0.002), traj(0, 0.003), traj(1, 0.001, 0.001, 0.002)]) == \
        pytest.approx((0.006 + 0.004) / 2)
    assert group_cost_s([]) is None


# --------------------------- GroupQueue ---------------------------


@pytest.mark.timeout(60)
def test_group_queue_hands_out_every_group_once_then_empty():
    q = GroupQueue(37, 4, depth=2, max_groups=3)
    chunks = []
    while chunk := q.take():
        chunks.append(chunk)
    assert [len(c) for c in chunks] == q.sizes and len(chunks) == len(q)
    assert [i for c in chunks for i in c] == list(range(37))  # in order, each once
    assert q.take() == [] and q.take() == []


@pytest.mark.timeout(60)
def test_group_queue_close_stops_handing_out():
    q = GroupQueue(10, 2)
    assert q.take()
    q.close()
    assert q.take() == []


@pytest.mark.timeout(60)
def test_group_queue_from_many_threads():
    n, threads = 1000, 8
    q = GroupQueue(n, threads, depth=2)
    taken: list[list[list[int]]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads)

    def worker(k: int) -> None:
        start.wait()
        while chunk := q.take():
            taken[k].append(chunk)

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=30)
    chunks = [c for per in taken for c in per]
    assert len(chunks) == len(q)
    assert sorted(i for c in chunks for i in c) == list(range(n))
    assert all(c == list(range(c[0], c[0] + len(c))) for c in chunks)  # each chunk contiguous
    assert q.take() == []


# --------------------------- the simulator ---------------------------


@pytest.mark.timeout(60)
def test_list_schedule_gives_each_job_to_the_worker_that_frees_first():
    # w0: 1, w1: 1, then w0 takes 5 (ends 6), w1 takes 1 (ends 2)
    assert sim.list_schedule([1, 1, 5, 1], 2) == 6
    assert sim.list_schedule([3, 1, 1, 1], 2) == 3
    assert sim.list_schedule([], 4) == 0


@pytest.mark.timeout(60)
def test_one_costly_group_fixed_shards_against_pull():
    # 16 groups on 4 workers, group 0 costs 10x the others (total 25).
    costs = [10.0] + [1.0] * 15
    specs = make_specs(16)
    by_group = dict(enumerate(costs))
    # fixed: groups dealt in turn, shard 0 = groups 0, 4, 8, 12 = 10 + 3
    assert sim.simulate_fixed(by_group, specs, 4) == 13
    # pull, depth 2: chunks [2, 2, 2, 2] + 8 x [1]; worker 0 takes groups 0-1 (11), the
    # other three take 2 each, then share the 8 single groups: they end at 4 or 5
    assert sim.simulate_pull(costs, 4, depth=2) == 11
    # fixed with max_env_num_per_worker=2: 8 shards of 2 groups, shard 0 = groups 0, 8 (11);
    # workers 1-3 run shards 1-7 (2 each): they end at 6 or 4
    assert sim.simulate_fixed(by_group, specs, 4, max_env_num_per_worker=2) == 11


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2, 4, 8])
def test_equal_costs_split_evenly(workers):
    costs = [0.5] * 32
    specs = make_specs(16, group_size=2)
    by_group = {g: 1.0 for g in range(16)}
    assert sim.simulate_fixed(by_group, specs, workers) == 16 / workers
    assert sim.simulate_pull([1.0] * 16, workers, depth=2) == 16 / workers
    assert sim.simulate_pull(costs, workers, depth=1) == 16 / workers


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2, 3, 7, 20])
@pytest.mark.parametrize("cap", [None, 2, 4])
def test_every_group_is_scheduled_exactly_once(monkeypatch, workers, cap):
    # costs are distinct powers of two: any sum of them names the groups it holds
    n_groups, group_size = 12, 2
    specs = make_specs(n_groups, group_size)
    costs = [float(2 ** g) for g in range(n_groups)]
    jobs: list[list[float]] = []
    real = sim.list_schedule
    monkeypatch.setattr(sim, "list_schedule", lambda job_costs, n: (jobs.append(list(job_costs)), real(job_costs, n))[1])

    assert [g[0].group_id for g in groups_of(specs)] == list(range(n_groups))
    sim.simulate_fixed(dict(enumerate(costs)), specs, workers, cap)
    sim.simulate_pull(costs, workers, depth=2, max_groups=sim.groups_cap(specs, cap))
    for job_costs in jobs:
        assert sum(job_costs) == sum(costs)
        masks = [int(c) for c in job_costs]
        assert all(a & b == 0 for i, a in enumerate(masks) for b in masks[i + 1:])  # no group in two jobs
    if cap:
        assert max(jobs[0]) <= sum(sorted(costs)[-(cap // group_size):])
        assert all(bin(int(c)).count("1") <= cap // group_size for job_costs in jobs for c in job_costs)


@pytest.mark.timeout(60)
def test_makespan_bounds():
    costs = [5.0, 1.0, 3.0, 2.0, 8.0, 1.0, 1.0, 4.0]
    specs = make_specs(len(costs))
    by_group = dict(enumerate(costs))
    for workers in (1, 2, 3, 8, 20):
        low = max(max(costs), sum(costs) / workers)
        assert sim.simulate_fixed(by_group, specs, workers) >= low
        assert sim.simulate_pull(costs, workers, depth=2) >= low
    assert sim.simulate_fixed(by_group, specs, 1) == sim.simulate_pull(costs, 1) == sum(costs)
    assert sim.simulate_pull(costs, 20, depth=2) == max(costs)  # more workers than groups


@pytest.mark.timeout(60)
def test_partition_keeps_groups_whole_and_assigns_every_env():
    specs = make_specs(7, 3)
    shards = sim.partition(specs, 3)
    assert len(shards) == 3
    assert sorted(s.env_id for sh in shards for s in sh) == [s.env_id for s in specs]
    for sh in shards:
        groups = {s.group_id for s in sh}
        for g in groups:
            assert sum(s.group_id == g for s in sh) == 3
    assert sorted(len(sh) for sh in shards) == [6, 6, 9]
    assert len(sim.partition(specs, 2, max_env_num_per_worker=3)) == 7




@pytest.mark.timeout(60)
def test_partition_deals_groups_in_turn_in_order():
    specs = make_specs(7, 2)
    assert [[s.group_id for s in shard] for shard in sim.partition(specs, 3)] == [
        [0, 0, 3, 3, 6, 6], [1, 1, 4, 4], [2, 2, 5, 5]]
    assert [[s.env_id for s in shard] for shard in sim.partition(specs, 3)][0] == [0, 1, 6, 7, 12, 13]
    assert len(sim.partition(specs, 9)) == 7  # never an empty shard


@pytest.mark.timeout(60)
def test_auto_picks_few_workers_when_the_engine_dominates_and_every_core_when_envs_do():
    from ragen.rollout.workers.autosize import Measured, choose, predicted_s

    engine_bound = choose(Measured(engine_s=2.0, busy_s=0.05, ipc_s=0.01, workers=8), cores=16)
    assert engine_bound.workers <= 3 and engine_bound.depth == 1
    env_bound = choose(Measured(engine_s=0.07, busy_s=9.0, ipc_s=0.003, workers=2), cores=16)
    assert env_bound.workers >= 14 and env_bound.depth == 2
    assert env_bound.predicted_s == predicted_s(Measured(0.07, 9.0, 0.003, 2), env_bound.workers, 16)
    # on 2 cores the driver shares them: a second worker only pays when the work stretched over 1.5 cores is worth it
    assert choose(Measured(engine_s=0.0, busy_s=1.0, ipc_s=0.001, workers=2), cores=2).workers == 2
    assert choose(Measured(engine_s=0.0, busy_s=0.004, ipc_s=0.002, workers=2), cores=2).workers == 1
    assert "predicted" in env_bound.reason and "env work dominates" in env_bound.reason


@pytest.mark.timeout(60)
def test_auto_keeps_its_worker_count_unless_another_is_clearly_faster():
    from ragen.rollout.workers.autosize import SWITCH_GAIN, AutoSizer, Measured, choose, predicted_s

    m = Measured(engine_s=0.006, busy_s=0.006, ipc_s=0.002, workers=2)
    t1, t2 = predicted_s(m, 1, 2), predicted_s(m, 2, 2)
    assert t1 < t2 < t1 * (1 + SWITCH_GAIN)  # 1 is best, by less than the margin
    assert choose(m, cores=2).workers == 1
    assert choose(m, cores=2, current=2).workers == 2  # kept
    assert choose(m, cores=2, current=1).workers == 1
    clear = Measured(engine_s=0.0, busy_s=0.004, ipc_s=0.002, workers=2)  # 1 predicted far faster
    assert choose(clear, cores=2, current=2).workers == 1
    sizer = AutoSizer(2)
    assert sizer.update(m).workers == 2  # it ran on 2: kept
    assert sizer.update(Measured(0.006, 0.006, 0.002, workers=1)).workers == 1

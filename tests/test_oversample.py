"""Over-sampling (``ragen.rollout.oversample``): a training rollout starts more groups than its
batch needs and ends once enough ended; the unfinished ones are carried into the next rollout,
where they end as they would have uncut, or aborted and dropped."""

from __future__ import annotations

import dataclasses

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.rollout.scheduler import GroupCount, LoopConfig, run_envs
from ragen.rollout.types import StopReason, rollout_digest
from ragen.serving import DirectClient

from tests.rollout_helpers import custom_envs, specs_for, streaming_engine

pytestmark = pytest.mark.timeout(180)


def _proxy(engine, env_groups: int = 8, **agent_proxy):
    from ragen.llm_agent import AgentSetup, LLMAgentProxy

    setup = AgentSetup.from_config({
        "custom_envs": custom_envs(), "seed": {"train": 100, "val": 7},
        "agent_proxy": {"max_turn": 5, **agent_proxy},
        "es_manager": {
            "train": {"env_groups": env_groups, "group_size": 2,
                      "env_configs": {"tags": ["FrozenLake"], "n_groups": [env_groups]}},
            "val": {"env_groups": 3, "group_size": 1, "env_configs": {"tags": ["FrozenLake"], "n_groups": [3]}}}})
    return LLMAgentProxy(setup, engine)


def _batches(proxy, engine, n: int):
    """``n`` training batches, the engine's policy version one more before each (as a trainer's update)."""
    out = []
    for version in range(n):
        engine.policy_version = version
        out.append(proxy.next_train_batch(version))
    return out


def _groups(result) -> dict[int, list]:
    groups: dict[int, list] = {}
    for spec, traj in zip(result.specs, result.trajectories):
        groups.setdefault(spec.group_id, []).append((spec, traj))
    return groups


@pytest.mark.parametrize("backend", ["sequential", "loky"])
def test_carried_groups_end_as_they_would_have_uncut(backend):
    """Each group of every batch (those carried from a rollout before too) has the trajectories
    its specs give when played to the end in one go: the cut and the carry change nothing of
    what is played, and every started group is in one batch, or carried, or dropped as stale."""
    engine = streaming_engine(step_s=0.002, tokens_median=30)
    parallel = {"use_parallel_rollout": True, "parallel_backend": "loky", "parallel_n_jobs": 2} \
        if backend == "loky" else {}
    with _proxy(engine, over_sample=1.5, unfinished="carry", max_carry_staleness=2, **parallel) as proxy:
        batches = _batches(proxy, engine, 4)
        carried = proxy.over_sample.carried
        reference = proxy.backend.rollout([s for r in batches for s in r.specs], proxy.setup.loop)
    want = {(t.tag, t.seed, t.env_id): t for t in reference.trajectories}
    started = finished = resumed = stale = 0
    for result in batches:
        m = result.metrics
        assert m["oversample/groups_started"] >= 12  # ceil(1.5 x 8), and more where surplus was held over
        assert m["oversample/groups_finished"] >= 8
        assert m["oversample/groups_finished"] + m["oversample/groups_carried"] == m["oversample/groups_started"]
        assert len(_groups(result)) == 8  # a batch of env_groups groups, the finished ones past it held over
        assert not result.dropped_groups
        for members in _groups(result).values():
            assert all(t.stop_reason is not StopReason.ABORTED for _, t in members)
            for spec, traj in members:
                assert spec.resume is None  # what a carried spec held stays out of the batch
                assert rollout_digest([traj]) == rollout_digest([want[(traj.tag, traj.seed, traj.env_id)]])
        started += m["oversample/groups_started"] - m["oversample/groups_resumed"]
        finished += len(_groups(result))
        resumed += m["oversample/groups_resumed"]
        stale += m["oversample/dropped_stale"]
    assert resumed > 0  # some groups were carried and went on
    assert started == finished + stale + len(carried)  # no group lost
    # a carried group's turns keep the versions that answered them: some batch trains on an older one
    assert any(t.policy_version < i for i, r in enumerate(batches) for tr in r.trajectories for t in tr.turns)


def test_abort_drops_the_unfinished_groups_and_reports_their_turns():
    engine = streaming_engine(step_s=0.002, tokens_median=30)
    with _proxy(engine, over_sample=1.5, unfinished="abort") as proxy:
        result = _batches(proxy, engine, 1)[0]
        assert proxy.over_sample.carried == []
    m = result.metrics
    aborted = {g for g, why in result.dropped_groups.items() if why == "aborted"}
    assert len(aborted) == m["oversample/groups_aborted"] == 12 - m["oversample/groups_finished"] > 0
    for g, members in _groups(result).items():
        cut = any(t.stop_reason is StopReason.ABORTED for _, t in members)
        assert cut == (g in aborted)
    # the batch keeps the groups that ended first: the bias abort brings, reported
    assert m["oversample/turns_finished"] > 0 and "oversample/turns_unfinished" in m
    assert m["rollout/stop/aborted"] == 0  # the batch's metrics are over its finished groups


@pytest.mark.parametrize("streams", [True, False], ids=["continuous-batching", "batch-engine"])
def test_parallel_workers_stop_at_enough_groups_on_the_managers_aborted_answers(streams):
    """Threads as workers, two of them: the driver counts the groups each worker ended whole and
    the manager answers the rest of the rollout's requests ``aborted`` (those in flight in an
    engine that batches continuously, those queued for a batch engine's next call)."""
    engine = streaming_engine(step_s=0.002, tokens_median=30) if streams else \
        ScriptedEngine(base_s=0.01, malformed_rate=0.3)
    with _proxy(engine, env_groups=6, over_sample=2.0, unfinished="abort", use_parallel_rollout=True,
                parallel_backend="threading", parallel_n_jobs=2, max_turn=10) as proxy:  # groups end apart
        result = _batches(proxy, engine, 1)[0]
        held = sum(len(group) for group in proxy.over_sample.carried)  # finished past the batch's 6 groups
    stops = [t.stop_reason for t in result.trajectories]
    assert len(stops) + held == 24  # every env of the 12 groups started has its trajectory
    assert StopReason.ABORTED in stops
    assert result.metrics["oversample/groups_finished"] >= 6
    assert result.metrics["parallel/fallbacks"] == 0


def test_enough_ends_a_rollout_once_that_many_groups_ended_whole():
    engine = streaming_engine(step_s=0.002, tokens_median=30)
    specs = specs_for(["FrozenLake"], [6], 2, custom_envs())
    count = GroupCount(2)
    trajectories, _ = run_envs(specs, DirectClient(engine), LoopConfig(max_turn=5), groups_done=count.add)
    whole = {t.group_id for t in trajectories} - {t.group_id for t in trajectories
                                                  if t.stop_reason is StopReason.ABORTED}
    assert count.done >= 2 and len(whole) == count.done < 6
    engine.close()


def test_a_carried_env_that_does_not_step_as_it_did_ends_in_error():
    engine = streaming_engine(step_s=0.0005)
    specs = specs_for(["FrozenLake"], [1], 1, custom_envs())
    played, _ = run_envs(specs, DirectClient(engine), LoopConfig(max_turn=3))
    traj = played[0]
    turn = next(t for t in traj.turns if t.steps)
    bad = dataclasses.replace(turn, steps=(dataclasses.replace(turn.steps[0], observation="elsewhere"),))
    cut = dataclasses.replace(traj, turns=[bad if t is turn else t for t in traj.turns],
                              stop_reason=StopReason.ABORTED)
    again, _ = run_envs([dataclasses.replace(specs[0], resume=cut)], DirectClient(engine),
                        LoopConfig(max_turn=3, env_retries=0))
    assert again[0].stop_reason is StopReason.ERROR
    assert "not deterministic for its seed" in again[0].error and "unfinished=abort" in again[0].error
    engine.close()


def test_validation_never_over_samples():
    engine = streaming_engine(step_s=0.0005)
    with _proxy(engine, over_sample=2.0) as proxy:
        result = proxy.rollout("val")
    assert len(result.trajectories) == 3
    assert all(t.stop_reason is not StopReason.ABORTED for t in result.trajectories)


@pytest.mark.parametrize("agent_proxy, key", [
    ({"over_sample": 0.9}, "agent_proxy.over_sample"),
    ({"over_sample": 1.25, "async_generation_ratio": 1}, "agent_proxy.over_sample"),
    ({"over_sample": 1.25, "rollout_mode": "fully_async"}, "agent_proxy.over_sample"),
    ({"unfinished": "keep"}, "agent_proxy.unfinished"),
    ({"max_carry_staleness": 0}, "agent_proxy.max_carry_staleness"),
])
def test_bad_over_sampling_settings_are_refused_naming_the_key(agent_proxy, key):
    from ragen.llm_agent import AgentSetup

    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        AgentSetup.from_config({
            "custom_envs": custom_envs(), "agent_proxy": agent_proxy,
            "es_manager": {"train": {"env_groups": 2, "group_size": 1,
                                     "env_configs": {"tags": ["FrozenLake"], "n_groups": [2]}},
                           "val": {"env_groups": 1, "group_size": 1,
                                   "env_configs": {"tags": ["FrozenLake"], "n_groups": [1]}}}})


def test_a_dumped_over_sampled_batch_replays_identically_its_aborted_envs_too(tmp_path):
    from ragen.rollout.dump import read_dump, write_dump
    from ragen.tools.replay import replay

    engine = streaming_engine(step_s=0.002, tokens_median=30)
    with _proxy(engine, over_sample=1.5, unfinished="abort") as proxy:
        result = _batches(proxy, engine, 1)[0]
        path = write_dump(tmp_path, "d", result, proxy.setup.loop, split="train", step=0)
    records = read_dump(path)
    assert any(r.trajectory.stop_reason is StopReason.ABORTED for r in records)
    assert all(replay(r).identical for r in records)


def test_refilled_abort_batches_report_the_groups_played_to_their_end():
    """Refills after an over-sampled cut recompute the outcome metrics over the groups played: the
    aborted groups, left out before the filter, stay out of them."""
    engine = streaming_engine(step_s=0.002, tokens_median=30)
    with _proxy(engine, over_sample=1.5, unfinished="abort", rollout_filter="nonzero_variance",
                max_refill=1) as proxy:
        result = _batches(proxy, engine, 1)[0]
    assert result.metrics["fill/refill_rounds"] == 1
    assert "aborted" in result.dropped_groups.values()
    assert result.metrics["rollout/stop/aborted"] == 0


def test_a_checkpoint_of_carried_groups_names_no_env_type_and_the_resumed_run_makes_their_specs(caplog):
    from ragen.rollout.envs import EnvSpecMaker
    from ragen.rollout.oversample import OverSample
    from ragen.rollout.types import Trajectory

    def maker(tags):
        return EnvSpecMaker("train", {"env_groups": len(tags), "group_size": 1,
                                      "env_configs": {"tags": tags, "n_groups": [1] * len(tags)}}, custom_envs(), 5)

    spec = dataclasses.replace(specs_for(["FrozenLake"], [1], 1, custom_envs())[0], env_id=9, group_id=9,
                               env_type="h29_not_this:Env")
    over = OverSample(1.5, "carry", 1)
    over.carried = [[(spec, Trajectory(env_id=9, group_id=9, tag="FrozenLake", seed=spec.seed))]]
    state = over.state_dict()
    assert "h29_not_this" not in repr(state)
    resumed = OverSample(1.5, "carry", 1)
    resumed.load_state_dict(state, maker(["FrozenLake"]))
    (got, traj), = resumed.carried[0]
    assert (got.tag, got.seed, got.env_id, got.group_id) == ("FrozenLake", spec.seed, 9, 9)
    assert got.env_type == maker(["FrozenLake"]).tag_specs["FrozenLake"]["env_type"] and traj.env_id == 9
    elsewhere = OverSample(1.5, "carry", 1)
    elsewhere.load_state_dict(state, maker(["Bandit"]))
    assert elsewhere.carried == [] and "es_manager.train does not play the tag" in caplog.text


def _carried_state(group_size: int, groups: int = 2) -> dict:
    """A checkpoint's over_sample entry: ``groups`` carried FrozenLake groups of ``group_size`` envs."""
    from ragen.rollout.oversample import OverSample
    from ragen.rollout.types import Trajectory

    specs = specs_for(["FrozenLake"], [groups], group_size, custom_envs())
    over = OverSample(1.5, "carry", 1)
    over.carried = [[(s, Trajectory(env_id=s.env_id, group_id=s.group_id, tag=s.tag, seed=s.seed))
                     for s in specs if s.group_id == g] for g in range(groups)]
    return over.state_dict()


def _frozen_lake(group_size: int):
    from ragen.rollout.envs import EnvSpecMaker

    return EnvSpecMaker("train", {"env_groups": 4, "group_size": group_size,
                                  "env_configs": {"tags": ["FrozenLake"], "n_groups": [4]}}, custom_envs(), 5)


def test_carried_groups_of_another_group_size_are_left_out_with_a_warning(caplog):
    """A run resumed with another es_manager.train.group_size: the checkpoint's carried groups
    (of the old size) would deal env ids twice and groups of the wrong size; they are dropped,
    and the warning names the key."""
    from ragen.rollout.oversample import OverSample

    over = OverSample(1.5, "carry", 1)
    over.load_state_dict(_carried_state(group_size=4), _frozen_lake(group_size=2))
    assert over.carried == []
    assert "es_manager.train.group_size is 2" in caplog.text and "4 envs" in caplog.text
    specs = over.deal(_frozen_lake(group_size=2), 0)
    assert len({s.env_id for s in specs}) == len(specs)
    assert {len([s for s in specs if s.group_id == g]) for g in {s.group_id for s in specs}} == {2}
    same = OverSample(1.5, "carry", 1)  # the same size: kept
    same.load_state_dict(_carried_state(group_size=2), _frozen_lake(group_size=2))
    assert len(same.carried) == 2


@pytest.mark.parametrize("damage, entry", [
    (lambda s: s["carried"][1][0].pop("seed"), r"over_sample\.carried\[1\]\[0\]: .*'seed'"),
    (lambda s: s["carried"].__setitem__(0, []), r"over_sample\.carried\[0\]: .*no env"),
    (lambda s: s["carried"][0].__setitem__(1, "x"), r"over_sample\.carried\[0\]\[1\]: .*str"),
    (lambda s: s["carried"][1][1].__setitem__("trajectory", None), r"over_sample\.carried\[1\]\[1\]\.trajectory"),
    (lambda s: s["carried"][0][0].__setitem__("env_id", "3"), r"over_sample\.carried\[0\]\[0\]\.env_id"),
    (lambda s: s.pop("carried"), r"over_sample\.carried"),
], ids=["no-seed", "empty-group", "not-a-dict", "no-trajectory", "env-id-a-string", "no-carried"])
def test_a_damaged_carried_entry_is_named(damage, entry):
    from ragen.rollout.oversample import OverSample

    state = _carried_state(group_size=2)
    damage(state)
    with pytest.raises(ValueError, match=entry):
        OverSample(1.5, "carry", 1).load_state_dict(state, _frozen_lake(group_size=2))

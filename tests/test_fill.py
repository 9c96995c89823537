"""A training batch of whole groups of signal (``ragen.rollout.fill``): groups with a failed env
or no reward variance are dropped and refilled, envs that keep failing are quarantined."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from ragen.env.base import BaseDiscreteActionEnv, BaseEnvConfig
from ragen.llm.scripted import ScriptedEngine
from ragen.rollout.fill import FAILED, NO_SIGNAL, Quarantine, group_drops
from ragen.rollout.types import StopReason, Trajectory, Turn

from tests.rollout_helpers import custom_envs, fault_tag

pytestmark = pytest.mark.timeout(120)


@dataclass
class CoinConfig(BaseEnvConfig):
    action_lookup: dict = field(default_factory=lambda: {0: "Heads", 1: "Tails"})  # the prompt lists them


class CoinEnv(BaseDiscreteActionEnv):
    """One toss: on an odd seed Heads wins 1; on an even seed nothing pays (a group without signal)."""

    ACTION_LOOKUP = {0: "Heads", 1: "Tails"}

    def __init__(self, config=None):
        super().__init__(config or CoinConfig())
        self.seed = 0

    def reset(self, seed=None, **kwargs):
        self.seed = seed or 0
        return "Toss: Heads or Tails."

    def step(self, action):
        won = self.seed % 2 == 1 and action == 0
        return "Tossed.", float(won), True, {"action_is_valid": True, "action_is_effective": True, "success": won}

    def render(self, mode="text"):
        return "Toss: Heads or Tails."


COIN = {"env_type": "tests.test_fill:CoinEnv", "config_type": "tests.test_fill:CoinConfig",
        "max_actions_per_traj": 1, "env_instruction": "Toss.", "env_config": None}


def _proxy(tags: dict, train_tags: list[str], val_tags: list[str] | None = None, env_groups: int = 4,
           group_size: int = 4, **agent_proxy):
    from ragen.llm_agent import AgentSetup, LLMAgentProxy

    val_tags = val_tags or train_tags
    setup = AgentSetup.from_config({
        "custom_envs": custom_envs(**tags), "seed": {"train": 100, "val": 7},
        "agent_proxy": {"max_turn": 3, **agent_proxy},
        "es_manager": {
            "train": {"env_groups": env_groups, "group_size": group_size,
                      "env_configs": {"tags": train_tags, "n_groups": [env_groups]}},
            "val": {"env_groups": 2, "group_size": 1, "env_configs": {"tags": val_tags, "n_groups": [2]}}}})
    return LLMAgentProxy(setup, ScriptedEngine())


def _kept(result) -> set[int]:
    return {t.group_id for t in result.trajectories} - set(result.dropped_groups)


def test_the_drops_name_failed_groups_and_groups_without_signal():
    def traj(group, reward, stop=StopReason.DONE):
        return Trajectory(env_id=0, group_id=group, tag="T", seed=group, stop_reason=stop,
                          turns=[Turn("s", 1, "", [], [], reward, 0.0, {}, 0)])

    trajs = [traj(0, 0.0), traj(0, 1.0), traj(1, 0.5), traj(1, 0.5), traj(2, 1.0), traj(2, 0.0, StopReason.ERROR)]
    assert group_drops(trajs, "none") == {2: FAILED}
    assert group_drops(trajs, "nonzero_variance") == {1: NO_SIGNAL, 2: FAILED}


def test_refill_keeps_every_training_batch_full_of_groups_with_signal():
    with _proxy({"Coin": COIN}, ["Coin"], rollout_filter="nonzero_variance", max_refill=8) as proxy:
        for _ in range(4):
            result = proxy.next_train_batch(0)
            m = result.metrics
            assert len(_kept(result)) == 4 and m["fill/groups_kept"] == 4 and m["fill/groups_missing"] == 0
            assert m["fill/dropped_no_signal"] >= 1  # about half the seeds are even: their groups carry nothing
            assert m["fill/groups_sampled"] == 4 + m["fill/dropped_no_signal"] + m["fill/dropped_failed"]
            for g in _kept(result):  # every kept group has rewards that differ
                assert len({t.reward for t in result.trajectories if t.group_id == g}) > 1
            for g, why in result.dropped_groups.items():
                assert why == NO_SIGNAL and {t.seed % 2 for t in result.trajectories if t.group_id == g} == {0} \
                    or len({t.reward for t in result.trajectories if t.group_id == g}) == 1
            ids = [t.env_id for t in result.trajectories]
            assert ids == sorted(set(ids)) and [s.env_id for s in result.specs] == ids  # unique, aligned
    # without refill, the groups are dropped and the batch is short, said in the metrics
    with _proxy({"Coin": COIN}, ["Coin"], rollout_filter="nonzero_variance") as proxy:
        result = proxy.next_train_batch(0)
        assert result.metrics["fill/refill_rounds"] == 0
        assert result.metrics["fill/groups_missing"] == len(result.dropped_groups) > 0


@pytest.mark.parametrize("fault", ["raise_step", "raise_reset"])
def test_a_group_with_a_failed_env_is_never_trained_and_is_refilled(fault):
    from tests.rollout_helpers import specs_for

    seeds = sorted({s.seed for s in specs_for(["Fault"], [4], 2, custom_envs(Fault=fault_tag()), seed=100)})
    bad = fault_tag(fault, fault_seed=seeds[2])
    with _proxy({"Fault": bad}, ["Fault"], env_groups=4, group_size=2, max_refill=1, env_retries=0) as proxy:
        result = proxy.next_train_batch(0)
    assert result.dropped_groups == {2: FAILED}
    assert len(_kept(result)) == 4 and result.metrics["fill/dropped_failed"] == 1
    refill = [t for t in result.trajectories if t.group_id == 4]
    assert len(refill) == 2 and refill[0].tag == "Fault" and refill[0].seed not in seeds


def test_the_trainer_leaves_the_dropped_groups_out():
    from ragen.rollout.types import RolloutResult
    from ragen.trainer.samples import make_samples

    with _proxy({"Coin": COIN}, ["Coin"], rollout_filter="nonzero_variance") as proxy:
        result = proxy.next_train_batch(0)
    assert result.dropped_groups

    from ragen.llm.scripted import byte_chat
    from ragen.rollout.context import ContextManager
    from ragen.trainer.config import TrainerConfig

    cfg = TrainerConfig()
    samples, metrics = make_samples(result, ContextManager(proxy.setup.loop.context), byte_chat(), cfg,
                                    proxy.setup.loop.context)
    kept = _kept(result)
    assert {s.group_key for s in samples} == kept and metrics["batch/dropped_groups"] == len(result.dropped_groups)
    assert isinstance(result, RolloutResult)


def test_a_poison_seed_is_quarantined_and_its_group_plays_another_seed(caplog, tmp_path):
    from ragen.rollout.dump import read_dump, write_dump

    poison = 8  # the second val group's seed (val seeds 7, 8)
    tags = {"Fault": fault_tag("raise_reset", fault_seed=poison)}
    with _proxy(tags, ["Fault"], env_groups=2, group_size=1, quarantine_after=2, quarantine_rollouts=3,
                env_retries=0) as proxy, caplog.at_level(logging.WARNING, logger="ragen.rollout.fill"):
        seeds = []
        for _ in range(6):
            result = proxy.rollout("val")
            seeds.append([t.seed for t in result.trajectories])
            assert result.metrics["quarantine/replaced_groups"] == (1 if 10 in seeds[-1] else 0)
            if 10 in seeds[-1]:  # the dump says which seed the group replaced
                path = write_dump(tmp_path, "val", result, proxy.setup.val_loop, "val", 0)
                assert [r.spec.replaces_seed for r in read_dump(path)] == [None, 8]
            stops = [t.stop_reason for t in result.trajectories]
            assert stops.count(StopReason.ERROR) == (1 if poison in seeds[-1] else 0)
        specs = proxy.setup.es["val"].make_specs()
    # failed twice in a row, then set aside for 3 rollouts (played 9 = 8 + env_groups), then dealt again
    assert seeds == [[7, 8], [7, 8], [7, 10], [7, 10], [7, 10], [7, 8]]
    warned = [r for r in caplog.records if "quarantined" in r.getMessage()]
    assert len(warned) == 1 and "seed 8" in warned[0].getMessage() and "injected reset failure" in warned[0].getMessage()
    assert [s.replaces_seed for s in specs] == [None, None]
    assert result.metrics["quarantine/held"] == 0


def test_quarantine_counts_only_rollouts_in_a_row():
    q = Quarantine(after=2, rollouts=5, split="train")

    def played(error: bool) -> list[Trajectory]:
        return [Trajectory(env_id=0, group_id=0, tag="T", seed=3,
                           stop_reason=StopReason.ERROR if error else StopReason.DONE, error="boom" if error else None)]

    q.record(played(True))
    q.record(played(False))  # a good play starts the count again
    q.record(played(True))
    assert not q.holds("T", 3)
    q.record(played(True))
    assert q.holds("T", 3) and q.held == [("T", 3)]


@pytest.mark.parametrize("key, value, words", [
    ("max_refill", -1, "agent_proxy.max_refill"),
    ("quarantine_after", 0, "agent_proxy.quarantine_after"),
    ("rollout_filter", "std", "agent_proxy.rollout_filter"),
])
def test_bad_values_are_refused_naming_the_key(key, value, words):
    with pytest.raises(ValueError, match=words):
        _proxy({"Coin": COIN}, ["Coin"], **{key: value})


def test_refill_is_refused_where_batches_are_played_in_the_background():
    with pytest.raises(ValueError, match="agent_proxy.max_refill=2.*async_generation_ratio"):
        _proxy({"Coin": COIN}, ["Coin"], max_refill=2, async_generation_ratio=1)


def test_a_checkpointed_env_set_deals_the_refill_seeds_it_would_have():
    """The seeds set aside for refills (and an over-sampled rollout's extra groups) are in the
    env set's state: a run resumed from it deals the next ones, never one already dealt."""
    from ragen.rollout.envs import EnvSpecMaker

    def maker():
        return EnvSpecMaker("train", {"env_groups": 4, "group_size": 1,
                                      "env_configs": {"tags": ["FrozenLake"], "n_groups": [4]}}, custom_envs(), 100)

    first = maker()
    first.make_specs()
    first.refill_specs(["FrozenLake"] * 3, 10)  # 3 of the 4 seeds of a block set aside
    resumed = maker()
    resumed.load_state_dict(first.state_dict())
    want = [(s.seed, s.group_id) for s in first.refill_specs(["FrozenLake"] * 2, 20) + first.make_specs()]
    assert [(s.seed, s.group_id) for s in resumed.refill_specs(["FrozenLake"] * 2, 20) + resumed.make_specs()] == want
    old = maker()
    old.load_state_dict({"rollouts": 3})  # a checkpoint written before the refill seeds were kept in it
    assert old.make_specs()[0].seed == 112

"""verl's token record of an episode (``ragen.verl``), without verl: the env side on
worker processes or inline, answers from a token-in, token-out "server" over our
hf engine, and the record checked against our own rollout of the same seeds."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.types import SamplingParams
from ragen.rollout.types import StopReason, rollout_digest
from ragen.verl.env_side import EnvSide
from ragen.verl.episode_tokens import METRIC_KEYS, play_tokens, record_of
from ragen.verl.setup import VerlEnvs, env_workers
from tests.rollout_helpers import custom_envs, fault_tag, loop_config, sequential, specs_for

pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from ragen.llm.hf import HFEngine

    return HFEngine(tiny_model_path, device="cpu", turn_cache_mb=0)


def _config(max_turn: int = 3):
    config = loop_config(max_turn=max_turn)
    return replace(config, sampling=GREEDY)


def _server(engine, sampling=GREEDY, calls=None):
    async def generate(prompt_ids, max_tokens):
        if calls is not None:
            calls.append((list(prompt_ids), max_tokens))
        ids, logprobs, _ = engine.complete_ids(prompt_ids, max_tokens, sampling)
        return ids, logprobs
    return generate


def _play(specs, config, engine, workers=0, generate=None, response_length=4096, prompt_length=4096,
          backend="loky"):
    chat = ChatTokens.of(engine.tokenizer)
    side = EnvSide(workers, backend)

    def decode(ids):
        return engine.tokenizer.decode(ids, skip_special_tokens=True)

    async def all_of():
        return await asyncio.gather(*[
            play_tokens(s, config, side, chat, decode, generate or _server(engine),
                        response_length=response_length, prompt_length=prompt_length,
                        vocab_size=engine.vocab_size) for s in specs])
    try:
        return asyncio.run(all_of())
    finally:
        side.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_the_record_equals_our_rollout_of_the_same_seeds(hf, workers):
    """Token ids, masks and log-probs as our own rollout (token_history: append) gives them,
    on the env side inline and on worker processes; a group shares its initial state."""
    specs = specs_for(["SimpleSokoban", "Bandit"], [1, 1], 2, custom_envs())
    config = _config()
    ours = sequential(specs, config, hf)
    records = _play(specs, config, hf, workers=workers)
    assert rollout_digest([r.trajectory for r in records]) == rollout_digest(ours)
    for record, traj in zip(records, ours):
        assert len(traj.turns) >= 1
        want = record_of(traj)
        assert record.prompt_ids == want.prompt_ids
        assert record.response_ids == want.response_ids
        assert record.response_mask == want.response_mask
        assert record.response_logprobs == pytest.approx(want.response_logprobs, abs=1e-4)
        assert record.reward == pytest.approx(traj.reward)
        assert record.num_turns == len(traj.turns)
        assert sorted(record.metrics()) == sorted(METRIC_KEYS)
    # the two members of each group: one seed, one initial state, one first prompt
    assert records[0].trajectory.turns[0].observation == records[1].trajectory.turns[0].observation
    assert records[0].prompt_ids == records[1].prompt_ids
    if any(len(t.turns) > 1 for t in ours):
        assert 0 in records[0].response_mask + records[2].response_mask  # a next prompt's tokens, masked


def _answering(engine, text: str):
    """A server that always answers ``text`` (after the prompt's "<think>") and ends its turn."""
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"] + [engine.tokenizer.eos_token_id]

    async def generate(prompt_ids, max_tokens):
        return ids[:max_tokens], [-0.5] * min(len(ids), max_tokens)
    return generate


def test_an_env_that_raises_ends_its_sample_with_zero_reward_and_an_error_metric(hf):
    envs = custom_envs(Faulty=fault_tag("raise_step", fault_seed=7))
    specs = specs_for(["Faulty"], [2], 1, envs)  # seeds 7 (raises) and 8
    records = _play(specs, _config(), hf, workers=1, generate=_answering(hf, "go</think><answer>Down</answer>"))
    bad, good = records
    assert bad.trajectory.stop_reason == StopReason.ERROR and bad.failed
    assert bad.reward == 0.0 and bad.metrics()["ragen/error"] == 1.0
    assert len(bad.prompt_ids) > 0  # its reset went through: the record holds what was played
    assert not good.failed and good.metrics()["ragen/error"] == 0.0 and good.trajectory.num_actions >= 1


def test_ids_out_of_range_end_that_sample_in_error(hf):
    specs = specs_for(["Bandit", "SimpleSokoban"], [1, 1], 1, custom_envs())
    real = _server(hf)

    async def generate(prompt_ids, max_tokens):
        ids, logprobs = await real(prompt_ids, max_tokens)
        if prompt_ids[:3] == first[:3] and len(prompt_ids) == len(first):
            return [hf.vocab_size + 5] + ids[1:], logprobs
        return ids, logprobs

    first = _play(specs[:1], _config(), hf)[0].prompt_ids
    bad, good = _play(specs, _config(), hf, generate=generate)
    assert bad.failed and "token" in bad.trajectory.error and bad.reward == 0.0
    assert not good.failed


def test_the_record_stops_at_response_length_and_each_answer_is_capped_by_what_is_left(hf):
    specs = specs_for(["SimpleSokoban"], [1], 1, custom_envs())
    calls = []
    (whole,) = _play(specs, _config(max_turn=5), hf)
    first = len(whole.trajectory.turns[0].response_ids)
    assert len(whole.response_ids) > first + 8  # the next prompt adds more than 8 ids
    limit = first + 8
    (record,) = _play(specs, _config(max_turn=5), hf, generate=_server(hf, calls=calls), response_length=limit)
    assert record.truncated and record.metrics()["ragen/truncated"] == 1.0
    assert record.response_ids == whole.response_ids[:limit]
    assert len(record.response_mask) == len(record.response_logprobs) == limit
    # one call, capped by the tag's, the sampling's and what is left; nothing is left for a second answer
    assert [c[1] for c in calls] == [min(specs[0].max_tokens, GREEDY.max_tokens, limit)]
    assert record.trajectory.stop_reason == StopReason.MAX_TURNS and len(record.trajectory.turns) == 1
    assert not record.failed


def test_a_first_prompt_past_prompt_length_names_the_key(hf):
    specs = specs_for(["Bandit"], [1], 1, custom_envs())
    with pytest.raises(ValueError, match="data.max_prompt_length=8"):
        _play(specs, _config(), hf, prompt_length=8)


def test_a_dead_env_process_ends_its_episodes_in_error_and_the_next_ones_play(hf):
    envs = custom_envs(Exits=fault_tag("exit_step", fault_seed=7))
    specs = specs_for(["Exits"], [2], 1, envs)
    answer = _answering(hf, "go</think><answer>Down</answer>")
    bad, good = _play(specs, _config(), hf, workers=1, generate=answer)
    assert bad.failed and "env side failed" in bad.trajectory.error
    # the other episode shared the dead process: it ends in error too, or, started after, plays
    assert good.failed or good.trajectory.turns
    (again,) = _play(specs[1:], _config(), hf, workers=1, generate=answer)
    assert not again.failed and again.trajectory.num_actions >= 1


# ----- the setup: keys and rows ------------------------------------------------------

def _cfg(**agent_proxy):
    return {"custom_envs": custom_envs(), "agent_proxy": {"max_turn": 3, **agent_proxy},
            "es_manager": {"train": {"env_groups": 1, "group_size": 2,
                                     "env_configs": {"tags": ["Bandit"], "n_groups": [1]}},
                           "val": {"env_groups": 1, "group_size": 1,
                                   "env_configs": {"tags": ["Bandit"], "n_groups": [1]}}}}


def test_a_row_names_its_env_and_bad_rows_name_the_row_and_key():
    envs = VerlEnvs(_cfg())
    spec, config = envs.spec({"tag": "SimpleSokoban", "seed": 5, "split": "val", "index": 3})
    assert (spec.tag, spec.seed, spec.mode, config.max_turn) == ("SimpleSokoban", 5, "val", 3)
    with pytest.raises(ValueError, match=r"dataset row 7: no 'seed' key"):
        envs.spec({"tag": "Bandit", "index": 7})
    with pytest.raises(ValueError, match=r"dataset row 8: tag: tag 'Nope' is not in custom_envs"):
        envs.spec({"tag": "Nope", "seed": 1, "index": 8})
    with pytest.raises(ValueError, match=r"dataset row 9: seed='x'"):
        envs.spec({"tag": "Bandit", "seed": "x", "index": 9})
    for seed in (float("inf"), float("nan"), 1.5):
        with pytest.raises(ValueError, match=rf"dataset row 10: seed={seed!r} is not a whole number"):
            envs.spec({"tag": "Bandit", "seed": seed, "index": 10})
    assert envs.spec({"tag": "Bandit", "seed": 4.0, "index": 11})[0].seed == 4


@pytest.mark.parametrize("key", ["agent_proxy.max_turn", "custom_envs"])
def test_a_config_without_max_turn_or_env_configs_is_refused_naming_the_key(key):
    cfg = _cfg()
    section, _, name = key.partition(".")
    if name:
        del cfg[section][name]
    else:
        del cfg[section]
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + " is not set"):
        VerlEnvs(cfg, "my.yaml")


def test_a_config_that_rerenders_prompts_is_refused_naming_the_key():
    cfg = {**_cfg(), "ctx_manager": {"token_history": "rerender"}}
    with pytest.raises(ValueError, match="ctx_manager.token_history='rerender'"):
        VerlEnvs(cfg)


def test_env_workers_follow_the_parallel_keys():
    assert env_workers(False, 4) == 0
    assert env_workers(True, 3, agent_workers=8) == 3
    assert env_workers(True, -1, agent_workers=1) >= 1
    assert VerlEnvs(_cfg(use_parallel_rollout=True, parallel_n_jobs=2)).env_workers == 2


@pytest.mark.parametrize("backend", ["threading", "multiprocessing", "ray"])
def test_every_env_backend_plays_the_same_record(hf, backend):
    """Threads, spawned processes and Ray actors hold the env side as loky's processes do."""
    if backend == "ray":
        ray = pytest.importorskip("ray")
        ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        specs = specs_for(["SimpleSokoban", "Bandit"], [1, 1], 1, custom_envs())
        want = _play(specs, _config(), hf, workers=0)
        got = _play(specs, _config(), hf, workers=2, backend=backend)
        assert [r.response_ids for r in got] == [r.response_ids for r in want]
        assert rollout_digest([r.trajectory for r in got]) == rollout_digest([r.trajectory for r in want])
    finally:
        if backend == "ray":
            ray.shutdown()


def test_a_dead_ray_actor_ends_its_episodes_in_error_and_a_fresh_one_plays(hf):
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        envs = custom_envs(Exits=fault_tag("exit_step", fault_seed=7))
        specs = specs_for(["Exits"], [2], 1, envs)
        answer = _answering(hf, "go</think><answer>Down</answer>")
        bad, _ = _play(specs, _config(), hf, workers=1, backend="ray", generate=answer)
        assert bad.failed and "Actor" in bad.trajectory.error
        (again,) = _play(specs[1:], _config(), hf, workers=1, backend="ray", generate=answer)
        assert not again.failed and again.trajectory.num_actions >= 1
    finally:
        ray.shutdown()


def test_config_backends_reach_the_env_side():
    assert VerlEnvs(_cfg(use_parallel_rollout=True, parallel_n_jobs=2, parallel_backend="ray")).env_backend == "ray"
    assert VerlEnvs(_cfg(use_parallel_rollout=True, parallel_backend="sequential")).env_workers == 0
    with pytest.raises(ValueError, match="agent_proxy.parallel_backend='dask'"):
        VerlEnvs(_cfg(use_parallel_rollout=True, parallel_n_jobs=2, parallel_backend="dask"))

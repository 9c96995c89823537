"""Multi-turn episodes keep the tokens the engine saw and sampled, turn by turn.

Through the turn loop (``token_history: append``), each turn's prompt, as the
engine fed it to the model, is the episode's ids so far (``episode_ids``) and the
turn's ``prompt_ids``; it starts with the previous prompt and answer; the turn's
answer ids and log-probs are those sampled. On the tiny random model (whose
answers, often cut by ``max_tokens``, do not encode back to their ids) and on the
scripted engine with a tokenizer that merges byte pairs (its answers' bytes are
not what their text encodes to, so a re-rendered prompt would differ); and a
parallel rollout has the sequential one's ids.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.scripted import ScriptedEngine, render_messages
from ragen.rollout.types import episode_ids
from tests.rollout_helpers import custom_envs, loop_config, sequential, specs_for


def token_fields(trajectories):
    """What the trajectories' equality leaves out: each turn's prompt and answer ids."""
    return [[(t.prompt_start, t.prompt_ids, t.response_ids) for t in traj.turns] for traj in trajectories]


# byte pairs the test tokenizer encodes as one id each: inside the scripted answers
# ("</think><answer>") and across their ends ("</answer>" then the template's "\n<|user|>")
_MERGES = {b"><": 256, b">\n": 257, b"\n<": 258}


def merging_encode(text: str) -> list[int]:
    """Utf-8 bytes, each pair of ``_MERGES`` one id (left to right)."""
    data, ids, i = text.encode("utf-8"), [], 0
    while i < len(data):
        merged = _MERGES.get(data[i: i + 2])
        ids.append(data[i] if merged is None else merged)
        i += 1 if merged is None else 2
    return ids


def merging_scripted_engine(**options) -> ScriptedEngine:
    """The scripted engine with the merging tokenizer for its prompts; its answers stay bytes,
    as a model's sampled tokens need not be the ones their text encodes to: an appended
    prompt and the full render of the same messages differ in their ids."""
    engine = ScriptedEngine(**options)
    engine.chat = ChatTokens(render_messages, merging_encode, {}, "scripted-merging")
    engine.vocab_size = 256 + len(_MERGES)  # the bytes and the merged pairs: the manager checks ids against it
    return engine


def assert_appended(trajectories) -> None:
    """Every later turn's prompt starts with all of the episode's ids before it, the answers
    as sampled (with a tokenizer under which they do not encode back to their ids, a prompt
    rendered whole shares only a shorter start)."""
    for traj in trajectories:
        for k, turn in enumerate(traj.turns):
            if k:
                assert turn.prompt_start == len(episode_ids(traj.turns[:k])), (traj.env_id, k)


def sampling_capped(specs):
    """The specs without a token cap of their own: the sampling's ``max_tokens`` applies
    (a request's own cap, the env's ``max_tokens``, wins over it)."""
    return [replace(spec, max_tokens=None) for spec in specs]


def cut_specs():
    """Multi-turn envs whose answers of more than 60 tokens are cut (the scripted ones are 20-80)."""
    specs = specs_for(["SimpleSokoban", "FrozenLake", "Countdown"], [2, 2, 1], 2, custom_envs())
    return [replace(spec, max_tokens=60) for spec in specs]


def check_turns(trajectories, fed: dict, sampled: dict) -> int:
    """Each turn's prompt rebuilt from the trajectory is the one the engine fed, and starts with
    the previous prompt and answer; the answer's ids and log-probs are those sampled. ``fed``
    and ``sampled``: per episode (seed, env_id), the engine's prompts and (ids, log-probs) in
    turn order. Returns the number of turns checked."""
    checked = 0
    for traj in trajectories:
        episode = (traj.seed, traj.env_id)
        assert len(fed[episode]) == len(traj.turns)
        for k, turn in enumerate(traj.turns):
            before = episode_ids(traj.turns[:k])
            prompt = before[: turn.prompt_start] + list(turn.prompt_ids)
            assert prompt == fed[episode][k], (episode, k)
            if k:  # appended: the whole history, the sampled answer included
                assert turn.prompt_start == len(before)
                previous = traj.turns[k - 1]
                assert prompt[: len(before)] == fed[episode][k - 1] + list(previous.response_ids)
            ids, logprobs = sampled[episode][k]
            assert list(turn.response_ids) == ids
            assert turn.logprobs is not None and list(turn.logprobs) == logprobs
            checked += 1
        assert episode_ids(traj.turns) == fed[episode][-1] + sampled[episode][-1][0]
    return checked


@pytest.mark.parametrize("tag", ["SimpleSokoban", "FrozenLake"])
def test_hf_multi_turn_prompts_are_the_ids_the_model_was_fed(tiny_model_path, tag):
    from ragen.llm.hf import HFEngine

    engine = HFEngine(tiny_model_path, device="cpu")
    fed: dict = {}
    sampled: dict = {}
    chunk = engine._generate_chunk

    def recording(prompts, limits, seeds, episodes, last, sampling, *more):
        outputs = chunk(prompts, limits, seeds, episodes, last, sampling, *more)
        for prompt, episode, (ids, _, logprobs) in zip(prompts, episodes, outputs):
            fed.setdefault(episode, []).append(list(prompt))
            sampled.setdefault(episode, []).append((list(ids), list(logprobs)))
        return outputs

    engine._generate_chunk = recording
    specs = sampling_capped(specs_for([tag], [3], 2, custom_envs()))
    config = loop_config(max_turn=4)
    config = replace(config, sampling=replace(config.sampling, temperature=1.0, max_tokens=10, seed=5))
    trajectories = sequential(specs, config, engine)
    turns = [t for traj in trajectories for t in traj.turns]
    assert check_turns(trajectories, fed, sampled) == len(turns) >= 2 * len(specs)
    assert max(len(traj.turns) for traj in trajectories) >= 3
    assert sum(t.finish_reason == "length" for t in turns) >= len(turns) // 2  # most answers cut
    assert all(len(t.response_ids) <= 10 for t in turns)  # at the config's max_tokens
    # answers that do not encode back to their ids: a re-rendered prompt would have changed them
    tokenizer = engine.tokenizer
    assert any(tokenizer(tokenizer.decode(t.response_ids), add_special_tokens=False)["input_ids"]
               != list(t.response_ids) for t in turns)
    assert engine.stats().history_divergences == 0


def test_scripted_multi_turn_prompts_are_the_ids_the_engine_saw():
    engine = merging_scripted_engine(malformed_rate=0.3)
    fed: dict = {}
    sampled: dict = {}
    generate = engine.generate

    def recording(requests, sampling):
        completions = generate(requests, sampling)
        for request, completion in zip(requests, completions):
            episode = (request.seed, request.env_id)
            fed.setdefault(episode, []).append(list(completion.prompt_token_ids))
            sampled.setdefault(episode, []).append((list(completion.response_token_ids), list(completion.logprobs)))
        return completions

    engine.generate = recording
    specs = cut_specs()
    trajectories = sequential(specs, loop_config(max_turn=4), engine)
    turns = [t for traj in trajectories for t in traj.turns]
    assert check_turns(trajectories, fed, sampled) == len(turns)
    assert max(len(traj.turns) for traj in trajectories) >= 3
    assert any(t.finish_reason == "length" for t in turns)
    # answers whose ids are not what their text encodes to: a re-rendered prompt would have changed them
    assert any(merging_encode(bytes(t.response_ids).decode()) != list(t.response_ids) for t in turns)
    assert engine.stats().history_divergences == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine_name", ["scripted", "hf"])
def test_parallel_equals_sequential_ids_included(engine_name, tiny_model_path):
    """Workers get each prompt's ids back (sent as the ids after the request's history), so
    their next prompts append as the sequential loop's do: the same ids, turn by turn."""
    from ragen.llm.hf import HFEngine
    from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings
    from ragen.serving import SharedLLMInferenceManager

    config = loop_config(max_turn=4)
    if engine_name == "hf":
        engine = HFEngine(tiny_model_path, device="cpu")
        specs = sampling_capped(specs_for(["SimpleSokoban", "FrozenLake"], [2, 2], 2, custom_envs()))
        config = replace(config, sampling=replace(config.sampling, temperature=1.0, max_tokens=10, seed=5))
    else:
        engine = merging_scripted_engine(malformed_rate=0.2)
        specs = cut_specs()
    reference = sequential(specs, config, engine)
    assert max(len(traj.turns) for traj in reference) >= 3
    assert all(t.prompt_ids and t.response_ids for traj in reference for t in traj.turns)
    assert_appended(reference)  # the ids of each answer, as sampled, lead the next prompt
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.005) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="loky")) as prm:
        result = prm.rollout(specs, config)
    assert result.trajectories == reference
    assert token_fields(result.trajectories) == token_fields(reference)
    got = [lp for traj in result.trajectories for t in traj.turns for lp in t.logprobs]
    want = [lp for traj in reference for t in traj.turns for lp in t.logprobs]
    assert got == pytest.approx(want, abs=1e-4)  # float32 kernels over other batches round otherwise


def test_a_template_that_rewrites_history_is_counted_in_the_rollout_metrics(caplog):
    """The scripted engine with a template that drops earlier thoughts: every appended prompt
    diverges from its full render; the rollout's metrics count them, one warning names it."""
    import logging
    import re

    from ragen.llm.chat_tokens import ChatTokens
    from ragen.llm.scripted import render_messages
    from ragen.rollout.backends.sequential import SequentialRollout

    def forgetful(messages, add_generation_prompt):
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        kept = [{**m, "content": re.sub(r"<think>.*?</think>", "", m["content"], flags=re.S)}
                if m["role"] == "assistant" and i < last_user else m for i, m in enumerate(messages)]
        return render_messages(kept, add_generation_prompt)

    engine = ScriptedEngine()
    engine.chat = ChatTokens(forgetful, lambda text: list(text.encode()), {}, "forgetful-template")
    backend = SequentialRollout(engine)
    try:
        with caplog.at_level(logging.WARNING):
            result = backend.rollout(specs_for(["SimpleSokoban"], [2], 2, custom_envs()), loop_config(max_turn=3))
    finally:
        backend.close()
    later_turns = sum(max(0, len(t.turns) - 1) for t in result.trajectories)
    assert later_turns > 0 and result.metrics["engine/history_divergences"] == later_turns
    assert len([r for r in caplog.records if "forgetful-template" in r.getMessage()]) == 1
    # the prompts still lead with the sampled ids
    for traj in result.trajectories:
        for k, turn in enumerate(traj.turns):
            assert turn.prompt_start == len(episode_ids(traj.turns[:k]))


def test_the_training_sequence_of_a_scripted_rollout_is_its_ids_every_answer_token_with_its_log_prob():
    """The trainer's sequences (formulate_rollouts over the engine's template) of cut, multi-turn
    scripted episodes: exactly the ids the engine saw and sampled, the answers' tokens (and only
    they) in the loss, each with the log-prob it was sampled with."""
    import math

    from ragen.rollout.context import ContextManager

    engine = ScriptedEngine(malformed_rate=0.2)
    specs = cut_specs()
    config = loop_config(max_turn=4)
    trajectories = sequential(specs, config, engine)
    ctx = ContextManager(config.context)
    rows = ctx.formulate_rollouts([(s, t.turns) for s, t in zip(specs, trajectories)], engine.chat)
    n_answer = 0
    for (row,), traj in zip(rows, trajectories):
        assert row["input_ids"] == episode_ids(traj.turns)
        trained = [x for x, m in zip(row["behaviour_logprobs"], row["loss_mask"]) if m]
        assert trained == [x for t in traj.turns for x in t.logprobs]
        assert not any(math.isnan(x) for x in trained)
        n_answer += len(trained)
    assert n_answer == sum(len(t.response_ids) for traj in trajectories for t in traj.turns) > 0
    assert any(t.finish_reason == "length" for traj in trajectories for t in traj.turns)

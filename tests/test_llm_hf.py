"""HFEngine on the tiny random model: left padding, batch-independent sampling,
stop reasons, per-request limits, policy versions and the shared model."""

from __future__ import annotations

import logging

import filecmp
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ragen.llm import make_engine
from ragen.llm.hf import HFEngine
from ragen.llm.tiny_model import TAG_TOKENS, build_tiny_model
from ragen.llm.types import GenerationRequest, SamplingParams
from ragen.utils import common_prefix_length

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def requests(n, env0=0, seed=0, **kw):
    # Prompts of different lengths, so batching needs real left padding.
    return [
        GenerationRequest(
            messages=[{"role": "user", "content": "Available actions: Up, Down. State " + "#" * (3 * i + 1)}],
            env_id=env0 + i, seed=seed, **kw,
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return make_engine({"name": "hf", "device": "cpu", "max_batch_size": 64}, tiny_model_path)


def ids(completions):
    return [c.response_token_ids for c in completions]


def test_greedy_is_the_same_alone_and_left_padded_in_a_batch(engine):
    reqs = requests(6)
    batched = engine.generate(reqs, GREEDY)
    alone = [engine.generate([r], GREEDY)[0] for r in reqs]
    assert ids(batched) == ids(alone)
    assert len({tuple(x) for x in ids(batched)}) > 1  # the model does react to its prompt
    assert [c.text for c in batched] == [c.text for c in alone]
    # prompt ids are the chat template's encoding, without padding
    for r, c in zip(reqs, batched):
        assert c.prompt_token_ids == engine.encode_prompt(r.messages)
        assert engine.pad_token_id not in c.prompt_token_ids


def test_sampling_is_keyed_by_request_not_by_batch(engine, tiny_model_path):
    sampling = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, max_tokens=10, seed=5)
    reqs = requests(5)
    batched = ids(engine.generate(reqs, sampling))
    alone = [engine.generate([r], sampling)[0].response_token_ids for r in reqs]
    reordered = ids(engine.generate(reqs[::-1], sampling))[::-1]
    mixed = ids(engine.generate(requests(4, env0=50) + reqs[2:4], sampling))[-2:]
    small_chunks = HFEngine(model=engine.model, tokenizer=engine.tokenizer, max_batch_size=2)
    chunked = ids(small_chunks.generate(reqs, sampling))
    assert batched == alone == reordered == chunked
    assert mixed == batched[2:4]
    # a different seed (engine-level or the request's) changes the samples
    assert ids(engine.generate(reqs, SamplingParams(**{**sampling.to_dict(), "seed": 6}))) != batched
    assert ids(engine.generate(requests(5, seed=1), sampling)) != batched


def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    reqs = requests(3)
    greedy = ids(engine.generate(reqs, GREEDY))
    assert ids(engine.generate(reqs, SamplingParams(temperature=1.0, top_k=1, max_tokens=12))) == greedy
    assert ids(engine.generate(reqs, SamplingParams(temperature=0.7, top_p=1e-6, max_tokens=12))) == greedy


def test_per_request_max_tokens_and_length_reason(engine):
    limits = [1, 3, 0, 7]
    reqs = [GenerationRequest(r.messages, env_id=r.env_id, max_tokens=n) for r, n in zip(requests(4), limits)]
    completions = engine.generate(reqs, SamplingParams(temperature=1.0, max_tokens=50))
    for c, limit in zip(completions, limits):
        assert len(c.response_token_ids) <= limit
        if c.finish_reason == "length":
            assert len(c.response_token_ids) == limit
    assert completions[2].response_token_ids == [] and completions[2].finish_reason == "length"
    # the smaller cap holds: the requests' here, the sampling's for the others
    capped = engine.generate(requests(2), SamplingParams(temperature=0.0, max_tokens=2))
    assert all(len(c.response_token_ids) <= 2 for c in capped)


@pytest.mark.parametrize("bad_id", [-1, "vocab"])
def test_a_history_id_the_model_has_no_embedding_for_fails_only_its_request(engine, bad_id, caplog):
    """An id past the embedding (or negative) in one request's history failed the whole
    call with IndexError; now that request alone is answered with an error naming the id."""
    vocab = engine.model.get_input_embeddings().num_embeddings
    bad_id = vocab if bad_id == "vocab" else bad_id
    good = requests(2)
    bad = GenerationRequest(good[0].messages, env_id=7, turn=3, history_token_ids=[1, bad_id], history_messages=1)
    with caplog.at_level(logging.WARNING, logger="ragen.llm.hf"):
        got = engine.generate([good[0], bad, good[1]], GREEDY)
    assert ids([got[0], got[2]]) == ids(engine.generate(good, GREEDY))
    assert got[1].finish_reason == "error" and (got[1].env_id, got[1].turn) == (7, 3)
    assert f"token id {bad_id}" in got[1].text
    assert any("env 7 turn 3" in r.getMessage() and f"token id {bad_id}" in r.getMessage() for r in caplog.records)
    assert engine.vocab_size == vocab


def test_eos_stops_with_reason_stop(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    engine = HFEngine(model=model, tokenizer=tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos in engine.stop_token_ids
    # Make the third generated token of every row EOS: the engine must stop there.
    calls = {"n": 0}

    def force_eos(_module, _inputs, output):
        calls["n"] += 1
        if calls["n"] == 3:
            output[..., eos] += 1e4
        return output

    handle = model.lm_head.register_forward_hook(force_eos)
    try:
        completions = engine.generate(requests(3), SamplingParams(temperature=0.0, max_tokens=20))
    finally:
        handle.remove()
    for c in completions:
        assert c.finish_reason == "stop"
        assert len(c.response_token_ids) == 3 and c.response_token_ids[-1] == eos
        assert c.text == tokenizer.decode(c.response_token_ids[:-1], skip_special_tokens=True)


def test_stop_strings_cut_the_text(engine):
    reqs = requests(4)
    full = engine.generate(reqs, SamplingParams(temperature=0.0, max_tokens=16))
    for r, c in zip(reqs, full):
        if len(c.text.strip()) < 6:
            continue
        start = len(c.text) // 2
        stop = c.text[start : start + 3]
        if not stop.strip():
            continue
        cut = engine.generate([r], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop]))[0]
        assert cut.finish_reason == "stop"
        assert cut.text == c.text[: c.text.find(stop)]
        assert c.response_token_ids[: len(cut.response_token_ids)] == cut.response_token_ids
        break
    else:
        pytest.fail("no completion long enough to test stop strings")


def test_policy_version_and_load_weights(engine, tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    local = HFEngine(model=model, tokenizer=tokenizer)
    reqs = requests(3)
    before = local.generate(reqs, GREEDY)
    assert {c.policy_version for c in before} == {0}
    assert local.bump_policy_version() == 1
    assert {c.policy_version for c in local.generate(reqs, GREEDY)} == {1}
    new = {name: torch.randn_like(p) for name, p in model.named_parameters() if "layers.1.mlp" in name}
    assert local.load_weights(new) == 2
    after = local.generate(reqs, GREEDY)
    assert {c.policy_version for c in after} == {2}
    assert ids(after) != ids(before)
    with pytest.raises(KeyError, match="no_such"):
        local.load_weights({"no_such.weight": torch.zeros(1)})


def test_shares_the_trainers_model_and_restores_train_mode(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    engine = HFEngine(model=model, tokenizer=tokenizer)
    assert engine.model is model and engine.tokenizer is tokenizer and engine.device == torch.device("cpu")
    reqs = requests(2)
    before = ids(engine.generate(reqs, GREEDY))
    model.train()
    model.model.layers[0].eval()  # a mixed state must come back exactly
    modes = {name: m.training for name, m in model.named_modules()}
    with torch.no_grad():  # the trainer's in-place update
        model.model.layers[1].mlp.down_proj.weight.mul_(-3.0)
    after = ids(engine.generate(reqs, GREEDY))
    assert after != before
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert all(p.grad is None for p in model.parameters())


def test_hf_config_errors(tiny_model_path):
    with pytest.raises(ValueError, match=r"engine\.max_batch"):
        make_engine({"name": "hf", "max_batch": 8}, tiny_model_path)
    with pytest.raises(ValueError, match=r"engine\.dtype='float8'"):
        make_engine({"name": "hf", "dtype": "float8"}, tiny_model_path)
    with pytest.raises(ValueError, match="tokenizer"):
        HFEngine(model=torch.nn.Linear(2, 2))


def test_tiny_model_is_deterministic_and_keeps_answer_tags(tmp_path, tiny_model_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert filecmp.cmp(Path(again) / name, Path(tiny_model_path) / name, shallow=False), name
    assert not filecmp.cmp(Path(other) / "model.safetensors", Path(again) / "model.safetensors", shallow=False)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(again)
    text = "<think> go Up </think><answer>Up || Left</answer>"
    encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(encoded, skip_special_tokens=True) == text
    assert all(len(tokenizer(t, add_special_tokens=False)["input_ids"]) == 1 for t in TAG_TOKENS)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _grpo_like_requests(groups: int = 3, size: int = 4) -> list[GenerationRequest]:
    """``groups`` prompts, each asked ``size`` times (a GRPO group shares its seed and prompt),
    all starting with one long system message."""
    system = {"role": "system", "content": "You are a careful agent. " * 8}
    return [GenerationRequest(messages=[system, {"role": "user", "content": f"Available actions: Up, Down. "
                                                                             f"State {'#' * (5 * g + 1)}"}],
                              env_id=g * size + k, seed=100 + g)
            for g in range(groups) for k in range(size)]


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, max_tokens=12, seed=5)])
def test_shared_prefixes_give_the_tokens_of_full_prompts(tiny_model_path, sampling):
    """prefix_cache computes a group's prompt once and the common system message once; every
    row still samples on its own stream, so the answers are those of prompts computed in full."""
    shared = make_engine({"name": "hf", "device": "cpu", "prefix_cache": True}, tiny_model_path)
    full = make_engine({"name": "hf", "device": "cpu", "prefix_cache": False}, tiny_model_path)
    reqs = _grpo_like_requests()
    a, b = shared.generate(reqs, sampling), full.generate(reqs, sampling)
    assert ids(a) == ids(b)
    if not sampling.greedy:  # members of a group differ: one prompt computed, sampled per request
        assert len({tuple(c.response_token_ids) for c in a[:4]}) > 1
    total = sum(len(c.prompt_token_ids) for c in a)
    assert full.stats().tokens_prefilled == total and full.stats().tokens_reused == 0
    assert shared.stats().tokens_prefilled + shared.stats().tokens_reused == total
    distinct = {tuple(c.prompt_token_ids) for c in a}
    # each group's prompt once, and their common start (the system message) once for all three
    assert shared.stats().tokens_prefilled < sum(len(p) for p in distinct) - 2 * 16
    # alone, a request gets the same answer as in the shared batch
    alone = shared.generate([reqs[5]], sampling)
    assert ids(alone) == [a[5].response_token_ids]


def test_prefix_cache_must_be_a_boolean(tiny_model_path):
    with pytest.raises(ValueError, match="engine.prefix_cache"):
        make_engine({"name": "hf", "device": "cpu", "prefix_cache": "yes"}, tiny_model_path)


def _conversations(completions=None, episodes: int = 4) -> list[GenerationRequest]:
    """A multi-turn episode's requests: the first turn, or (given the first turn's answers) the
    second, whose prompt is the first turn's plus the answer and a new state."""
    system = {"role": "system", "content": "You are a careful agent. " * 6}
    reqs = []
    for e in range(episodes):
        messages = [system, {"role": "user", "content": f"Available actions: Up, Down. State {'#' * (4 * e + 1)}"}]
        if completions is not None:
            messages += [{"role": "assistant", "content": completions[e].text},
                         {"role": "user", "content": f"Reward 0. State {'*' * (e + 2)}"}]
        reqs.append(GenerationRequest(messages=messages, env_id=e, seed=7, turn=0 if completions is None else 1))
    return reqs


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, max_tokens=12, seed=5)])
def test_the_turn_cache_gives_the_tokens_of_full_prompts(tiny_model_path, sampling):
    """The second turn starts from each episode's cache of the first (its prompt and answer),
    computes only what follows, and answers as if the whole conversation were computed."""
    kept = make_engine({"name": "hf", "device": "cpu"}, tiny_model_path)
    full = make_engine({"name": "hf", "device": "cpu", "prefix_cache": False}, tiny_model_path)
    first = kept.generate(_conversations(), sampling)
    assert ids(first) == ids(full.generate(_conversations(), sampling))
    assert len(kept.turn_cache) == 4 and 0 < kept.turn_cache.bytes <= kept.turn_cache.max_bytes
    second_reqs = _conversations(first)
    computed_before = kept.stats().tokens_prefilled
    second = kept.generate(second_reqs, sampling)
    assert ids(second) == ids(full.generate(second_reqs, sampling))
    # each episode computed only what follows the start it shares with its first turn's
    # prompt and answer (the answer's last token was never fed back; a random model's bytes
    # may come back as other tokens when the template renders the answer again)
    kept_starts = [common_prefix_length([a.prompt_token_ids + a.response_token_ids[:-1], b.prompt_token_ids])
                   for a, b in zip(first, second)]
    assert all(n >= len(a.prompt_token_ids) for n, a in zip(kept_starts, first))
    assert kept.stats().tokens_prefilled - computed_before == sum(len(b.prompt_token_ids) - n
                                                          for n, b in zip(kept_starts, second))
    assert kept.stats().tokens_prefilled + kept.stats().tokens_reused == sum(len(c.prompt_token_ids) for c in first + second)


def test_a_weight_update_drops_the_turn_cache(tiny_model_path, tiny_model_and_tokenizer):
    engine = make_engine({"name": "hf", "device": "cpu"}, tiny_model_path)
    first = engine.generate(_conversations(), GREEDY)
    assert len(engine.turn_cache) == 4
    engine.bump_policy_version()  # no call running: freed at once
    assert len(engine.turn_cache) == 0 and engine.turn_cache.bytes == 0
    engine.generate(_conversations(), GREEDY)
    engine.load_weights({name: p.detach().clone() for name, p in engine.model.named_parameters()})
    assert engine.turn_cache.bytes == 0
    # an update while a call holds the engine: the next call still finds the old cache unusable
    engine.generate(_conversations(), GREEDY)
    with engine._lock:
        engine.bump_policy_version()
    assert len(engine.turn_cache) == 4  # not freed under a running call ...
    reused = engine.stats().tokens_reused
    engine.generate(_conversations(first), GREEDY)
    # ... and not used: only the common system message of the four prompts is reused
    assert engine.stats().tokens_reused - reused < sum(len(c.prompt_token_ids) for c in first)


def test_an_episodes_last_turn_is_not_kept_in_the_turn_cache(tiny_model_path):
    """A request at its episode's last possible turn has no next prompt to reuse its cache: the
    call keeps nothing for it and forgets the episode's earlier turn (its start still reused)."""
    engine = make_engine({"name": "hf", "device": "cpu"}, tiny_model_path)
    single = [replace(r, last_turn=True) for r in _conversations()]
    engine.generate(single, GREEDY)
    assert len(engine.turn_cache) == 0 and engine.turn_cache.bytes == 0
    first = engine.generate(_conversations(), GREEDY)  # a turn with one after it: kept
    assert len(engine.turn_cache) == 4 and engine.turn_cache.bytes > 0
    reused = engine.stats().tokens_reused
    last = [replace(r, last_turn=True) for r in _conversations(first)]
    engine.generate(last[:3] + _conversations(first)[3:], GREEDY)
    assert engine.stats().tokens_reused - reused >= sum(len(c.prompt_token_ids) for c in first)  # the first turns' starts
    assert len(engine.turn_cache) == 1 and engine.turn_cache.bytes > 0  # only the episode with a turn to come


def test_a_single_turn_rollout_leaves_the_turn_cache_empty_and_a_multi_turn_one_uses_it(tiny_model_path):
    """The turn loop marks the requests of each episode's last possible turn (``max_turn``):
    a single-turn rollout (the default job's Bandit validation) keeps nothing; a multi-turn
    one reuses each episode's earlier turns, and keeps only the episodes that ended early."""
    from tests.rollout_helpers import custom_envs, loop_config, sequential, specs_for

    engine = make_engine({"name": "hf", "device": "cpu"}, tiny_model_path)
    config = loop_config(max_turn=1)
    config = replace(config, sampling=replace(config.sampling, max_tokens=12))
    sequential(specs_for(["Bandit"], [4], 2, custom_envs()), config, engine)
    assert len(engine.turn_cache) == 0 and engine.turn_cache.bytes == 0
    specs = specs_for(["SimpleSokoban", "FrozenLake"], [2, 2], 2, custom_envs())
    within_calls = make_engine({"name": "hf", "device": "cpu", "turn_cache_mb": 0}, tiny_model_path)
    # greedy: an earlier answer's keys and values come from its decode steps with the cache and
    # from one prefill without; they agree to float rounding, which can flip a sampled token
    config = replace(config, max_turn=3, sampling=replace(config.sampling, temperature=0.0))
    trajectories = sequential(specs, config, engine)
    assert trajectories == sequential(specs, config, within_calls)
    assert max(len(t.turns) for t in trajectories) == 3
    # earlier turns come from the cache, not from another prefill
    assert engine.stats().tokens_reused > within_calls.stats().tokens_reused
    assert engine.stats().tokens_prefilled < 0.8 * within_calls.stats().tokens_prefilled
    assert len(engine.turn_cache) == sum(len(t.turns) < 3 for t in trajectories)


def test_the_turn_cache_stays_within_its_bound(tiny_model_path):
    unbounded = make_engine({"name": "hf", "device": "cpu"}, tiny_model_path)
    first = unbounded.generate(_conversations(), GREEDY)
    one_call = unbounded.turn_cache.bytes
    # room for one call's cache: the second call's evicts the first's
    bounded = make_engine({"name": "hf", "device": "cpu", "turn_cache_mb": one_call * 1.5 / 2**20}, tiny_model_path)
    bounded.generate(_conversations(), GREEDY)
    other = [GenerationRequest(messages=r.messages, env_id=r.env_id + 10, seed=7) for r in _conversations()]
    bounded.generate(other, GREEDY)
    assert bounded.turn_cache.bytes <= bounded.turn_cache.max_bytes and bounded.turn_cache.evicted == 4
    # too small for any call: nothing kept, the same answers
    tiny = make_engine({"name": "hf", "device": "cpu", "turn_cache_mb": 0.001}, tiny_model_path)
    assert ids(tiny.generate(_conversations(), GREEDY)) == ids(first)
    assert tiny.turn_cache.bytes == 0 and len(tiny.turn_cache) == 0
    assert ids(tiny.generate(_conversations(first), GREEDY)) == ids(unbounded.generate(_conversations(first), GREEDY))


@pytest.mark.parametrize("value", [-1, "lots", True])
def test_turn_cache_mb_must_be_a_number(tiny_model_path, value):
    with pytest.raises(ValueError, match="engine.turn_cache_mb"):
        make_engine({"name": "hf", "device": "cpu", "turn_cache_mb": value}, tiny_model_path)


def test_no_turn_cache_without_prefix_sharing_or_at_zero(tiny_model_path):
    assert make_engine({"name": "hf", "device": "cpu", "prefix_cache": False}, tiny_model_path).turn_cache is None
    assert make_engine({"name": "hf", "device": "cpu", "turn_cache_mb": 0}, tiny_model_path).turn_cache is None


def _recomputed_logprobs(engine, completion, temperature: float = 1.0, top_k: int = 0) -> list[float]:
    """log p of each response token from one forward pass over prompt + response, as a trainer
    would compute it: logits / temperature, top_k of them kept and renormalized."""
    ids = torch.tensor([completion.prompt_token_ids + completion.response_token_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float()
    n = len(completion.prompt_token_ids)
    logits = logits[n - 1: n - 1 + len(completion.response_token_ids)] / temperature
    if top_k:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    targets = torch.tensor(completion.response_token_ids)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1).tolist()


@pytest.mark.parametrize("sampling", [
    GREEDY,
    SamplingParams(temperature=1.0, max_tokens=12, seed=5),
    SamplingParams(temperature=0.7, max_tokens=12, seed=5),
    SamplingParams(temperature=1.3, top_k=5, max_tokens=12, seed=5),
], ids=["greedy", "t1", "t0.7", "t1.3-top5"])
def test_logprobs_are_those_of_the_sampling_distribution(engine, sampling):
    """One log-prob per response token (the end token included), equal within 1e-4 to a
    forward pass over the whole sequence with the sampling's temperature and top-k (greedy:
    the model's own distribution), in a left-padded batch with shared prefixes."""
    completions = engine.generate(_grpo_like_requests(2, 3), sampling)
    for c in completions:
        assert len(c.logprobs) == len(c.response_token_ids) > 0
        temperature = 1.0 if sampling.greedy else sampling.temperature
        expected = _recomputed_logprobs(engine, c, temperature, max(0, sampling.top_k))
        assert c.logprobs == pytest.approx(expected, abs=1e-4)
        assert all(lp <= 0.0 for lp in c.logprobs)


def test_top_p_log_probs_are_renormalized_over_the_kept_tokens(engine):
    wide = engine.generate(requests(4), SamplingParams(temperature=1.0, max_tokens=8, seed=2))
    narrow = engine.generate(requests(4), SamplingParams(temperature=1.0, top_p=0.5, max_tokens=8, seed=2))
    for c in narrow:
        full = _recomputed_logprobs(engine, c)
        # renormalized over a mass of at most 1: a kept token's log-prob can only rise
        assert all(lp >= f - 1e-5 for lp, f in zip(c.logprobs, full))
    assert any(a.logprobs != b.logprobs for a, b in zip(wide, narrow))


@pytest.mark.parametrize("prefix", ["<think>", "<answer>"])
def test_the_answer_prefix_ends_the_prompt_and_the_answer_is_what_follows(engine, prefix):
    """RAGEN's prompt: the chat template's text with the prefix appended, tokenized as one text;
    the completion holds only the tokens, text and log-probs the model writes after it."""
    sampling = SamplingParams(temperature=1.0, max_tokens=10, seed=3)
    reqs = [replace(r, answer_prefix=prefix) for r in requests(3)]
    completions = engine.generate(reqs, sampling)
    prefix_ids = engine.tokenizer(prefix, add_special_tokens=False)["input_ids"]
    for r, c in zip(reqs, completions):
        text = engine.tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
        ragen_ids = engine.tokenizer(text + prefix, add_special_tokens=False)["input_ids"]
        assert c.prompt_token_ids == ragen_ids == engine.encode_prompt(r.messages, prefix)
        assert c.prompt_token_ids[-len(prefix_ids):] == prefix_ids
        assert c.prompt_token_ids[:-len(prefix_ids)] == engine.encode_prompt(r.messages)
        body = [t for t in c.response_token_ids if t not in engine.stop_token_ids]
        assert c.text == engine.tokenizer.decode(body, skip_special_tokens=True)
        # the log-probs are the model's after prompt and prefix
        assert c.logprobs == pytest.approx(_recomputed_logprobs(engine, c), abs=1e-4)
    # the prefix changes what the model writes (the prompt differs), not how it is sampled
    assert ids(completions) != ids(engine.generate(requests(3), sampling))


def test_the_turn_cache_reuses_a_prefixed_turn(tiny_model_path):
    """The next turn renders the earlier answer with its prefix put back (as the turn loop
    does): its prompt starts with the earlier prompt (prefix included), which is reused."""
    kept = make_engine({"name": "hf", "device": "cpu"}, tiny_model_path)
    full = make_engine({"name": "hf", "device": "cpu", "prefix_cache": False}, tiny_model_path)
    first_reqs = [replace(r, answer_prefix="<think>") for r in _conversations()]
    first = kept.generate(first_reqs, GREEDY)
    assert ids(first) == ids(full.generate(first_reqs, GREEDY))
    answered = [replace(c, text="<think>" + c.text) for c in first]
    second_reqs = [replace(r, answer_prefix="<think>") for r in _conversations(answered)]
    reused = kept.stats().tokens_reused
    second = kept.generate(second_reqs, GREEDY)
    assert ids(second) == ids(full.generate(second_reqs, GREEDY))
    for a, b in zip(first, second):
        assert b.prompt_token_ids[:len(a.prompt_token_ids)] == a.prompt_token_ids
    assert kept.stats().tokens_reused - reused >= sum(len(c.prompt_token_ids) for c in first)


def test_streaming_rows_are_told_each_token_as_it_is_sampled_and_the_answers_stay_the_same(engine):
    """``generate_reporting``: each decode step tells the requests that stream their new token;
    what a request was told joins to its response ids; the others are never told; the
    completions are those of ``generate``."""
    sampling = SamplingParams(temperature=1.0, max_tokens=10, seed=3)
    plain = requests(4, seed=5)
    reqs = [replace(r, stream_tokens=i % 2 == 0) for i, r in enumerate(plain)]
    reqs.insert(1, replace(reqs[0], prompt_token_ids=[engine.vocab_size + 1]))  # refused: never told
    told = []
    got = engine.generate_reporting(reqs, sampling, told.append)
    assert got[1].finish_reason == "error"
    del got[1]
    assert [c.response_token_ids for c in got] == ids(engine.generate(plain, sampling))
    by_request = {}
    for report in told:
        for index, new in report.items():
            by_request.setdefault(index, []).append(new)
    assert set(by_request) == {0, 3}  # the calls' indices of the two that stream
    for index, parts in by_request.items():
        answer = got[0 if index == 0 else 2]
        assert len(parts) == len(answer.response_token_ids) > 1
        assert [i for part in parts for i in part] == answer.response_token_ids

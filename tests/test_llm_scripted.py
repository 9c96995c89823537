"""ScriptedEngine and make_engine: a deterministic policy keyed by request, its
answer format, malformed rate, cost model and token limits."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ragen.llm import make_engine
from ragen.llm.scripted import ACTION_SEPARATOR, ScriptedEngine, parse_action_space
from ragen.llm.types import GenerationRequest, SamplingParams, request_seed

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config" / "engine"
ACTIONS = ["Up", "Down", "Left", "Right"]
WELL_FORMED = re.compile(r"^(<think>[^<]+</think>)?<answer>([^<]+)</answer>$")


def grid_prompt(max_actions=3, extra=""):
    return (
        f"Turn 1. {extra}\nAvailable actions: {', '.join(ACTIONS)}\n"
        f"You can take up to {max_actions} actions per turn, separated by ||."
    )


def requests(n, content=None, seed=7, turn=0, env0=0, **kw):
    return [
        GenerationRequest(
            messages=[{"role": "system", "content": "You are an agent."},
                      {"role": "user", "content": content or grid_prompt(extra=f"state {i}")}],
            env_id=env0 + i, turn=turn, seed=seed, **kw,
        )
        for i in range(n)
    ]


def test_same_key_same_answer_whatever_the_batch():
    engine = ScriptedEngine(malformed_rate=0.2)
    sampling = SamplingParams(seed=3)
    reqs = requests(20)
    batched = engine.generate(reqs, sampling)
    alone = [engine.generate([r], sampling)[0] for r in reqs]
    reversed_ = engine.generate(reqs[::-1], sampling)[::-1]
    mixed = engine.generate(reqs[5:9] + requests(6, env0=100), sampling)[:4]
    assert batched == alone == reversed_
    assert mixed == batched[5:9]
    # A second engine (another process would do the same) agrees too.
    assert ScriptedEngine(malformed_rate=0.2).generate(reqs, sampling) == batched


def test_answers_depend_on_every_part_of_the_key():
    engine = ScriptedEngine()
    base = requests(30)
    texts = [c.text for c in engine.generate(base, SamplingParams())]
    assert len(set(texts)) > 5
    for variant in (requests(30, seed=8), requests(30, turn=1)):
        assert [c.text for c in engine.generate(variant, SamplingParams())] != texts
    assert [c.text for c in engine.generate(base, SamplingParams(seed=1))] != texts
    assert [c.text for c in ScriptedEngine(seed=1).generate(base, SamplingParams())] != texts


# request_seed's values: a change breaks the same-seed promise across versions,
# and across processes whenever the new function depends on the process
SEED_CASES = [((0, (1, 2, 3)), 983089452), ((1, (1, 2, 3)), 1289709520), ((0, (1, 2, 4)), 817091995),
              ((-5, (2**40, 0, 0)), 2042826653), ((42, (7, 3, 0)), 442789266), ((0, ()), 494742404)]


def test_request_seed_is_stable_and_31_bit():
    for args, seed in SEED_CASES:
        assert request_seed(*args) == seed, args
    assert request_seed(0, (1, 2, 3)) != request_seed(0, (1, 2, 4))
    assert request_seed(0, (1, 2, 3)) != request_seed(1, (1, 2, 3))
    assert 0 <= request_seed(-5, (2**40, 0, 0)) < 2**31


@pytest.mark.parametrize("hash_seed", ["0", "1", "random"])
def test_request_seed_is_the_same_in_a_fresh_process(hash_seed):
    """The documented promise: a request gets the same seed in every process
    (the workers', the driver's, a replay's), whatever their str hash salt."""
    cases = [args for args, _ in SEED_CASES]
    code = ("import json, sys; from ragen.llm.types import request_seed\n"
            "print(json.dumps([request_seed(s, k) for s, k in json.loads(sys.argv[1])]))\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONHASHSEED": hash_seed,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], check=True, cwd=root, env=env,
                         capture_output=True, text=True, timeout=120).stdout
    assert json.loads(out) == [request_seed(s, k) for s, k in cases] == [seed for _, seed in SEED_CASES]


def test_actions_come_from_the_list_within_the_limit():
    engine = ScriptedEngine(think=True)
    for max_actions in (1, 3):
        completions = engine.generate(requests(40, content=grid_prompt(max_actions)), SamplingParams())
        counts = set()
        for c in completions:
            match = WELL_FORMED.match(c.text)
            assert match and match.group(1), c.text
            actions = match.group(2).split(ACTION_SEPARATOR)
            assert set(actions) <= set(ACTIONS)
            counts.add(len(actions))
            assert c.finish_reason == "stop"
        assert counts <= set(range(1, max_actions + 1))
        assert max(counts) == max_actions


# RAGEN's system message (ctx_manager: the env's instruction, then its action lookup)
RAGEN_SYSTEM = ("You are solving the Sokoban puzzle.\nYour available actions are:\nLeft, Down, Right, Up\n"
                "You can make up to 10 actions, separated by the action separator \" || \"\n")


def test_parse_action_space():
    assert parse_action_space(grid_prompt(4)) == (ACTIONS, 4)
    assert parse_action_space("Available actions: Left, Right.") == (["Left", "Right"], 1)
    assert parse_action_space("Make 24 from 3 4 5.") == ([], 1)
    # RAGEN's form: the names on the line after "Your available actions are:"
    assert parse_action_space(RAGEN_SYSTEM) == (["Left", "Down", "Right", "Up"], 10)
    assert parse_action_space("Available actions:\n  A, B  \n") == (["A", "B"], 1)


def test_ragen_action_list_in_the_system_message_is_found():
    req = GenerationRequest(messages=[{"role": "system", "content": RAGEN_SYSTEM},
                                      {"role": "user", "content": "Turn 1:\nState:\n#####\n#P_X#\n#####"}])
    answers = ScriptedEngine(think=False).generate([replace(req, seed=s) for s in range(40)], SamplingParams())
    counts = set()
    for c in answers:
        match = re.fullmatch(r"<answer>(.+)</answer>", c.text)
        actions = match.group(1).split(ACTION_SEPARATOR)
        assert set(actions) <= {"Left", "Down", "Right", "Up"}, c.text
        counts.add(len(actions))
    assert max(counts) > 3 and counts <= set(range(1, 11))


@pytest.mark.parametrize("prefix", ["<think>", "<answer>"])
def test_the_answer_continues_after_its_prefix(prefix):
    """The script writes its whole answer; a completion is what follows the request's prefix
    (bytes, text, log-probs with the choices' on the first byte), and the prompt ends with it.
    An answer that does not start with the prefix is the completion whole; after "<answer>"
    (RAGEN without thinking) the script writes no thought, as with think=False."""
    engine = ScriptedEngine(malformed_rate=0.3)
    plain = (engine if prefix == "<think>" else ScriptedEngine(think=False, malformed_rate=0.3)).generate(
        requests(60), SamplingParams())
    prefixed = engine.generate(requests(60, answer_prefix=prefix), SamplingParams())
    assert sum(a.text.startswith(prefix) for a in plain) > 30
    for a, b in zip(plain, prefixed):
        assert b.prompt_token_ids == a.prompt_token_ids + list(prefix.encode())
        rest = a.text[len(prefix):] if a.text.startswith(prefix) else a.text
        assert b.text == rest == engine.answer_text(requests(60, answer_prefix=prefix)[b.env_id], SamplingParams())
        assert b.response_token_ids == list(rest.encode()) and b.finish_reason == "stop"
        assert b.logprobs == [a.logprobs[0]] + [0.0] * (len(rest) - 1)
    # the token limit counts the tokens after the prefix
    capped = engine.generate(requests(60, answer_prefix=prefix, max_tokens=4), SamplingParams())
    for b, c in zip(prefixed, capped):
        assert c.response_token_ids == b.response_token_ids[:4]
        assert c.finish_reason == ("length" if len(b.response_token_ids) > 4 else "stop")


def test_actions_line_in_system_prompt_is_found():
    req = GenerationRequest(messages=[{"role": "system", "content": "Available actions: Push, Pull"},
                                      {"role": "user", "content": "State: ..."}])
    text = ScriptedEngine(think=False).generate([req], SamplingParams())[0].text
    assert re.fullmatch(r"<answer>(Push|Pull)</answer>", text)


def test_language_task_gets_an_expression_over_its_numbers():
    content = "Using the numbers [3, 5, 2, 11], create an equation that equals 16."
    engine = ScriptedEngine(think=False)
    for c in engine.generate(requests(30, content=content), SamplingParams()):
        match = re.fullmatch(r"<answer>(.+)</answer>", c.text)
        assert match, c.text
        tokens = match.group(1).split(" ")
        assert set(tokens[0::2]) <= {"3", "5", "2", "11", "16"}
        assert set(tokens[1::2]) <= {"+", "-", "*"}


def test_think_can_be_switched_off():
    for c in ScriptedEngine(think=False).generate(requests(10), SamplingParams()):
        assert c.text.startswith("<answer>") and "<think>" not in c.text


def test_malformed_rate_is_about_as_configured():
    engine = ScriptedEngine(malformed_rate=0.3)
    completions = engine.generate(requests(2000), SamplingParams())
    bad = [c.text for c in completions if not _well_formed(c.text)]
    assert 0.25 < len(bad) / len(completions) < 0.35
    kinds = {
        "no_tags": any("<" not in t for t in bad),
        "empty": any(t.endswith("<answer></answer>") for t in bad),
        "unknown": any("<answer>Jump</answer>" in t for t in bad),
        "unclosed": any(not t.endswith("</answer>") and "<answer>" in t for t in bad),
        "nested": any("<answer><answer>" in t for t in bad),
    }
    assert all(kinds.values()), kinds
    assert all(_well_formed(c.text) for c in ScriptedEngine().generate(requests(300), SamplingParams()))


def _well_formed(text):
    match = WELL_FORMED.match(text)
    return bool(match) and set(match.group(2).split(ACTION_SEPARATOR)) <= set(ACTIONS)


def test_well_formed_answers_do_not_change_with_the_rate():
    reqs = requests(200)
    clean = ScriptedEngine().generate(reqs, SamplingParams())
    noisy = ScriptedEngine(malformed_rate=0.5).generate(reqs, SamplingParams())
    kept = [(a.text, b.text) for a, b in zip(clean, noisy) if _well_formed(b.text)]
    assert kept and all(a == b for a, b in kept)


def test_latency_model_sleeps_per_call_and_per_token():
    engine = ScriptedEngine(base_s=0.05, per_token_s=0.0005)
    reqs = requests(8)
    start = time.perf_counter()
    completions = engine.generate(reqs, SamplingParams())
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.response_token_ids) for c in completions)
    assert elapsed >= 0.05 + 0.0005 * tokens


def test_byte_tokens_and_max_tokens():
    engine = ScriptedEngine()
    full = engine.generate(requests(3), SamplingParams())
    for c in full:
        assert bytes(c.response_token_ids).decode() == c.text
        assert c.prompt_token_ids and all(0 <= t < 256 for t in c.prompt_token_ids)
    short = engine.generate(requests(3, max_tokens=5), SamplingParams())
    for f, s in zip(full, short):
        assert s.response_token_ids == f.response_token_ids[:5]
        assert s.text == f.text[:5] and s.finish_reason == "length"
    capped = engine.generate(requests(3), SamplingParams(max_tokens=7))
    assert all(len(c.response_token_ids) == 7 and c.finish_reason == "length" for c in capped)
    # the smaller cap holds, the request's or the sampling's
    assert len(engine.generate(requests(1, max_tokens=200), SamplingParams(max_tokens=3))[0].response_token_ids) == 3
    assert ScriptedEngine(return_prompt_ids=False).generate(requests(1), SamplingParams())[0].prompt_token_ids == []


def test_policy_version_and_ids_recorded():
    engine = ScriptedEngine()
    assert engine.generate(requests(1, env0=4, turn=2), SamplingParams())[0].policy_version == 0
    engine.bump_policy_version()
    c = engine.generate(requests(1, env0=4, turn=2), SamplingParams())[0]
    assert (c.policy_version, c.env_id, c.turn) == (1, 4, 2)


def test_make_engine_and_its_errors():
    engine = make_engine({"name": "scripted", "seed": 3, "malformed_rate": 0.1}, None)
    assert isinstance(engine, ScriptedEngine) and engine.seed == 3
    cfg = OmegaConf.load(CONFIG_DIR / "scripted.yaml")
    assert isinstance(make_engine(cfg, "default"), ScriptedEngine)
    with pytest.raises(ValueError, match=r"engine\.name='nope'.*hf.*openai.*scripted.*vllm"):
        make_engine({"name": "nope"}, None)
    with pytest.raises(ValueError, match=r"engine\.name=None"):
        make_engine({}, None)
    with pytest.raises(ValueError, match=r"engine\.temprature"):
        make_engine({"name": "scripted", "temprature": 1.0}, None)
    with pytest.raises(ValueError, match=r"engine\.malformed_rate"):
        make_engine({"name": "scripted", "malformed_rate": 2.0}, None)


def test_unknown_keys_are_rejected_before_heavy_imports():
    # vllm is not importable here, yet the key error comes first and names the key
    with pytest.raises(ValueError, match=r"engine\.gpu_mem"):
        make_engine({"name": "vllm", "gpu_mem": 0.5}, None)
    with pytest.raises(ValueError, match=r"engine\.batch"):
        make_engine({"name": "openai", "batch": 4}, None)


def test_config_files_match_the_engines():
    from ragen.llm import ENGINE_CLASSES
    import importlib

    for name, target in ENGINE_CLASSES.items():
        cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / f"{name}.yaml"))
        assert cfg.pop("name") == name
        module, _, cls = target.partition(":")
        engine_class = getattr(importlib.import_module(module), cls)
        assert set(cfg) == {*engine_class.config_keys, *engine_class.replica_keys}, name


def test_scripted_engine_does_not_import_torch():
    code = (
        "import sys; from ragen.llm import make_engine, GenerationRequest, SamplingParams\n"
        "e = make_engine({'name': 'scripted'})\n"
        "e.generate([GenerationRequest([{'role': 'user', 'content': 'Available actions: A, B'}])], SamplingParams())\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'\n"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=120)


@pytest.mark.parametrize("think", [True, False])
def test_logprobs_are_those_of_the_scripted_policy(think):
    """The answer's log-probs (on its first token, 0 on the rest) are the probability with which
    the script draws it: over every answer it can give, they sum to 1, and each answer's
    frequency over many requests is its probability."""
    engine = ScriptedEngine(think=think)
    content = "Available actions: Up, Down\nYou can take up to 2 actions per turn, separated by ||."
    completions = engine.generate(requests(3000, content=content), SamplingParams())
    seen: dict[str, float] = {}
    counts: dict[str, int] = {}
    for c in completions:
        assert len(c.logprobs) == len(c.response_token_ids)
        assert c.logprobs[1:] == [0.0] * (len(c.logprobs) - 1)
        assert seen.setdefault(c.text, c.logprobs[0]) == c.logprobs[0]  # one answer, one probability
        counts[c.text] = counts.get(c.text, 0) + 1
    assert sum(math.exp(lp) for lp in seen.values()) == pytest.approx(1.0, abs=1e-9)
    for text, lp in seen.items():
        # binomial noise of 3000 draws: 4 standard errors
        p = math.exp(lp)
        assert abs(counts[text] / 3000 - p) < 4 * math.sqrt(p * (1 - p) / 3000) + 1e-9, text


def test_malformed_answers_carry_the_malformed_draw_in_their_logprob():
    clean = ScriptedEngine(malformed_rate=0.0).generate(requests(50), SamplingParams())
    noisy = ScriptedEngine(malformed_rate=0.25).generate(requests(50), SamplingParams())
    for a, b in zip(clean, noisy):
        if a.text == b.text:  # drawn well-formed: the same answer, times 0.75
            assert b.logprobs[0] == pytest.approx(a.logprobs[0] + math.log(0.75))
        else:  # drawn malformed: times 0.25, times 1/5 for its kind
            assert b.logprobs[0] == pytest.approx(a.logprobs[0] + math.log(0.25) - math.log(5))


def test_a_streaming_request_is_told_its_answer_in_parts_that_join_to_its_ids():
    """``generate_reporting``: the requests with ``stream_tokens`` are told their answers in
    ``PIECES`` parts (the call's wait spread between them); the others are never told; the
    completions are ``generate``'s."""
    from dataclasses import replace

    from ragen.llm.scripted import PIECES

    engine = ScriptedEngine(seed=1)
    sampling = SamplingParams(seed=2)
    plain = requests(3)
    reqs = [replace(r, stream_tokens=i != 1) for i, r in enumerate(plain)]
    told = []
    got = engine.generate_reporting(reqs, sampling, told.append)
    assert [c.response_token_ids for c in got] == [c.response_token_ids for c in engine.generate(plain, sampling)]
    assert len(told) == PIECES > 1
    for index in (0, 2):
        assert [i for report in told for i in report.get(index, [])] == got[index].response_token_ids
    assert all(1 not in report for report in told)

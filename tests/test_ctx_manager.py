"""ContextManager: parsing answers, building prompts, loss masks, rewards."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen.rollout.context import ContextConfig, ContextManager
from ragen.rollout.types import EnvSpec, Turn

ctx = ContextManager(ContextConfig(max_actions_per_turn=3))


@pytest.mark.parametrize("text,actions", [
    ("<think>go</think><answer>Up</answer>", ["Up"]),
    ("<think>go</think>  \n <answer>Up || Left</answer>", ["Up", "Left"]),
    ("<think></think><answer></answer>", []),
    ("<answer>Up</answer>", []),  # think missing while enable_think
    ("Up", []),
    ("<think>x<answer>Up</answer>", []),  # unclosed think
    ("<think>a</think><answer><answer>Up</answer></answer>", ["<answer>Up"]),  # nested: not an action name
    ("<think>é</think><answer>Üp || 左</answer>", ["Üp", "左"]),
    ("<think>x</think><answer>Up||Down||Left||Right||Up</answer>", ["Up", "Down", "Left"]),
    ("<think>x</think><answer>Up<|im_end|></answer>", ["Up"]),
    ("<think>" + "x" * 100000 + "</think><answer>Down</answer>", ["Down"]),
])
def test_parse(text, actions):
    assert ctx.parse_response(text) == actions


def test_answer_only_mode():
    c = ContextManager(ContextConfig(enable_think=False))
    assert c.parse_response("<answer>Up</answer>") == ["Up"]
    assert c.parse_response("<think>x</think><answer>Left</answer>") == ["Left"]


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_parse_never_raises(text):
    out = ctx.parse_response(text)
    assert isinstance(out, list) and len(out) <= 3 and all(a == a.strip() and a for a in out)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="|<>"), min_size=1).map(str.strip)
                .filter(bool), min_size=1, max_size=6))
def test_parse_round_trip(actions):
    text = "<think>t</think><answer>" + " || ".join(actions) + "</answer>"
    assert ctx.parse_response(text) == actions[:3]


def _spec():
    return EnvSpec(env_id=0, group_id=0, tag="T", seed=1, env_type="x", env_config={},
                   env_instruction="Solve it.", max_tokens=50)


def _turn(i):
    return Turn(observation=f"obs{i}", actions_left=10 - i, response=f"<answer>a{i}</answer>", actions=[],
                executed_actions=[], reward=float(i), penalty=0.0, info={}, policy_version=0)


def test_prompt_lists_actions_state_and_reward():
    msgs = ctx.build_messages(_spec(), [_turn(0)], "obs1", 9, ["Up", "Down"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert "Solve it." in msgs[0]["content"]
    last = msgs[-1]["content"]
    assert "obs1" in last and "9 actions left" in last and "Available actions: Up, Down" in last
    assert "Reward:\n0" in last and "up to 3 actions" in last


def test_context_window_keeps_last_turns():
    c = ContextManager(ContextConfig(max_context_window=1))
    msgs = c.build_messages(_spec(), [_turn(0), _turn(1), _turn(2)], "obs3", 7, None)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert "obs2" in msgs[1]["content"] and "obs3" in msgs[3]["content"]
    c0 = ContextManager(ContextConfig(max_context_window=0))
    assert len(c0.build_messages(_spec(), [_turn(0)], "obs1", 9, None)) == 2


class CharTokenizer:
    """A tokenizer with a ChatML template: one token per character."""

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(ch) for ch in text]}


@pytest.mark.parametrize("turn_scores", [False, True])
def test_loss_mask_covers_exactly_the_models_tokens(turn_scores):
    c = ContextManager(ContextConfig(use_turn_scores=turn_scores))
    turns = [_turn(0), _turn(1)]
    messages = c.episode_messages(_spec(), turns, ["Up"])
    [ep] = c.formulate_rollouts([{"messages": messages, "turn_rewards": [1.0, 2.0]}], CharTokenizer())
    text = "".join(chr(i) for i in ep["input_ids"])
    masked = "".join(chr(i) for i, m in zip(ep["input_ids"], ep["loss_mask"]) if m)
    assert masked == "<answer>a0</answer><|im_end|><answer>a1</answer><|im_end|>"
    assert text == CharTokenizer().apply_chat_template(messages).rstrip("\n")
    rewards = np.array(ep["token_rewards"])
    nz = [i for i, r in enumerate(rewards) if r]
    assert all(ep["loss_mask"][i] for i in nz)
    if turn_scores:
        assert list(rewards[nz]) == [1.0, 2.0]
    else:
        assert list(rewards[nz]) == [3.0] and nz[0] == max(i for i, m in enumerate(ep["loss_mask"]) if m)


def test_bad_context_config_names_key():
    with pytest.raises(ValueError, match="reward_normalization.method"):
        ContextConfig(reward_method="median")
    with pytest.raises(ValueError, match="max_actions_per_turn"):
        ContextConfig(max_actions_per_turn=0)


_PIECES = st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "Up", "||", "x"])


@settings(max_examples=500, deadline=None)
@given(st.lists(_PIECES, max_size=14).map("".join), st.booleans())
def test_parse_agrees_with_the_reference_regex(text, think):
    import re

    pattern = r"<think>(.*?)</think>\s*<answer>(.*?)</answer>" if think else r"<answer>(.*?)</answer>"
    m = re.search(pattern, text, re.DOTALL)
    want = [] if not m else [a.strip() for a in m.group(m.lastindex).split("||") if a.strip()][:3]
    assert ContextManager(ContextConfig(max_actions_per_turn=3, enable_think=think)).parse_response(text) == want


def test_parse_is_linear_on_long_runs_of_tags():
    import time

    t0 = time.perf_counter()
    for text in ("<think>" * 20000, "<think>x</think><answer>" * 5000, "<answer>" * 20000):
        ctx.parse_response(text)
    assert time.perf_counter() - t0 < 5  # the backtracking regex took minutes here


def test_format_example_is_shown_but_never_trained_on():
    from dataclasses import replace

    c = ContextManager(ContextConfig())
    spec = replace(_spec(), format_example=("example state", "<answer> wolf </answer>", ("owl", "wolf")))
    prompt = c.build_messages(spec, [_turn(0)], "obs1", 9, ["Up"])
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert "example state" in prompt[1]["content"] and "owl, wolf" in prompt[1]["content"]
    messages = c.episode_messages(spec, [_turn(0)], ["Up"])
    [ep] = c.formulate_rollouts([{"messages": messages, "turn_rewards": [2.0]}], CharTokenizer())
    masked = "".join(chr(i) for i, m in zip(ep["input_ids"], ep["loss_mask"]) if m)
    assert masked == "<answer>a0</answer><|im_end|>"  # the model's answer only, not the example's
    assert sum(ep["token_rewards"]) == 2.0

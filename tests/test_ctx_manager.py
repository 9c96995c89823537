"""ContextManager: parsing answers, building prompts, loss masks, rewards."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen.rollout.context import INVALID_WARNING, ContextConfig, ContextManager
from ragen.llm.chat_tokens import ChatTokens
from ragen.rollout.types import EnvSpec, Turn, episode_ids, prompt_delta

ctx = ContextManager(ContextConfig(max_actions_per_turn=3))


@pytest.mark.parametrize("text,actions", [
    ("<think>go</think><answer>Up</answer>", ["Up"]),
    ("<think>go</think>  \n <answer>Up || Left</answer>", ["Up", "Left"]),
    ("<think></think><answer></answer>", []),
    ("<answer>Up</answer>", []),  # think missing while enable_think
    ("Up", []),
    ("<think>x<answer>Up</answer>", []),  # unclosed think
    ("<think>a</think><answer><answer>Up</answer></answer>", ["Up"]),  # the tags are taken out, as RAGEN does
    ("<think>é</think><answer>Üp || 左</answer>", ["Üp", "左"]),
    ("<think>x</think><answer>Up||Down||Left||Right||Up</answer>", ["Up", "Down", "Left"]),
    ("<think>x</think><answer>Up<|im_end|></answer>", ["Up"]),
    ("<think>" + "x" * 100000 + "</think><answer>Down</answer>", ["Down"]),
])
def test_parse(text, actions):
    assert ctx.parse_response(text) == actions


def test_answer_only_mode():
    c = ContextManager(ContextConfig(enable_think=False))
    assert c.answer_prefix == "<answer>"
    assert c.parse_response("Up</answer>") == ["Up"]  # what the model writes after the prefix
    assert c.parse_response("<answer>Up</answer>") == ["Up"]
    # after the prefix <answer>, RAGEN's answer runs to the first </answer>, with the tags taken out
    assert c.parse_response("<think>x</think><answer>Left</answer>") == ["xLeft"]


def test_the_answer_prefix_is_put_back_and_answers_are_shown_tidied():
    assert ctx.answer_prefix == "<think>"
    assert ctx.parse_response(" go left </think>\n<answer> Left || Up </answer>") == ["Left", "Up"]
    assert ctx.normalize_response(" go left </think>\n<answer> Left || Up </answer>") == \
        "<think>go left</think><answer>Left || Up</answer>"
    # more actions than max_actions_per_turn: cut, and joined again with the separator
    assert ctx.normalize_response("x</think><answer>Up||Up||Up||Up</answer>") == \
        "<think>x</think><answer>Up || Up || Up</answer>"
    assert ctx.normalize_response("no tags") == "<think>no tags"  # shown as written, with its prefix


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


def _spec(**kw):
    return EnvSpec(env_id=0, group_id=0, tag="T", seed=1, env_type="x", env_config={},
                   env_instruction="Solve it.", max_tokens=50, **kw)


def _turn(i, executed=("a",)):
    return Turn(observation=f"obs{i}", actions_left=10 - i, response=f"t{i}</think><answer>a{i}</answer>",
                actions=[f"a{i}"], executed_actions=list(executed), reward=float(i), penalty=-0.1, info={},
                policy_version=0)


STATE = ("\nTurn {n}:\nState:\nobs{i}\n{warn}You have {left} actions left. Always output: <think> [Your thoughts] "
         "</think> <answer> [your answer] </answer> with no extra text. Strictly follow this format. "
         "Max response length: 50 words (tokens).\n")


def test_prompt_is_ragens_layout():
    spec = _spec(state_legend="\nThe meaning of each symbol in the state is:\n#: wall", action_names=("Up", "Down"),
                 max_actions_per_traj=10)
    msgs = ctx.build_messages(spec, [_turn(0), _turn(1, executed=())], "obs2", 8)
    assert msgs == [
        {"role": "system", "content": "You're a helpful assistant. Solve it.\nThe meaning of each symbol in the "
                                      "state is:\n#: wall\nYour available actions are:\nUp, Down\nYou can make up "
                                      "to 10 actions, separated by the action separator \" || \"\n"},
        {"role": "user", "content": STATE.format(n=1, i=0, left=10, warn="")},
        {"role": "assistant", "content": "<think>t0</think><answer>a0</answer>"},
        # the turn's reward as str() of its sum (no format penalty), then the next state
        {"role": "user", "content": "Reward:\n0.0\n" + STATE.format(n=2, i=1, left=9, warn="")},
        {"role": "assistant", "content": "<think>t1</think><answer>a1</answer>"},
        {"role": "user", "content": "Reward:\n1.0\n" + STATE.format(n=3, i=2, left=8, warn=INVALID_WARNING)},
    ]
    assert ctx.episode_messages(spec, [_turn(0), _turn(1)]) == msgs[:5]  # up to the last answer


def test_limited_multi_turn_keeps_the_last_turns_and_their_numbers():
    c = ContextManager(ContextConfig(context_window_mode="limited_multi_turn", token_history="rerender", max_context_window=2))
    msgs = c.build_messages(_spec(), [_turn(0), _turn(1), _turn(2)], "obs3", 7)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[1]["content"] == STATE.format(n=3, i=2, left=8, warn="")
    assert msgs[3]["content"] == "Reward:\n2.0\n" + STATE.format(n=4, i=3, left=7, warn="")
    # full ignores the window, as in RAGEN; 0 or -1 keep everything
    assert ctx.build_messages(_spec(), [_turn(0), _turn(1)], "obs2", 8) == \
        ContextManager(ContextConfig(max_actions_per_turn=3, max_context_window=1)).build_messages(
            _spec(), [_turn(0), _turn(1)], "obs2", 8)
    c0 = ContextManager(ContextConfig(context_window_mode="limited_multi_turn", token_history="rerender", max_context_window=0))
    assert len(c0.build_messages(_spec(), [_turn(0)], "obs1", 9)) == 4


def test_single_turn_summarizes_the_last_turns():
    c = ContextManager(ContextConfig(context_window_mode="single_turn", token_history="rerender", max_context_window=2))
    msgs = c.build_messages(_spec(), [_turn(0), _turn(1)], "obs2", 8)
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[1]["content"] == (
        "Summary: 2 step(s) completed so far. Showing the last 1 turn(s) with state/action/reward details. "
        "Recent turns:\n---\nTurn 2 State:\nobs1\nTurn 2 Action: <think>t1</think><answer>a1</answer>\n"
        "Turn 2 Reward: 1.0\n---\n\nCurrent Turn (Turn 3):\n" + STATE.format(n=0, i=2, left=8, warn="").split(":\n", 1)[1])
    first = c.build_messages(_spec(), [], "obs0", 10)[1]["content"]
    assert first == "(Turn 1):\n" + STATE.format(n=0, i=0, left=10, warn="").split(":\n", 1)[1]


def test_unknown_window_mode_names_the_key():
    with pytest.raises(ValueError, match="agent_proxy.context_window_mode"):
        ContextConfig(context_window_mode="sliding")


_SPECIAL = {"<|im_start|>": 1000, "<|im_end|>": 1001}
END = _SPECIAL["<|im_end|>"]


def _char_encode(text):
    """One id per character, and one per ChatML special token."""
    ids, i = [], 0
    while i < len(text):
        special = next((t for t in _SPECIAL if text.startswith(t, i)), None)
        ids.append(_SPECIAL[special] if special else ord(text[i]))
        i += len(special) if special else 1
    return ids


def _decode(ids):
    names = {v: k for k, v in _SPECIAL.items()}
    return "".join(names.get(i) or chr(i) for i in ids)


def _render(messages, add_generation_prompt):
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


CHAT = ChatTokens(_render, _char_encode, {END: "<|im_end|>"}, "char-chatml")


def _played(c, spec, turns, ends=True, history=True):
    """``turns`` with the ids an engine would give: each prompt appended to the episode's ids
    (rendered whole without ``history``), each answer's characters, then the end token (``ends``)."""
    out = []
    for k, t in enumerate(turns):
        messages = c.build_messages(spec, out, t.observation, t.actions_left)
        prompt = (CHAT.append(episode_ids(out), messages, len(messages) - 1, c.answer_prefix)[0] if k and history
                  else CHAT.full(messages, c.answer_prefix))
        start, prompt_ids = prompt_delta(episode_ids(out), prompt)
        answer = _char_encode(t.response) + ([END] if ends else [])
        out.append(replace(t, prompt_ids=prompt_ids, prompt_start=start, response_ids=tuple(answer),
                           logprobs=tuple(-0.1 * (i + 1) for i in range(len(answer))),
                           finish_reason="stop" if ends else "length"))
    return out


@pytest.mark.parametrize("turn_scores", [False, True])
def test_loss_mask_covers_exactly_the_sampled_tokens(turn_scores):
    c = ContextManager(ContextConfig(use_turn_scores=turn_scores))
    turns = _played(c, _spec(), [_turn(0), _turn(1)])
    [[ep]] = c.formulate_rollouts([(_spec(), turns)], CHAT)
    masked = _decode(i for i, m in zip(ep["input_ids"], ep["loss_mask"]) if m)
    # the answer prefix <think> was the prompt's end: not the model's
    assert masked == "t0</think><answer>a0</answer><|im_end|>t1</think><answer>a1</answer><|im_end|>"
    assert ep["input_ids"] == episode_ids(turns)  # the ids the engine saw and sampled, token for token
    assert _decode(ep["input_ids"]) == _render(c.episode_messages(_spec(), turns), False).rstrip("\n")
    # every sampled token carries its log-prob; no prompt token does
    logps = [x for x, m in zip(ep["behaviour_logprobs"], ep["loss_mask"]) if m]
    assert logps == [x for t in turns for x in t.logprobs]
    assert all(math.isnan(x) for x, m in zip(ep["behaviour_logprobs"], ep["loss_mask"]) if not m)
    rewards = np.array(ep["token_rewards"])
    nz = [i for i, r in enumerate(rewards) if r]
    assert all(ep["loss_mask"][i] for i in nz)
    if turn_scores:
        assert list(rewards[nz]) == [-0.1, 0.9]
    else:
        assert list(rewards[nz]) == pytest.approx([0.8]) and nz[0] == max(i for i, m in enumerate(ep["loss_mask"]) if m)


def test_the_sampled_ids_are_trained_even_where_their_text_encodes_otherwise():
    c = ContextManager(ContextConfig())
    turns = _played(c, _spec(), [_turn(0), _turn(1)])
    # the engine sampled "a0" as one id that the text's encoding would split
    odd = list(turns[0].response_ids)
    odd[odd.index(ord("a")):odd.index(ord("a")) + 2] = [5000]
    turns[0] = replace(turns[0], response_ids=tuple(odd), logprobs=tuple([-0.3] * len(odd)))
    turns = _played_after(c, turns)
    [[ep]] = c.formulate_rollouts([(_spec(), turns)], CHAT)
    assert ep["input_ids"] == episode_ids(turns) and 5000 in ep["input_ids"]
    assert not any(math.isnan(x) for x, m in zip(ep["behaviour_logprobs"], ep["loss_mask"]) if m)


def _played_after(c, turns):
    """The second turn's prompt appended again to the (edited) first turn's ids."""
    messages = c.build_messages(_spec(), turns[:1], turns[1].observation, turns[1].actions_left)
    prompt = CHAT.append(episode_ids(turns[:1]), messages, len(messages) - 1, c.answer_prefix)[0]
    start, ids = prompt_delta(episode_ids(turns[:1]), prompt)
    return [turns[0], replace(turns[1], prompt_ids=ids, prompt_start=start)]


@pytest.mark.parametrize("train_end", [False, True])
def test_the_end_token_after_a_cut_answer_is_not_the_models_unless_asked(train_end):
    c = ContextManager(ContextConfig(train_end_after_cut=train_end))
    turns = _played(c, _spec(), [_turn(0), _turn(1)], ends=False)
    [[ep]] = c.formulate_rollouts([(_spec(), turns)], CHAT)
    ids, mask = ep["input_ids"], ep["loss_mask"]
    ends = [i for i, t in enumerate(ids) if t == END and i > 0 and ids[i - 1] == ord(">")
            and _decode(ids[i - 9:i]) == "</answer>"]
    # the template closes the first (cut) answer in the second prompt; the last gets its end only when trained
    assert [mask[i] for i in ends] == ([1, 1] if train_end else [0])
    assert ids[:len(episode_ids(turns))] == episode_ids(turns)
    assert all(math.isnan(ep["behaviour_logprobs"][i]) for i in ends)


def test_without_prompt_ids_the_template_builds_the_sequence_and_log_probs_are_unknown():
    c = ContextManager(ContextConfig())
    played = _played(c, _spec(), [_turn(0), _turn(1)])
    bare = [replace(t, prompt_ids=(), prompt_start=0) for t in played]
    [[ep]] = c.formulate_rollouts([(_spec(), bare)], CHAT)
    assert ep["input_ids"] == episode_ids(played)
    assert all(math.isnan(x) for x in ep["behaviour_logprobs"])
    # no ids at all: the answers' text is encoded
    text_only = [replace(t, response_ids=(), logprobs=None) for t in bare]
    [[ep2]] = c.formulate_rollouts([(_spec(), text_only)], CHAT)
    assert _decode(i for i, m in zip(ep2["input_ids"], ep2["loss_mask"]) if m) == \
        "t0</think><answer>a0</answer>t1</think><answer>a1</answer>"


def test_rerendered_prompts_keep_log_probs_only_while_they_extend_the_sampled_ids():
    c = ContextManager(ContextConfig(token_history="rerender", max_actions_per_turn=1))
    messy = replace(_turn(0), response=" t0 </think><answer>a0 || a1</answer>")  # shown tidied: another context
    for first, known in ((_turn(0), True), (messy, False)):
        turns = _played(c, _spec(), [first, _turn(1), _turn(2)], history=False)
        [[ep]] = c.formulate_rollouts([(_spec(), turns)], CHAT)
        lp = [x for x, m in zip(ep["behaviour_logprobs"], ep["loss_mask"]) if m]
        n0 = len(turns[0].response_ids)
        assert not any(math.isnan(x) for x in lp[:n0])  # the first prompt is always the context
        assert all(math.isnan(x) for x in lp[n0:]) != known
        masked = _decode(i for i, m in zip(ep["input_ids"], ep["loss_mask"]) if m)
        assert masked.startswith(first.response)  # trained as sampled, not as shown


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

    # RAGEN's parse, of the answer prefix and what the model wrote
    pattern = r"<think>(.*?)</think>\s*<answer>(.*?)</answer>" if think else r"<answer>(.*?)</answer>"
    m = re.search(pattern, ("<think>" if think else "<answer>") + text, re.DOTALL)
    content = m.group(m.lastindex) if m else ""
    for tok in ("<think>", "</think>", "<answer>", "</answer>"):
        content = content.replace(tok, "").strip()
    want = [] if not m else [a.strip() for a in content.split("||") if a.strip()][:3]
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
    spec = replace(_spec(), format_example=("example state", "<answer> wolf </answer>"))
    prompt = c.build_messages(spec, [_turn(0)], "obs1", 9)
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert "example state" in prompt[1]["content"] and prompt[2]["content"] == "<answer> wolf </answer>"
    [[ep]] = c.formulate_rollouts([(spec, _played(c, spec, [_turn(0)]))], CHAT)
    masked = _decode(i for i, m in zip(ep["input_ids"], ep["loss_mask"]) if m)
    assert masked == "t0</think><answer>a0</answer><|im_end|>"  # the model's answer only, not the example's
    assert "wolf" in _decode(ep["input_ids"])
    assert sum(ep["token_rewards"]) == pytest.approx(-0.1)


def test_the_prompts_action_list_comes_from_the_config_class_defaults(caplog):
    from ragen.rollout.envs import EnvSpecMaker

    def spec(tag_cfg):
        split = {"env_groups": 1, "group_size": 1, "env_configs": {"tags": ["T"], "n_groups": [1]}}
        return EnvSpecMaker("train", split, {"T": tag_cfg}, seed=0).make_specs()[0]

    # RAGEN's rule: the defaults, not the tag's env_config (its symbols stay the default ones)
    symbols = {0: "W", 1: ".", 2: "G", 3: "C", 4: "B", 5: "A", 6: "@"}
    vocab = {"W": "wall", ".": "empty", "G": "target", "C": "box on target", "B": "box", "A": "player",
             "@": "player on target"}
    sok = spec({"env_type": "sokoban", "env_config": {"grid_vocab": vocab, "grid_lookup": symbols}})
    assert sok.action_names == ("Up", "Down", "Left", "Right") and "#: wall" in sok.state_legend
    assert spec({"env_type": "bandit"}).action_names is None  # RAGEN's Bandit names its arms in the observation
    # an env without a config class (RAGEN needs one): its ACTION_LOOKUP
    assert spec({"env_type": "tests.fault_envs:_CounterEnv"}).action_names == ("Up", "Down")
    # a user's config class without action_lookup: none, and a warning naming the tag
    caplog.clear()
    lone = spec({"env_type": "tests.fault_envs:_CounterEnv", "config_type": "ragen.env.base:BaseEnvConfig"})
    assert lone.action_names is None
    assert "custom_envs.T: the prompt does not list the actions of _CounterEnv.ACTION_LOOKUP" in caplog.text

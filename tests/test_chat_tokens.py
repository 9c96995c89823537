"""ChatTokens on real tokenizers: prompts appended to the ids sampled so far.

On the tiny model's tokenizer and the default model's (SmolLM2, byte-level BPE),
an appended prompt keeps an answer's sampled ids exactly, also where decode then
encode is not the identity (answers cut by the token limit, invalid UTF-8,
tokens that merge otherwise when encoded again), and its text is the full
render's. A template that rewrites earlier turns is said to diverge (counted by
the engine, one warning); a template that refuses a system message still appends.
"""

from __future__ import annotations

import copy
import logging

import pytest

from ragen.llm.chat_tokens import ChatTokens

# ChatML that drops the thought of every answer before the last user message, as Qwen3's does
DROPS_THINK_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ChatML that refuses a system message
NO_SYSTEM_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('this template takes no system message') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SYSTEM = {"role": "system", "content": "You're a helpful assistant."}
FIRST = {"role": "user", "content": "Available actions: Up, Down, Left, Right.\nState:\n#P#\n#T#"}
SECOND = {"role": "user", "content": "Reward: 0.0\nState:\n#_#\n#P#"}
THIRD = {"role": "user", "content": "Reward: 1.0\nState: the goal is reached."}


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)


@pytest.fixture(scope="module")
def default_tokenizer():
    from transformers import AutoTokenizer

    from ragen.llm.default_model import resolve_model_path

    try:
        return AutoTokenizer.from_pretrained(resolve_model_path("default"), local_files_only=True)
    except (OSError, ValueError) as exc:
        pytest.skip(f"the default model is not on this machine: {exc}")


@pytest.fixture(params=["tiny", "default"])
def tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def end_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def spelled(tokenizer, text: str) -> list[int]:
    """One token per character, as a model may sample them; encoding the text merges them."""
    return [i for ch in text for i in encode(tokenizer, ch)]


def answers(tokenizer) -> dict[str, list[int]]:
    """Sampled answers (ids, no end token) whose decode then encode is not the identity."""
    lone = encode(tokenizer, "日本語")[:1]  # the first byte(s) of a multi-byte character
    assert "\ufffd" in decode(tokenizer, lone)
    cases = {
        "cut mid-word": spelled(tokenizer, " Up || Le"),
        "invalid utf-8 at the end": encode(tokenizer, "Up") + lone,
        "invalid utf-8 inside": lone + encode(tokenizer, " then Up"),
        "merges differently": spelled(tokenizer, " Up || Left </answer>"),
    }
    # a canonical encoding cut after its line breaks: single "\n" tokens before a word, one
    # token when encoded again (on a vocabulary that merges line breaks: the default model's)
    ids = encode(tokenizer, "I should move Up!\n\nThen Left")
    cut = ids[: next(k for k in range(1, len(ids)) if decode(tokenizer, ids[:k]).endswith("\n\n"))]
    if encode(tokenizer, decode(tokenizer, cut)) != cut:
        cases["cut after line breaks"] = cut
    return cases


def conversation(tokenizer, answer_ids: list[int], prefix: str = "", system: bool = True):
    """The first prompt's ids, and the messages of a second turn whose answer was ``answer_ids``."""
    first = ([SYSTEM] if system else []) + [FIRST]
    chat = ChatTokens.of(tokenizer)
    body = answer_ids[:-1] if answer_ids and answer_ids[-1] == end_id(tokenizer) else answer_ids
    messages = first + [{"role": "assistant", "content": prefix + decode(tokenizer, body)}, SECOND]
    return chat, chat.full(first, prefix), messages


@pytest.mark.parametrize("prefix", ["", "<think>"])
def test_a_clean_answer_appends_to_the_full_render(tokenizer, prefix):
    """An answer that ended its turn and encodes back to its own ids: the appended prompt is the
    full render of the same messages, token for token, over three turns."""
    answer = encode(tokenizer, " I should move Up. </think> <answer> Up </answer>") + [end_id(tokenizer)]
    chat, prompt, messages = conversation(tokenizer, answer, prefix)
    ids, diverged = chat.append(prompt + answer, messages, 3, prefix)
    assert (ids, diverged) == (chat.full(messages, prefix), False)
    later = messages + [{"role": "assistant", "content": prefix + " Down"}, THIRD]
    again = encode(tokenizer, " Down") + [end_id(tokenizer)]
    assert chat.append(ids + again, later, 5, prefix) == (chat.full(later, prefix), False)


@pytest.mark.parametrize("prefix", ["", "<think>"])
@pytest.mark.parametrize("kind", ["cut after line breaks", "cut mid-word", "invalid utf-8 at the end",
                                  "invalid utf-8 inside", "merges differently"])
def test_an_answer_that_does_not_encode_back_keeps_its_sampled_ids(tokenizer, kind, prefix):
    cases = answers(tokenizer)
    if kind not in cases:
        pytest.skip(f"no such answer on this tokenizer ({kind})")
    answer = cases[kind]
    text = decode(tokenizer, answer)
    assert encode(tokenizer, text) != answer  # the case this test is about
    for ended in (False, True):  # cut by the token limit, or ended by the model
        sampled = answer + [end_id(tokenizer)] * ended
        chat, prompt, messages = conversation(tokenizer, sampled, prefix)
        ids, diverged = chat.append(prompt + sampled, messages, 3, prefix)
        assert ids[: len(prompt) + len(sampled)] == prompt + sampled
        assert not diverged
        # the template's end of turn once, then the new message: the full render's text
        assert decode(tokenizer, ids) == chat.render(messages, True) + prefix
        assert ids != chat.full(messages, prefix)  # a full render would have changed the answer


def test_the_default_templates_own_system_message_stays_in_an_appended_prompt(default_tokenizer):
    """SmolLM2's template adds its system message when the conversation has none."""
    answer = encode(default_tokenizer, "Up") + [end_id(default_tokenizer)]
    chat, prompt, messages = conversation(default_tokenizer, answer, system=False)
    assert "SmolLM" in decode(default_tokenizer, prompt)
    assert chat.append(prompt + answer, messages, 2) == (chat.full(messages), False)


def with_template(tokenizer, template: str):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


THOUGHT = "<think> The box is below me. </think> <answer> Down </answer>"


def test_a_template_that_drops_earlier_thoughts_diverges(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, DROPS_THINK_TEMPLATE)
    answer = encode(tokenizer, THOUGHT) + [end_id(tokenizer)]
    chat, prompt, messages = conversation(tokenizer, answer)
    ids, diverged = chat.append(prompt + answer, messages, 3)
    assert diverged
    assert ids[: len(prompt) + len(answer)] == prompt + answer  # the sampled thought stays
    assert "The box is below me" not in decode(tokenizer, chat.full(messages))
    # an answer without a thought is rendered the same either way: no divergence
    plain = encode(tokenizer, " <answer> Down </answer>") + [end_id(tokenizer)]
    chat, prompt, messages = conversation(tokenizer, plain)
    assert chat.append(prompt + plain, messages, 3) == (chat.full(messages), False)


def test_an_engine_counts_a_template_that_drops_thoughts_and_warns_once(tiny_model_and_tokenizer, caplog):
    from ragen.llm.hf import HFEngine
    from ragen.llm.types import GenerationRequest, SamplingParams

    model, tokenizer = tiny_model_and_tokenizer
    tokenizer = with_template(tokenizer, DROPS_THINK_TEMPLATE)
    engine = HFEngine(model=model, tokenizer=tokenizer)
    sampling = SamplingParams(temperature=1.0, max_tokens=6, seed=1)
    first = [SYSTEM, FIRST]
    (opening,) = engine.generate([GenerationRequest(first, env_id=0, turn=0)], sampling)
    assert engine.stats().history_divergences == 0
    # the episode's second and third turns, after answers that thought
    thought = encode(tokenizer, THOUGHT) + [end_id(tokenizer)]
    history = opening.prompt_token_ids + thought
    messages = first + [{"role": "assistant", "content": THOUGHT}, SECOND]
    with caplog.at_level(logging.WARNING, logger="ragen.llm.types"):
        (second,) = engine.generate([GenerationRequest(messages, env_id=0, turn=1, history_token_ids=history,
                                                       history_messages=3)], sampling)
        history = second.prompt_token_ids + thought
        messages = messages + [{"role": "assistant", "content": THOUGHT}, THIRD]
        (third,) = engine.generate([GenerationRequest(messages, env_id=0, turn=2, history_token_ids=history,
                                                      history_messages=5)], sampling)
    assert engine.stats().history_divergences == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "rewrites earlier turns" in r.message]
    assert len(warnings) == 1
    assert tokenizer.name_or_path and tokenizer.name_or_path in warnings[0].getMessage()
    assert third.prompt_token_ids[: len(history)] == history  # the sampled thoughts stay in the prompt


def test_a_template_that_refuses_a_system_message_still_appends(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, NO_SYSTEM_TEMPLATE)
    chat = ChatTokens.of(tokenizer)
    with pytest.raises(Exception, match="no system message"):
        chat.full([SYSTEM, FIRST])
    for answer in (encode(tokenizer, " Up") + [end_id(tokenizer)], answers(tokenizer)["invalid utf-8 inside"]):
        chat, prompt, messages = conversation(tokenizer, answer, system=False)
        ids, diverged = chat.append(prompt + answer, messages, 2)
        assert not diverged
        assert ids[: len(prompt) + len(answer)] == prompt + answer
        assert decode(tokenizer, ids) == chat.render(messages, True)
    assert chat.closing() == "<|im_end|>\n"



def test_chat_tokens_travel_to_another_process_by_their_source(tokenizer):
    """A worker that serves agent calls gets the engine's chat tokens pickled: rebuilt from the
    tokenizer and end ids (or the byte template), the same prompts; one built from bare functions
    says it cannot travel."""
    import pickle

    from ragen.llm.scripted import byte_chat

    chat = ChatTokens.of(tokenizer)
    copy = pickle.loads(pickle.dumps(chat))
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "Add 2 and 3."}]
    assert copy.full(messages, "<answer>") == chat.full(messages, "<answer>")
    assert copy.end_texts == chat.end_texts and copy.name == chat.name
    assert pickle.loads(pickle.dumps(byte_chat())).full(messages) == byte_chat().full(messages)
    with pytest.raises(TypeError, match="cannot be sent to another process"):
        pickle.dumps(ChatTokens(lambda m, g: "", lambda t: [], {}, "bare"))

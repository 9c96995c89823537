"""Tool calls: schemas checked at config read, the Hermes and server parsers, tool messages in
the prompt, exact tokens across tool turns, the search and code envs' tool forms, the OpenAI
engine's parsed calls, and a dump of a tool episode in the viewer."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, replace

import pytest

from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.scripted import ScriptedEngine, byte_chat
from ragen.llm.tool_calls import BadCall, ToolCall, call_text, check_tools, parse_hermes, read_server_calls
from ragen.llm.types import Completion
from ragen.env.base import BaseEnvConfig, BaseLanguageBasedEnv, function_tool
from ragen.rollout.context import NO_TOOL_CALL, ContextConfig, ContextManager
from ragen.rollout.envs import tag_spec
from ragen.rollout.types import StopReason, episode_ids

from tests.rollout_helpers import custom_envs, loop_config, sequential, specs_for

pytestmark = pytest.mark.timeout(120)

TOOLS = [function_tool("add", "Add a number to the counter.", amount="How much, in digits."),
         function_tool("stop", "End the episode.")]


@dataclass
class CounterConfig(BaseEnvConfig):
    tools: list | None = None
    target: int = 5


class CounterEnv(BaseLanguageBasedEnv):
    """A tool env: ``add(amount)`` adds to a counter, ``stop()`` ends; success at the target."""

    config_cls = CounterConfig

    def __init__(self, config: CounterConfig | None = None) -> None:
        super().__init__(config or CounterConfig(tools=TOOLS))
        self.total = 0

    def reset(self, seed=None, **kwargs):
        self.total = (seed or 0) % 3
        return f"The counter is {self.total}. Bring it to {self.config.target}."

    def step(self, action):
        assert isinstance(action, dict), action
        if action["name"] == "stop":
            return f"Stopped at {self.total}.", 0.0, True, {"success": self.total == self.config.target}
        self.total += int(action["arguments"]["amount"])
        done = self.total == self.config.target
        return f"The counter is {self.total}.", float(done), done, {"success": done}

    def render(self, mode=None):
        return f"The counter is {self.total}."


def counter_tag(tools=TOOLS, **kw) -> dict:
    return {"env_type": "tests.test_tool_calls:CounterEnv", "config_type": "tests.test_tool_calls:CounterConfig",
            "max_actions_per_traj": 6, "max_tokens": 400, "env_instruction": "Use the tools.",
            "env_config": {"tools": tools, **kw}}


def counter_answers(prompt, rng):
    """The script of the counter's policy: an unparsable call first, then a call that adds 1 and
    one with arguments that do not match, until the counter shows the target; then stop."""
    shown = [int(x) for x in __import__("re").findall(r"The counter is (\d+)", prompt)]
    if "Error in tool call" not in prompt:
        return '<tool_call>{"name": "add", "arguments": {"amount": "1"</tool_call>', 0.0
    if shown and shown[-1] >= 5:
        return call_text("stop", {}), 0.0
    return call_text("add", {"amount": "1"}) + "\n" + call_text("add", {"amount": 2}), 0.0


# ----- schemas and parsers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tools, words", [
    ([{"type": "function", "function": {"name": "q", "parameters": {"type": "object",
                                                                    "properties": {"x": {"type": "strng"}}}}}],
     "is not valid JSON Schema at properties/x/type"),
    ([{"type": "function", "function": {"name": "q", "parameters": {"type": "array"}}}], '"type": "object"'),
    ([{"type": "tool", "function": {"name": "q"}}], '"type": "function"'),
    ([{"type": "function", "function": {"name": "two words"}}], "function.name"),
    ([TOOLS[0], TOOLS[0]], "two tools are named 'add'"),
    ([], "non-empty list"),
])
def test_a_bad_tool_schema_is_refused_at_config_read_naming_the_tag(tools, words):
    with pytest.raises(ValueError, match="custom_envs.Counter") as err:
        tag_spec("Counter", {"Counter": counter_tag(tools)})
    assert words in str(err.value)
    assert tag_spec("Counter", {"Counter": counter_tag()})["tools"] == TOOLS


def one_tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "q", "parameters": parameters}}]


ITEM = {"type": "object", "properties": {"n": {"type": "integer"}}}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("parameters, words", [
    ({"type": "object", "$ref": "#"}, "at (root): $ref '#' refers back into a schema it is within"),
    ({"type": "object", "properties": {"child": {"$ref": "#"}}}, "at properties/child: $ref '#' refers back"),
    ({"type": "object", "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/b"}},
                                  "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
      "properties": {"x": {"$ref": "#/$defs/a"}}}, "refers back into a schema it is within"),
    ({"type": "object", "properties": {"x": {"$ref": "http://127.0.0.1:9/item.json"}}},
     "$ref 'http://127.0.0.1:9/item.json' is not taken: a tool's parameters refer only into themselves"),
    ({"type": "object", "properties": {"x": {"$ref": "item.json#/n"}}}, "nothing is downloaded at run time"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/item"}}}, "$ref '#/$defs/item' points at nothing"),
    ({"type": "object", "properties": {"x": {"$dynamicRef": "#node"}}}, "$dynamicRef is not taken"),
    ({"type": "object", "properties": {"x": {"$id": "http://example.com/x", "type": "string"}}},
     "an $id below the root is not taken"),
    ({"type": "object", "patternProperties": {"^(a|aa)+$": {}}}, "patternProperties is not taken"),
    ({"type": "object", "$defs": {"d0": ITEM, **{f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i - 1}"}] * 2}
                                                 for i in range(1, 30)}},
      "properties": {"x": {"$ref": "#/$defs/d29"}}}, "expand to more than 10000 schemas"),
])
def test_a_recursive_remote_or_unbounded_ref_is_refused_at_config_read(parameters, words):
    """Issue 59: `$ref: '#'` passed config read, then every call raised RecursionError; a remote
    `$ref` was fetched over HTTP while a call was checked."""
    with pytest.raises(ValueError, match="custom_envs.Counter") as err:
        tag_spec("Counter", {"Counter": counter_tag(one_tool(parameters))})
    assert "tools[0] (q).function.parameters" in str(err.value) and words in str(err.value), str(err.value)


@pytest.mark.timeout(30)
def test_local_refs_are_taken_and_no_check_goes_to_the_network(monkeypatch):
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError(f"a schema check went to the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    shared = {"type": "object", "$defs": {"item": ITEM}, "properties": {
        "first": {"$ref": "#/$defs/item"}, "rest": {"type": "array", "items": {"$ref": "#/$defs/item"}},
        "enum": {"enum": [{"$ref": "http://127.0.0.1:9/data-not-a-schema"}]}}}
    tools = check_tools(one_tool(shared), "custom_envs.Counter")
    assert parse_hermes(call_text("q", {"first": {"n": 1}, "rest": [{"n": 2}]}), tools) == [
        ToolCall("q", {"first": {"n": 1}, "rest": [{"n": 2}]})]
    (bad,) = parse_hermes(call_text("q", {"rest": [{"n": "2"}]}), tools)
    assert "at rest/0/n: '2' is not of type 'integer'" in bad.error
    # tools that never passed config read (a caller's own): a remote $ref is unresolvable, never fetched
    remote = one_tool({"type": "object", "properties": {"x": {"$ref": "http://127.0.0.1:9/item.json"}}})
    (call,) = parse_hermes(call_text("q", {"x": {}}), remote)
    assert isinstance(call, BadCall) and "cannot be checked" in call.error and "Unresolvable" in call.error


@pytest.mark.timeout(60)
def test_a_backtracking_pattern_costs_an_answer_at_most_its_budget():
    """Issue 59: a pattern that backtracks exponentially held the GIL for seconds per call, doubling
    per character. Its searches run on `regex`, which releases the GIL, and an answer's calls share
    PATTERN_BUDGET_S: past it a call is a BadCall naming the pattern."""
    tools = check_tools(one_tool({"type": "object", "properties": {"word": {"type": "string",
                                                                           "pattern": "^(a|aa)+$"}}}), "k")
    hostile = call_text("q", {"word": "a" * 40 + "!"})  # about 10^8 paths to refuse: seconds to minutes
    calls = parse_hermes(hostile * 4, tools)
    assert all(isinstance(c, BadCall) for c in calls) and len(calls) == 4
    said = "the pattern '^(a|aa)+$' took more than the 0.25 s of CPU time its answer may spend on patterns"
    assert all(said in c.error for c in calls), calls
    (served,) = read_server_calls([{"function": {"name": "q", "arguments": {"word": "a" * 40 + "!"}}}], tools)
    assert "took more than" in served.error
    assert parse_hermes(call_text("q", {"word": "aaa"}), tools) == [ToolCall("q", {"word": "aaa"})]
    (short,) = parse_hermes(call_text("q", {"word": "ab"}), tools)
    assert "'ab' does not match '^(a|aa)+$'" in short.error


def test_hermes_calls_are_read_in_order_and_each_bad_one_says_why():
    text = ('<think>use <tool_call>{"name": "stop"}</tool_call> later</think>'
            + call_text("add", {"amount": "3"})
            + '<tool_call>{"name": "add", "arguments": "{\\"amount\\": \\"4\\"}"}</tool_call>'
            + '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
            + '<tool_call>{"name": "jump"}</tool_call><tool_call>[1]</tool_call><tool_call>{"name": ')
    calls = parse_hermes(text, TOOLS)
    assert calls[:2] == [ToolCall("add", {"amount": "3"}), ToolCall("add", {"amount": "4"})]
    errors = [c.error for c in calls[2:]]
    assert all(isinstance(c, BadCall) for c in calls[2:]) and len(errors) == 4
    assert "do not match its parameters" in errors[0] and "'amount' is a required property" in errors[0]
    assert "no tool is named 'jump'" in errors[1] and "add, stop" in errors[1]
    assert "not a JSON object" in errors[2]
    assert "not closed with </tool_call>" in errors[3]
    assert parse_hermes("<think>x</think><answer>Up</answer>", TOOLS) == []
    bad_json = parse_hermes('<tool_call>{"name": "add", "arguments": {amount: 1}}</tool_call>', TOOLS)[0]
    assert isinstance(bad_json, BadCall) and "not valid JSON" in bad_json.error


def test_server_calls_are_checked_as_the_texts_are():
    calls = read_server_calls([{"id": "a", "type": "function", "function": {"name": "add", "arguments": '{"amount": "2"}'}},
                               {"function": {"name": "add", "arguments": "{bad"}}, "nonsense"], TOOLS)
    assert calls[0] == ToolCall("add", {"amount": "2"})
    assert "not valid JSON" in calls[1].error and "not {" in calls[2].error
    ctx = ContextManager(ContextConfig(tool_parser="server"))
    answer = Completion("<tool_call>{}</tool_call>", [], [], "stop", 0)
    (missing,) = ctx.parse_calls(answer, TOOLS)
    assert "ctx_manager.tool_parser=hermes" in missing.error
    with pytest.raises(ValueError, match="ctx_manager.tool_parser"):
        ContextConfig(tool_parser="json")


# ----- model output that would break a reader: a BadCall, never an exception -------------------------------

DEEP = "[" * 1000 + "]" * 1000  # about 500 tokens; json.loads raises RecursionError on it
HUGE_INT = "9" * 4301  # one digit past int's string limit; json.loads raises ValueError on it
HOSTILE = {  # a call the model may write -> what the model is told
    "deep": (f'{{"name": "add", "arguments": {{"amount": {DEEP}}}}}', "nested deeper than 64 levels"),
    "deep_extra": (f'{{"name": "add", "arguments": {{"amount": "1", "x": {DEEP}}}}}', "nested deeper than 64 levels"),
    "deep_call": (DEEP, "nested deeper than 64 levels"),
    "huge_int": (f'{{"name": "add", "arguments": {{"amount": {HUGE_INT}}}}}', "an integer of more than 4300 digits"),
    "schema": ('{"name": "add", "arguments": {"amount": 2}}', "do not match its parameters at amount: 2 is not of "
                                                               "type 'string'"),
    "surrogate": ('{"name": "add", "arguments": {"amount": "1\\ud800"}}', "'\\ud800' is a lone surrogate"),
    "long_value": ('{"name": "add", "arguments": {"amount": %s}}' % json.dumps(["1"] * 2000),
                   "do not match its parameters at amount"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_json_in_a_hermes_call_is_a_bad_call_saying_why(kind):
    body, words = HOSTILE[kind]
    (call,) = parse_hermes(f"<tool_call>{body}</tool_call>", TOOLS)
    assert isinstance(call, BadCall) and words in call.error, call.error
    assert len(call.error) <= 300  # a schema's message quotes the value: the model reads a bounded reason


@pytest.mark.timeout(30)
def test_hostile_arguments_from_a_server_are_bad_calls_saying_why():
    deep: list = []
    for _ in range(5000):  # decoded by a server: deeper than json.dumps can write
        deep = [deep]
    given = [f'{{"amount": {DEEP}}}', f'{{"amount": {HUGE_INT}}}', {"amount": deep},
             {"amount": int(HUGE_INT[:4000]) ** 2}, '{"amount": 2}', {"function": {"name": deep}}]
    calls = read_server_calls([{"function": {"name": "add", "arguments": a}} for a in given[:5]] + [given[5]], TOOLS)
    assert all(isinstance(c, BadCall) for c in calls), calls
    errors = [c.error for c in calls]
    assert "nested deeper than 64 levels" in errors[0] and "nested deeper than 64 levels" in errors[2]
    assert "an integer of more than 4300 digits" in errors[1] and "an integer of more than 4300 digits" in errors[3]
    assert "do not match its parameters" in errors[4] and "nested deeper than 64 levels" in errors[5]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value, words", [
    ("1e999", "the number 1e999 is not a finite float"),
    ("NaN", "the number NaN is not a finite float"),
    ("-Infinity", "the number -Infinity is not a finite float"),
    ("9" * 4000, "cannot be checked against its parameters: OverflowError"),  # multipleOf 0.5 divides as floats
])
def test_numbers_no_float_holds_are_bad_calls_saying_why(value, words):
    tools = [{"type": "function", "function": {"name": "scale", "parameters": {
        "type": "object", "properties": {"by": {"type": "number", "multipleOf": 0.5}}}}}]
    (call,) = parse_hermes(f'<tool_call>{{"name": "scale", "arguments": {{"by": {value}}}}}</tool_call>', tools)
    assert isinstance(call, BadCall) and words in call.error, call.error
    assert parse_hermes(call_text("scale", {"by": 1.5}), tools) == [ToolCall("scale", {"by": 1.5})]


def hostile_answers(prompt, rng):
    """Every hostile call at once; once their errors came back, stop."""
    if "Error in tool call" in prompt:
        return call_text("stop", {}), 0.0
    return "\n".join(f"<tool_call>{body}</tool_call>" for body, _ in HOSTILE.values()), 0.0


@pytest.mark.timeout(60)
def test_hostile_calls_cost_the_format_penalty_and_the_env_goes_on():
    """Issue 58: deep JSON, a huge integer, arguments off the schema: the model's mistakes, told to it
    with the format penalty, never an env error that drops its group."""
    envs = custom_envs(Counter={**counter_tag(), "max_tokens": 50_000})
    specs = specs_for(["Counter"], [1], 1, envs)
    loop = loop_config(max_turn=3)
    loop = replace(loop, sampling=replace(loop.sampling, max_tokens=50_000))
    (traj,) = sequential(specs, loop, engine=ScriptedEngine(answers="tests.test_tool_calls:hostile_answers"))
    assert traj.stop_reason is StopReason.DONE and traj.error is None, traj.error
    first = traj.turns[0]
    assert first.executed_actions == [] and first.penalty == loop.format_penalty
    assert len(first.tool_results) == len(HOSTILE)
    for (kind, (_, words)), result in zip(HOSTILE.items(), first.tool_results):
        assert result.startswith(f"Error in tool call") and words in result, (kind, result)
    messages = ContextManager(loop.context).build_messages(specs[0], traj.turns[:1], traj.turns[1].observation, 5)
    assert [m["content"] for m in messages if m["role"] == "tool"] == list(first.tool_results)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool_calls"])
def test_a_parser_that_fails_on_an_answer_costs_the_format_penalty_not_the_env(monkeypatch, caplog, tools):
    """Whatever a parser of model text raises is the answer's mistake: the turn takes the format
    penalty (a tool env's call error says so) and the episode goes on."""
    method = "parse_calls" if tools else "parse_response"
    original, calls = getattr(ContextManager, method), []

    def first_fails(self, *args):  # twice: a retry of the env on a fresh instance parses the answer again
        calls.append(1)
        if len(calls) <= 2:
            raise RecursionError("maximum recursion depth exceeded")
        return original(self, *args)

    monkeypatch.setattr(ContextManager, method, first_fails)
    envs = custom_envs(Counter=counter_tag())
    specs = specs_for(["Counter" if tools else "FrozenLake"], [1], 1, envs)
    loop = loop_config(max_turn=6)
    engine = ScriptedEngine(answers="tests.test_tool_calls:counter_answers") if tools else ScriptedEngine()
    (traj,) = sequential(specs, loop, engine=engine)
    assert traj.stop_reason is not StopReason.ERROR and traj.error is None and len(traj.turns) >= 3, traj.error
    for turn in traj.turns[:2]:
        assert turn.executed_actions == [] and turn.penalty == loop.format_penalty
        if tools:
            assert turn.tool_results == ("Error in tool call 1: the answer could not be read (RecursionError)",)
    assert "the parser failed on the answer at turn 0" in caplog.text


# ----- the rollout ------------------------------------------------------------------------------------------

def _counter_rollout(**loop_kw):
    envs = custom_envs(Counter=counter_tag())
    specs = specs_for(["Counter"], [2], 1, envs)
    loop = loop_config(max_turn=6, **{"max_tokens": 400, **loop_kw})  # the tag's 400
    engine = ScriptedEngine(answers="tests.test_tool_calls:counter_answers")
    return specs, loop, sequential(specs, loop, engine=engine)


def test_tool_calls_step_the_env_and_their_results_come_back_as_tool_messages():
    specs, loop, trajs = _counter_rollout()
    for spec, traj in zip(specs, trajs):
        assert traj.stop_reason is StopReason.DONE and traj.success, traj
        first, second = traj.turns[0], traj.turns[1]
        # an unparsable call: nothing runs, the format penalty, and the error goes back as its tool message
        assert first.executed_actions == [] and first.penalty == loop.format_penalty
        assert first.tool_results[0].startswith("Error in tool call 1: <tool_call> is not closed") or \
            "not valid JSON" in first.tool_results[0]
        # one good call and one whose arguments do not match: the good one runs, the other is an error
        assert len(second.executed_actions) == 1 and second.penalty == loop.format_penalty
        assert second.tool_results[0].startswith("The counter is")
        assert "do not match its parameters at amount" in second.tool_results[1]
        assert json.loads(second.executed_actions[0]) == {"name": "add", "arguments": {"amount": "1"}}
        messages = ContextManager(loop.context).build_messages(spec, traj.turns[:2], traj.turns[1].observation, 1)
        tools = [m for m in messages if m["role"] == "tool"]
        assert [m["content"] for m in tools] == list(first.tool_results + second.tool_results)
        assert messages[-1]["role"] == "tool" and messages[-2]["role"] == "tool"
        assert "<tool_call>" in messages[1]["content"] and "Use the tools." in messages[0]["content"]


def test_exact_tokens_hold_across_tool_turns():
    specs, loop, trajs = _counter_rollout()
    ctx, chat = ContextManager(loop.context), byte_chat()
    for spec, traj in zip(specs, trajs):
        ((row,),) = ctx.formulate_rollouts([(spec, traj.turns)], chat)
        assert row["input_ids"] == episode_ids(traj.turns)
        sampled = [lp for lp, m in zip(row["behaviour_logprobs"], row["loss_mask"]) if m]
        assert sampled and not any(math.isnan(lp) for lp in sampled)
        # the appended prompts are the full renders of the same messages (tools in the system message)
        for k, turn in enumerate(traj.turns):
            messages = ctx.build_messages(spec, traj.turns[:k], turn.observation, turn.actions_left)
            full = chat.full(messages, ctx.answer_prefix, spec.tools)
            assert episode_ids(traj.turns[:k + 1])[:len(full)] == full
        assert bytes(row["input_ids"]).decode().count('"name": "add"') >= 2  # the tools block and a call
    # rendered whole (rerender), the trainer's ids are the same here: nothing was tidied
    _, loop2, trajs2 = _counter_rollout()
    ctx2 = ContextManager(replace(loop2.context, token_history="rerender"))
    stripped = [replace(t, prompt_ids=(), prompt_start=0) for t in trajs2[0].turns]
    ((rerendered,),) = ctx2.formulate_rollouts([(specs[0], stripped)], chat)
    assert rerendered["input_ids"] == episode_ids(trajs2[0].turns)


def test_an_answer_without_a_call_is_a_penalty_and_the_next_prompt_says_so():
    envs = custom_envs(Counter=counter_tag())
    specs = specs_for(["Counter"], [1], 1, envs)
    loop = loop_config(max_turn=2)
    (traj,) = sequential(specs, loop, engine=ScriptedEngine())
    assert all(t.executed_actions == [] and t.penalty == loop.format_penalty for t in traj.turns)
    messages = ContextManager(loop.context).build_messages(specs[0], traj.turns[:1], traj.turns[0].observation, 6)
    assert messages[-1] == {"role": "user", "content": NO_TOOL_CALL}


def test_a_tool_env_needs_the_whole_conversation():
    from ragen.llm_agent import AgentSetup

    with pytest.raises(ValueError, match="custom_envs.Counter declares tools.*context_window_mode=full"):
        AgentSetup.from_config({
            "custom_envs": custom_envs(Counter=counter_tag()),
            "agent_proxy": {"max_turn": 3, "context_window_mode": "single_turn"},
            "ctx_manager": {"token_history": "rerender"},
            "es_manager": {s: {"env_groups": 1, "group_size": 1,
                               "env_configs": {"tags": ["Counter"], "n_groups": [1]}} for s in ("train", "val")}})


# ----- chat templates ---------------------------------------------------------------------------------------

# Qwen2.5's way with tools, cut down: the tool list in the system message, tool messages as
# <tool_response> blocks in a user turn
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\n\n' }}{% endif %}{{ '# Tools\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}{{ '\n</tools><|im_end|>\n' }}"
    "{% elif messages[0]['role'] == 'system' %}{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message['role'] != 'system' %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)


def _tool_conversation(tokenizer):
    chat = ChatTokens.of(tokenizer)
    messages = [{"role": "system", "content": "You're a helpful assistant."},
                {"role": "user", "content": "The counter is 1."}]
    prompt = chat.full(messages, "<think>", TOOLS)
    answer_text = " ok</think>" + call_text("add", {"amount": "1"}) + call_text("stop", {})
    answer = tokenizer(answer_text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    later = messages + [{"role": "assistant", "content": "<think>" + answer_text},
                        {"role": "tool", "content": "The counter is 2.", "tool_call_id": "call_1_1"},
                        {"role": "tool", "content": "Stopped at 2.", "tool_call_id": "call_1_2"}]
    return chat, prompt, answer, later


def test_a_template_that_renders_tools_gets_them_and_tool_messages_append_exactly(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    chat, prompt, answer, later = _tool_conversation(tokenizer)
    assert chat.renders_tools
    text = tokenizer.decode(prompt)
    assert "# Tools\n<tools>" in text and '"name": "add"' in text and "You may call" not in text
    ids, diverged = chat.append(prompt + answer, later, 3, "<think>", TOOLS)
    assert not diverged and ids == chat.full(later, "<think>", TOOLS)
    assert "<tool_response>\nThe counter is 2.\n</tool_response>\n<tool_response>" in tokenizer.decode(ids)


def test_a_template_without_tools_gets_them_in_the_system_message(tiny_tokenizer):
    chat, prompt, answer, later = _tool_conversation(tiny_tokenizer)  # ChatML: tools= ignored
    assert not chat.renders_tools
    text = tiny_tokenizer.decode(prompt)
    assert text.startswith("<|im_start|>system\nYou're a helpful assistant.\n\n# Tools\n\nYou may call one or more")
    assert '"name": "add"' in text and "<tool_call></tool_call> XML tags" in text
    ids, diverged = chat.append(prompt + answer, later, 3, "<think>", TOOLS)
    assert not diverged and ids == chat.full(later, "<think>", TOOLS)
    assert "<|im_start|>tool\nStopped at 2.<|im_end|>" in tiny_tokenizer.decode(ids)


def test_the_hf_engine_plays_a_tool_env_with_exact_tokens(tiny_model_and_tokenizer):
    from ragen.llm.hf import HFEngine

    model, tokenizer = tiny_model_and_tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    engine = HFEngine(model=model, tokenizer=tokenizer)
    envs = custom_envs(Counter=counter_tag())
    specs = specs_for(["Counter"], [2], 1, envs)
    loop = replace(loop_config(max_turn=3), sampling=replace(loop_config().sampling, max_tokens=12, seed=4))
    trajs = sequential(specs, loop, engine=engine)
    ctx = ContextManager(loop.context)
    for spec, traj in zip(specs, trajs):
        assert len(traj.turns) == 3
        ((row,),) = ctx.formulate_rollouts([(spec, traj.turns)], engine.chat)
        assert row["input_ids"] == episode_ids(traj.turns)
        assert not any(math.isnan(lp) for lp, m in zip(row["behaviour_logprobs"], row["loss_mask"]) if m)
        assert '"name": "add"' in tokenizer.decode(row["input_ids"])
    assert engine.stats().history_divergences == 0


# ----- the search and code envs' tool forms -----------------------------------------------------------------

def test_the_code_env_takes_run_tests_calls():
    envs = custom_envs()
    spec = tag_spec("CodeRepairTools", envs)
    assert [t["function"]["name"] for t in spec["tools"]] == ["run_tests"]
    specs = specs_for(["CodeRepairTools"], [4], 1, envs)
    trajs = sequential(specs, loop_config(max_turn=3, max_tokens=600),  # the tag's 600 for a program
                       engine=ScriptedEngine(answers="ragen.env.code.pool:scripted_answer"))
    assert any(t.success for t in trajs) and all(t.turns[0].executed_actions for t in trajs)
    for t in trajs:
        call = json.loads(t.turns[0].executed_actions[0])
        assert call["name"] == "run_tests" and call["arguments"]["code"].strip()
        for turn in t.turns:  # each verdict comes back as the call's tool message
            assert turn.tool_results == (turn.steps[0].observation,)
            assert turn.tool_results[0].startswith(("All", "Passed"))


def test_the_openai_engine_sends_tools_and_reads_the_servers_calls(monkeypatch):
    pytest.importorskip("bm25s")
    from ragen.env.search.corpus import shipped_corpus
    from ragen.env.search.server import RetrievalServer
    from ragen.llm.openai_engine import OpenAIEngine
    from tests.test_llm_openai import FakeServer

    fake = FakeServer(policy=ScriptedEngine(answers="ragen.env.search.pool:scripted_answer"))
    try:
        with RetrievalServer(shipped_corpus(filler=100)) as search:
            monkeypatch.setenv("RAGEN_RETRIEVAL_KEY", search.key)
            envs = custom_envs(S={**custom_envs()["SearchQATools"], "max_tokens": 300,
                                  "env_config": {"server_url": search.url, "tool_calls": True}})
            specs = specs_for(["S"], [4], 1, envs)
            loop = loop_config(max_turn=5)
            loop = replace(loop, context=replace(loop.context, tool_parser="server"))
            engine = OpenAIEngine(fake.base_url)
            trajs = sequential(specs, loop, engine=engine)
            engine.close()
            direct = sequential(specs, loop_config(max_turn=5),  # the same policy, its calls read by hermes
                                engine=ScriptedEngine(answers="ragen.env.search.pool:scripted_answer"))
    finally:
        fake.stop()
    # the server parsed every call (tool_parser=server reads nothing else), and each one ran
    assert all(t.stop_reason is StopReason.DONE for t in trajs + direct)
    for t in trajs:
        names = [json.loads(x.executed_actions[0])["name"] for x in t.turns]
        assert names[-1] == "finish" and set(names[:-1]) == {"search"} and not any(x.penalty for x in t.turns)
    body = fake.bodies[-1]
    assert [t["function"]["name"] for t in body["tools"]] == ["search", "finish"]
    assert any(m["role"] == "tool" and m["tool_call_id"].startswith("call_") for m in body["messages"])


# ----- records ----------------------------------------------------------------------------------------------

def test_a_dump_of_a_tool_episode_reads_back_replays_and_shows_the_tool_messages(tmp_path):
    from ragen.rollout.dump import read_dump, write_dump
    from ragen.rollout.types import RolloutResult
    from ragen.env.allowed import AllowedEnvTypes
    from ragen.tools.replay import replay
    from ragen.viewer.page import render_html

    specs, loop, trajs = _counter_rollout()
    path = write_dump(tmp_path, "step_000001", RolloutResult(trajs, specs), loop, "train", 1)
    records = read_dump(path)
    assert [r.trajectory for r in records] == trajs and records[0].spec.tools == TOOLS
    for record in records:
        allowed = AllowedEnvTypes(frozenset({record.spec.env_type, record.spec.config_type}))
        assert replay(record, env_types=allowed).difference is None
    page = render_html(records)
    assert page.count('class="msg tool"') == sum(len(t.tool_results) for tr in trajs for t in tr.turns)
    assert "Error in tool call 1" in page and "The counter is 5." in page and "<b>tool calls</b>" in page


def test_a_think_end_inside_a_calls_argument_is_the_calls_text():
    """Issue 59, item 6: the last ``</think>`` was taken as the thoughts' end, inside the call."""
    text = '<think>plan</think>' + call_text("add", {"amount": "3 </think> 4"})
    calls = parse_hermes(text, TOOLS)
    assert [type(c).__name__ for c in calls] == ["ToolCall"]
    assert calls[0].action()["arguments"] == {"amount": "3 </think> 4"}

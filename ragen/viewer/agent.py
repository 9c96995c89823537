"""An agent episode's calls as HTML: ``agent_turn(record, i)``, one call of its program.

Each call shows where its segment starts and why (the cause, with what it means: a prefix
break made visible), the messages it added (role, content, tool calls, a tool message's call
id), its segment's tools, the answer as the model wrote it with the tool calls read from it,
and its tokens: the prompt ids it added (not trained, mask 0) and the ids sampled (trained,
mask 1); the episode's reward on its last call. Everything a model or a program wrote is
escaped.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any, Callable

from ragen.gateway.segments import BREAKS
from ragen.rollout.agent_call import AgentCall
from ragen.rollout.dump import DumpRecord
from ragen.rollout.types import Turn

CAUSES = {"first": "the session's first call", **BREAKS}


ToolsHtml = Callable[[Any], str]  # tools -> their names as HTML (the page's)


def agent_turn(r: DumpRecord, i: int, tools_html: ToolsHtml) -> str:
    """Call ``i`` of ``r``'s agent episode as a list item; ``tools_html(tools)``: the tools' names."""
    turn = r.trajectory.turns[i]
    try:
        call = AgentCall.of_turn(turn, f"turns[{i}]")
    except ValueError as exc:  # a dump that read_dump did not check as an agent's (its line has no program)
        return (f'<li class="turn call" data-turn="{i}"><h4>turn {i + 1}</h4>'
                f'<pre class="error">not an agent call: {escape(str(exc))}</pre>{_answer(turn)}</li>')
    last = i == len(r.trajectory.turns) - 1
    held = max(0, len(r.messages[i]) - len(call.messages)) if i < len(r.messages) and call.cause is None else 0
    seed = f" · request seed {r.request_seeds[i]}" if i < len(r.request_seeds) else ""
    reward = (f' · <span class="reward">reward {turn.reward + turn.penalty:.3f}</span>'
              if last or turn.reward or turn.penalty else "")
    cause = f' data-cause="{escape(call.cause)}"' if call.cause is not None else ""
    return (f'<li class="turn call" data-turn="{i}" data-call="{call.index}" data-segment="{call.segment}"{cause}>'
            f"{_segment_start(call, tools_html)}"
            f"<h4>call {call.index} · {escape(call.endpoint)} · segment {call.segment} · policy "
            f"v{turn.policy_version} · finish {escape(turn.finish_reason)}{seed}{reward}</h4>"
            f"{_added(call, held)}{_answer(turn)}{_tokens(turn)}</li>")


def _segment_start(call: AgentCall, tools_html: ToolsHtml) -> str:
    if call.cause is None:
        return ""
    meaning = CAUSES.get(call.cause, "a cause this viewer does not know")
    kind = "prefix-break" if call.cause != "first" else "first"
    return (f'<p class="segment-start {kind}" data-cause="{escape(call.cause)}">segment {call.segment} starts: '
            f"<b>{escape(call.cause)}</b> ({escape(meaning)}){tools_html(call.tools)}</p>")


def _added(call: AgentCall, held: int) -> str:
    if call.answer is None:  # a completions call: its prompt is text, seen only as its ids
        return '<p class="added">a completions call: its prompt is text, not messages (its ids below)</p>'
    after = f"after the {held} messages its segment held" if held else "its segment's messages"
    body = "".join(_message(m) for m in call.messages)
    return (f'<details class="added" open><summary>{len(call.messages)} messages added ({after})</summary>'
            f"{body}</details>")


def _message(m: dict[str, Any]) -> str:
    role = str(m.get("role", "?"))
    call_id = f' · answers <code>{escape(str(m["tool_call_id"]))}</code>' if "tool_call_id" in m else ""
    content = str(m.get("content") or "")
    text = f"<pre>{escape(content)}</pre>" if content else ""
    return (f'<div class="msg role-{escape(role)}"><b>{escape(role)}</b>{call_id}{text}'
            f"{_calls(m.get('tool_calls'))}</div>")


def _calls(calls: Any) -> str:
    """Tool calls as OpenAI writes them (``{"id", "function": {"name", "arguments"}}``): each one's
    name, id and arguments."""
    if not calls:
        return ""
    items = []
    for c in calls if isinstance(calls, (list, tuple)) else [calls]:
        function = c.get("function") if isinstance(c, dict) else None
        function = function if isinstance(function, dict) else {}
        call_id = f" <code>{escape(str(c['id']))}</code>" if isinstance(c, dict) and "id" in c else ""
        arguments = function.get("arguments", "")
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False, default=str)
        items.append(f'<li><code class="tool-name">{escape(str(function.get("name")))}</code>{call_id}'
                     f"<pre>{escape(arguments)}</pre></li>")
    return f'<ul class="tool-calls">{"".join(items)}</ul>'


def _answer(turn: Turn) -> str:
    calls = f"<b>tool calls</b>{_calls(turn.tool_calls)}" if turn.tool_calls else ""
    return (f'<div class="response"><b>answer (sampled: trained)</b>'
            f'<pre class="answer trained" data-mask="1">{escape(turn.response)}</pre>{calls}</div>')


def _tokens(turn: Turn) -> str:
    """The ids the call added to its prompt (not trained) and the ids sampled (trained), each
    with its loss mask."""
    prompt = escape(" ".join(map(str, turn.prompt_ids)))
    sampled = escape(" ".join(map(str, turn.response_ids)))
    return (f'<details class="tokens"><summary>tokens: +{len(turn.prompt_ids)} prompt after the first '
            f"{turn.prompt_start} of its segment (not trained), {len(turn.response_ids)} sampled (trained)</summary>"
            f'<p>prompt ids added, mask 0</p><code class="ids" data-mask="0">{prompt}</code>'
            f'<p>sampled ids, mask 1</p><code class="ids trained" data-mask="1">{sampled}</code></details>')

"""The viewer's HTML page: one self-contained file (inline CSS and JS, no network).

- ``render_html(records, metrics=None)``: the page of one dump: a summary, the
  learning curve (when metrics rows are given) with what its reward and success
  measure, a table of episodes filtered by tag, success and stop reason, the
  legend of the maps (when episodes draw any), and each episode turn by turn,
  collapsed; an agent episode's program output first (its info, traceback,
  stdout and stderr), then its calls (``agent.py``).
- ``split_response(text, think)``: a model answer's ``<think>`` and
  ``<answer>`` parts, or None when it does not follow the format (the raw
  answer is shown then).

Filtering runs in the page: select boxes, or a URL hash such as
``#tag=FrozenLake&success=no&stop=error`` applied on load; it hides the table
rows and the episode sections. Once the script ran, ``<body>`` carries
``data-ready="1"``.
"""

from __future__ import annotations

import json
from collections import Counter
from html import escape
from typing import Any

from ragen.agents.capture import LIMIT_CHARS
from ragen.env.allowed import AllowedEnvTypes
from ragen.rollout.context import ContextConfig, ContextManager
from ragen.rollout.dump import DumpRecord
from ragen.rollout.types import ProgramOutput, StopReason, Turn
from ragen.utils import common_prefix_length
from ragen.viewer.agent import agent_turn
from ragen.viewer.curve import curve_notes, curve_svg
from ragen.viewer.grid import Cell, GridPicture, Symbols, env_config, picture, symbols_for


# the most of a program's text (its stdout, stderr, traceback, info) an episode shows: its end, as much
# as an agent's capture keeps (a dump is input, and may hold more)
PROGRAM_TEXT_CHARS = LIMIT_CHARS


def split_response(text: str, think: bool = True) -> tuple[str | None, str] | None:
    """(think, answer) of ``<think>..</think><answer>..</answer>`` (think is None
    for ``<answer>`` alone when ``think`` is off); None when malformed. Uses
    ``str.find``, not a regex: long runs of open tags must not backtrack."""
    if think:
        start = text.find("<think>")
        close = text.find("</think>", start + 7) if start >= 0 else -1
        if close < 0:
            return None
        thought, rest = text[start + 7:close], close + 8
    else:
        thought, rest = None, 0
    a = text.find("<answer>", rest)
    if a < 0 or (think and text[rest:a].strip()):
        return None
    end = text.find("</answer>", a + 8)
    if end < 0:
        return None
    return thought, text[a + 8:end]


def render_html(records: list[DumpRecord], metrics: list[dict[str, Any]] | None = None,
                title: str | None = None, env_types: AllowedEnvTypes | None = None) -> str:
    records = sorted(records, key=lambda r: r.env_id)
    configs: dict[tuple, Any] = {}
    symbols: dict[tuple, Symbols | None] = {}
    for r in records:
        if r.spec.reuse_key not in symbols:
            # an agent tag's episode has no env to build a config of: its calls are drawn (viewer.agent)
            configs[r.spec.reuse_key] = None if r.spec.is_agent else env_config(r.spec, env_types)
            symbols[r.spec.reuse_key] = symbols_for(r.spec, configs[r.spec.reuse_key])
    if title is None:
        first = records[0] if records else None
        title = f"ragen rollout: {first.split} step {first.step}" if first else "ragen rollout"
    curve = curve_svg(metrics) if metrics else ""
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in curve_notes(configs.values()))
    parts = [
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        _summary(records),
        f'<section id="curve"><h2>Learning curve</h2>{curve}{notes}</section>' if curve else "",
        _filters(records),
        _table(records),
        _legend(records, symbols),
        '<section id="episodes"><h2>Episodes</h2>',
        *(_episode(r, symbols[r.spec.reuse_key]) for r in records),
        "</section>",
        f"<script>{_JS}</script></body></html>\n",
    ]
    return "\n".join(p for p in parts if p)


# ----------------------------------------------------------------------------- parts


def _success(r: DumpRecord) -> str:
    return "yes" if r.trajectory.success else "no"


def _summary(records: list[DumpRecord]) -> str:
    n = len(records)
    wins = sum(r.trajectory.success for r in records)
    stops = Counter(r.trajectory.stop_reason.value for r in records)
    tags = Counter(r.spec.tag for r in records)
    mean = sum(r.trajectory.reward for r in records) / n if n else 0.0
    return (f'<p class="summary">{n} episodes · success {wins}/{n} · mean reward {mean:.3f} · stop: '
            + ", ".join(f"{escape(k)} {v}" for k, v in sorted(stops.items()))
            + " · tags: " + ", ".join(f"{escape(k)} {v}" for k, v in sorted(tags.items())) + "</p>")


def _select(name: str, label: str, values: list[str]) -> str:
    options = "".join(f'<option value="{escape(v)}">{escape(v)}</option>' for v in values)
    return (f'<label>{escape(label)} <select id="f-{name}" data-filter="{name}">'
            f'<option value="">all</option>{options}</select></label>')


def _filters(records: list[DumpRecord]) -> str:
    tags = sorted({r.spec.tag for r in records})
    stops = [s.value for s in StopReason if any(r.trajectory.stop_reason == s for r in records)]
    return ('<section id="filters"><h2>Filter</h2>' + _select("tag", "tag", tags)
            + _select("success", "success", ["yes", "no"]) + _select("stop", "stop reason", stops)
            + ' <span id="shown">' + f"{len(records)} of {len(records)} shown</span></section>")


def _data(r: DumpRecord) -> str:
    return (f'data-episode="{r.env_id}" data-tag="{escape(r.spec.tag)}" data-success="{_success(r)}" '
            f'data-stop="{escape(r.trajectory.stop_reason.value)}"')


def _table(records: list[DumpRecord]) -> str:
    head = "".join(f"<th>{h}</th>" for h in
                   ("env", "tag", "group", "seed", "success", "stop reason", "reward", "turns", "error"))
    rows = []
    for r in records:
        t = r.trajectory
        failed = " failed" if t.stop_reason.failed else ""
        error = f'<span class="error">{escape(_first_line(t.error))}</span>' if t.error else ""
        rows.append(
            f'<tr class="ep-row{failed}" {_data(r)}><td><a href="#ep-{r.env_id}">{r.env_id}</a></td>'
            f"<td>{escape(t.tag)}</td><td>{t.group_id}</td><td>{t.seed}</td>"
            f'<td class="{_success(r)}">{_success(r)}</td><td>{escape(t.stop_reason.value)}</td>'
            f"<td>{t.reward:.3f}</td><td>{len(t.turns)}</td><td>{error}</td></tr>")
    return (f'<section id="table"><h2>Episodes at a glance</h2><table id="episode-table"><thead><tr>{head}'
            f'</tr></thead><tbody>{"".join(rows)}</tbody></table></section>')


def _first_line(text: str, limit: int = 160) -> str:
    line = text.strip().split("\n")[-1] if text.strip() else ""  # a traceback's last line says what went wrong
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _state(observation: str, symbols: Symbols | None, where: str) -> str:
    pic = picture(observation, symbols)
    if pic is None:
        return f'<pre class="obs" {where}>{escape(observation)}</pre>'
    return _grid(pic, where)


def _where(env: int, turn: int | None = None, step: int | None = None) -> str:
    """Attributes naming a state: turn and step (0: before the turn's first action), or the final state."""
    if turn is None:
        return f'data-env="{env}" data-final="1"'
    return f'data-env="{env}" data-turn="{turn}" data-step="{step}"'


def _cell(c: Cell) -> str:
    return (f'<td data-cell="{c.kind}" class="t-{c.terrain}{" p" if c.player else ""}{" b" if c.box else ""}" '
            f'title="{escape(c.kind)}"></td>')


def _grid(pic: GridPicture, where: str) -> str:
    rows = [f"<tr>{''.join(_cell(c) for c in row)}</tr>" for row in pic.rows]
    text = f'<pre class="coords">{escape(pic.text)}</pre>' if pic.text else ""
    return f'<div class="state"><table class="grid" {where}>{"".join(rows)}</table>{text}</div>'


def _legend(records: list[DumpRecord], symbols: dict[tuple, Symbols | None]) -> str:
    """What each square of the maps is: for each set of symbols the episodes are drawn with
    (Sokoban's, FrozenLake's, a custom vocabulary), each cell as drawn, its symbol and its name."""
    tags: dict[tuple, list[str]] = {}  # a set of symbols -> the tags drawn with it
    sets: dict[tuple, Symbols] = {}
    for r in records:
        found = symbols[r.spec.reuse_key]
        if found is None:
            continue
        key = tuple(sorted(found.cells.items()))
        sets[key] = found
        if r.spec.tag not in tags.setdefault(key, []):
            tags[key].append(r.spec.tag)
    if not sets:
        return ""
    blocks = []
    for key, found in sets.items():
        items = "".join(f'<li><table class="swatch"><tr>{_cell(c)}</tr></table><code>{escape(c.symbol)}</code> '
                        f'{escape(c.kind.replace("-", " "))}</li>' for c in found.cells.values())
        blocks.append(f'<p>{escape(", ".join(tags[key]))}</p><ul class="legend">{items}</ul>')
    return f'<section id="legend"><h2>Map legend</h2>{"".join(blocks)}</section>'


def _messages(messages: list[dict[str, str]], previous: list[dict[str, str]]) -> str:
    """The turn's prompt; the messages it starts with in common with the
    previous turn's prompt are counted, not repeated (a page stays linear in
    the turns, not quadratic)."""
    kept = common_prefix_length([previous, messages])
    body = "".join(f'<div class="msg"><b>{escape(str(m.get("role", "?")))}</b>'
                   f'<pre>{escape(str(m.get("content", "")))}</pre></div>' for m in messages[kept:])
    shown = f"; the first {kept} as in the previous turn, the {len(messages) - kept} new ones shown" if kept else ""
    return f'<details class="prompt"><summary>prompt ({len(messages)} messages{shown})</summary>{body}</details>'



def _response(context: ContextConfig, response: str) -> str:
    """The answer as the model gave it: the answer prefix of the prompt, then what it wrote."""
    text = ContextManager(context).answer_prefix + response
    parts = split_response(text, context.enable_think)
    if parts is None:
        return f'<div class="response malformed"><b>raw answer (not in the format)</b><pre>{escape(text)}</pre></div>'
    thought, answer = parts
    think_html = f'<b>think</b><pre class="think">{escape(thought)}</pre>' if thought is not None else ""
    return f'<div class="response">{think_html}<b>answer</b><pre class="answer">{escape(answer)}</pre></div>'


def _tool_turn(context: ContextConfig, turn: Turn) -> str:
    """A tool env's answer (its thoughts, then the text with its calls) and the tool messages that
    answered each call, in order."""
    text = ContextManager(context).answer_prefix + turn.response
    end = text.rfind("</think>")
    think_html = (f'<b>think</b><pre class="think">{escape(text[:end].removeprefix("<think>"))}</pre>'
                  if end >= 0 else "")
    calls = text[end + len("</think>"):] if end >= 0 else text
    results = "".join(f'<div class="msg tool"><b>tool message {n}</b><pre>{escape(result)}</pre></div>'
                      for n, result in enumerate(turn.tool_results, 1))
    results = results or '<p class="tool-none">no tool call: the next prompt says so</p>'
    return (f'<div class="response">{think_html}<b>tool calls</b><pre class="answer">{escape(calls)}</pre></div>'
            f'<div class="tool-results">{results}</div>')


def _tools(tools: list[dict[str, Any]] | None) -> str:
    """The env's tools by name, each with its schema as a tooltip; nothing for an env without tools."""
    if not tools:
        return ""
    names = " ".join(f'<code title="{escape(json.dumps(t, ensure_ascii=False))}">'
                     f'{escape(str(t.get("function", {}).get("name")))}</code>' for t in tools)
    return f" · tools {names}"


def _list(items: list[str]) -> str:
    return " ".join(f"<code>{escape(a)}</code>" for a in items) if items else "<em>none</em>"


def _tokens(turn: Turn) -> str:
    """How many prompt tokens the turn added after the ids before it, and how many it
    sampled; nothing for a dump without token ids."""
    parts = [f"+{len(turn.prompt_ids)} prompt"] if turn.has_prompt_ids else []
    if turn.response_ids:
        parts.append(f"{len(turn.response_ids)} sampled")
    if not parts:
        return ""
    return (f' · <span class="tokens" title="prompt tokens added after the first {turn.prompt_start} of the '
            f'episode; tokens sampled">tokens {", ".join(parts)}</span>')


def _turn(r: DumpRecord, i: int, symbols: Symbols | None) -> str:
    turn = r.trajectory.turns[i]
    env = r.env_id
    steps = "".join(
        f"<tr><td>{j + 1}</td><td><code>{escape(s.action)}</code></td><td>{s.reward:.3f}</td>"
        f"<td>{'done' if s.done else ''}</td>"
        f"<td>{_state(s.observation, symbols, _where(env, i, j + 1))}</td></tr>"
        for j, s in enumerate(turn.steps))
    steps_html = (f'<table class="steps"><tr><th>#</th><th>action</th><th>reward</th><th>done</th>'
                  f"<th>state after</th></tr>{steps}</table>") if steps else ""
    messages = _messages(r.messages[i], r.messages[i - 1] if i else []) if i < len(r.messages) else ""
    info = json.dumps(turn.info, ensure_ascii=False, default=str)
    seed = f" · request seed {r.request_seeds[i]}" if i < len(r.request_seeds) else ""
    return (
        f'<li class="turn" data-turn="{i}"><h4>turn {i + 1} · reward {turn.reward:.3f} · penalty {turn.penalty:.3f}'
        f" · actions left {turn.actions_left} · policy v{turn.policy_version} · finish {escape(turn.finish_reason)}"
        f"{seed}{_tokens(turn)}</h4>"
        f'<div class="before"><b>state shown</b>'
        f"{_state(turn.observation, symbols, _where(env, i, 0))}</div>"
        f"{messages}"
        f"{_tool_turn(r.loop.context, turn) if r.spec.tools else _response(r.loop.context, turn.response)}"
        f'<p class="actions">parsed: {_list(turn.actions)} · executed: {_list(turn.executed_actions)}</p>'
        f"{steps_html}"
        f'<details class="info"><summary>info</summary><pre>{escape(info)}</pre></details></li>')


def _tail(text: str, limit: int = PROGRAM_TEXT_CHARS) -> tuple[str, str]:
    """The last ``limit`` characters of ``text``, and a note of how many were cut before them."""
    if len(text) <= limit:
        return text, f"{len(text)} characters"
    return text[-limit:], f"the last {limit} of {len(text)} characters"


def _program(program: ProgramOutput | None) -> str:
    """An agent episode's program output, each part collapsed: the info it returned beside its
    reward, the traceback where it raised, and its stdout and stderr; nothing for an env's episode."""
    if program is None:
        return ""
    parts = [("info", json.dumps(program["info"], ensure_ascii=False, indent=1, default=str)),
             ("traceback", program["traceback"]), ("stdout", program["stdout"]), ("stderr", program["stderr"])]
    shown = []
    for name, text in parts:
        if not text:
            shown.append(f'<p class="program-{name}"><b>{name}</b> <em>none</em></p>')
            continue
        kept, note = _tail(text)
        shown.append(f'<details class="program-{name}"><summary>{name} ({note})</summary>'
                     f"<pre>{escape(kept)}</pre></details>")
    return f'<div class="program"><b>program output</b>{"".join(shown)}</div>'


def _episode(r: DumpRecord, symbols: Symbols | None) -> str:
    t = r.trajectory
    failed = t.stop_reason.failed
    error = ""
    if t.error or failed:
        error = (f'<div class="error-box"><b>{escape(t.stop_reason.value)}</b>'
                 f'<pre class="error">{escape(t.error or "(no error text)")}</pre></div>')
    final = (f'<div class="final"><b>final state</b>'
             f"{_state(t.final_observation, symbols, _where(r.env_id))}</div>"
             if t.final_observation else "")
    worker = "driver" if t.worker is None else f"pid {t.worker}"
    meta = (f'<p class="meta">tag {escape(t.tag)} · env type <code>{escape(r.spec.env_type)}</code> · group '
            f"{t.group_id} · seed {t.seed} · mode {escape(r.spec.mode)} · worker {worker} · reset "
            f"{t.reset_s:.3f} s · dump line {r.line}"
            f"{_tools(r.spec.tools)}</p>")
    agent = r.spec.is_agent
    turns = "".join(agent_turn(r, i, _tools) if agent else _turn(r, i, symbols) for i in range(len(t.turns)))
    return (f'<details class="episode{" failed" if failed else ""}" id="ep-{r.env_id}" {_data(r)}>'
            f"<summary>env {r.env_id} · {escape(t.tag)} · {'success' if t.success else 'no success'} · "
            f"{escape(t.stop_reason.value)} · reward {t.reward:.3f} · {len(t.turns)} turns</summary>"
            f'{meta}{error}{_program(t.program)}<ol class="turns">{turns}</ol>{final}</details>')


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1em 2em;color:#222}
[hidden]{display:none!important}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.2em}h4{margin:.3em 0;font-weight:600}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f6f6;padding:.3em .5em;margin:.2em 0}
#episode-table{border-collapse:collapse}#episode-table td,#episode-table th{border:1px solid #ccc;padding:2px 6px}
#episode-table td.yes{color:#070;font-weight:600}
tr.failed td,.episode.failed>summary{background:#fde2e2}
.error,.error-box pre{color:#a00;background:#fff0f0}.error-box{border-left:4px solid #c00;padding-left:.5em}
.msg.tool,.msg.role-tool{border-left:4px solid #2a6;padding-left:.5em}
.segment-start{margin:.2em 0;padding:.1em .5em;background:#eef3ff}.segment-start.prefix-break{background:#fff1cc}
ul.tool-calls{margin:.2em 0;padding-left:1.2em}code.ids{display:block;font-size:.8em;word-break:break-all}
code.ids.trained,pre.trained{background:#eefbe9}.reward{font-weight:700}
.program{border-left:4px solid #68a;padding-left:.5em}.program>b{display:block;font-size:.85em;color:#555}
.program pre{max-height:30em;overflow:auto}.program p{margin:.2em 0}
.episode{border:1px solid #ccc;margin:.4em 0;padding:.2em .6em}.episode>summary{cursor:pointer;font-weight:600}
.turns{padding-left:1.5em}.turn{margin:.6em 0;border-top:1px solid #eee}
.response b,.before b,.final b{display:block;font-size:.85em;color:#555}
pre.think{background:#eef3ff}pre.answer{background:#eefbe9}.malformed pre{background:#fff6dc}
table.steps{border-collapse:collapse}
table.steps td,table.steps th{border:1px solid #ddd;padding:2px 6px;vertical-align:top}
.state{display:flex;gap:1em;align-items:flex-start}
table.grid,table.swatch{border-collapse:collapse;margin:.2em 0}
:is(table.grid,table.swatch) td{width:18px;height:18px;padding:0;border:1px solid #fff;position:relative;background:#dde6cf}
:is(table.grid,table.swatch) td.t-wall{background:#555}:is(table.grid,table.swatch) td.t-target{background:#f3d6a0}
:is(table.grid,table.swatch) td.t-hole{background:#1f3b73}:is(table.grid,table.swatch) td.t-goal{background:#e9c22d}
:is(table.grid,table.swatch) td.t-floor[data-cell=empty]{background:#dde6cf}
:is(table.grid,table.swatch) td.b::after{content:"";position:absolute;inset:3px;background:#9a5b1e;border-radius:2px}
:is(table.grid,table.swatch) td.p::before{content:"";position:absolute;inset:4px;background:#d22;border-radius:50%;z-index:1}
ul.legend{list-style:none;padding:0;display:flex;flex-wrap:wrap;gap:.3em 1.2em}
ul.legend li{display:flex;align-items:center;gap:.4em}p.note{max-width:60em;color:#444;font-size:.9em}
svg.curve{margin-right:1em;font-size:11px}svg.curve .axis{stroke:#888}
svg.curve .line{fill:none;stroke:#2563eb;stroke-width:2}svg.curve circle{fill:#2563eb}
svg.curve .title{font-weight:600;font-size:12px}
"""

_JS = """
(function () {
  var selects = document.querySelectorAll("select[data-filter]");
  var items = document.querySelectorAll("[data-episode]");
  var rows = document.querySelectorAll("tr[data-episode]");
  function apply() {
    var want = {};
    selects.forEach(function (s) { want[s.dataset.filter] = s.value; });
    items.forEach(function (el) {
      var show = (!want.tag || el.dataset.tag === want.tag) &&
        (!want.success || el.dataset.success === want.success) &&
        (!want.stop || el.dataset.stop === want.stop);
      el.hidden = !show;
    });
    var shown = 0;
    rows.forEach(function (r) { if (!r.hidden) shown++; });
    document.getElementById("shown").textContent = shown + " of " + rows.length + " shown";
  }
  function fromHash() {
    var h = decodeURIComponent(location.hash.replace(/^#/, ""));
    if (h.indexOf("=") < 0) {  // #ep-3: open that episode
      var ep = h && document.getElementById(h);
      if (ep && ep.tagName === "DETAILS") ep.open = true;
      return;
    }
    var params = new URLSearchParams(h);
    selects.forEach(function (s) {
      var v = params.get(s.dataset.filter) || "";
      var known = Array.prototype.some.call(s.options, function (o) { return o.value === v; });
      s.value = known ? v : "";
    });
    apply();
  }
  selects.forEach(function (s) {
    s.addEventListener("change", function () {
      var params = new URLSearchParams();
      selects.forEach(function (t) { if (t.value) params.set(t.dataset.filter, t.value); });
      history.replaceState(null, "", "#" + params.toString());
      apply();
    });
  });
  window.addEventListener("hashchange", fromHash);
  fromHash();
  apply();
  document.body.setAttribute("data-ready", "1");
})();
"""

"""Rollout dumps: every trajectory of a rollout written down, one JSON line each.

A dump holds what a person needs to understand an episode and what
``ragen.tools.replay`` needs to play it again: the env's spec (tag, type, config,
seed, group), the turn loop's settings (prompt format, sampling), and per turn
the prompt messages, the raw answer, the actions parsed and executed (a tool
env's: its calls, the tool messages that answered them, and the calls as a
server parsed them), each
``env.step``'s observation, reward and done flag, the env's info, the policy
version and the request's sampling seed, and the tokens as the engine saw and
sampled them (``Turn.prompt_ids`` and ``prompt_start``: only the prompt's ids
added since the previous turn, so a dump stays linear in turns;
``response_ids`` and ``logprobs``); then the stop reason, error text, timings
and the worker that ran it; an agent episode's program output
(``Trajectory.program``: its info, traceback, stdout and stderr; absent for an
env's episode). An agent episode's turn is one call of its program
(``ragen.rollout.agent_call``): its prompt is the call's messages as sent, its
observation the messages it added (JSON), its info where it stands in the
session, its segment's tools and the answer's content; a turn that is not one
is refused as a field of the wrong type is.

- ``write_dump(directory, name, result, loop, split=, step=)``: the driver
  writes one file after a rollout (never the workers): ``<name>.jsonl``, or
  ``<name>.jsonl.gz`` when it is large.
- ``read_dump(path) -> list[DumpRecord]``: every line checked; a missing,
  truncated or foreign file, a field of the wrong type (each field against
  its dataclass's annotation), token ids that do not follow on from the
  turn before, JSON nested too deeply or an env id twice raises ``DumpError``
  naming the file and line. Versions 1 and 2 read back with no prompt ids.
- ``DumpRecord``: one line as typed records (``EnvSpec``, ``LoopConfig``,
  ``Trajectory``), plus the prompts and request seeds.
- ``TurnPrompt``: one turn's prompt messages, read as a list; held as the
  messages it keeps from the turn before and its own new ones, as the file
  writes them, so that a record's memory stays linear in its turns.

``dump_name(split, step)``: the trainer's file names, ``step_000012`` for the
training rollout of step 12 and ``val_step_000012`` for the validation after it.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Callable

from ragen.errors import RagenError
from ragen.llm.types import SamplingParams, request_seed
from ragen.rollout.agent_call import AgentCall, call_messages
from ragen.rollout.context import ContextConfig, ContextManager
from ragen.rollout.json_types import BadField, check_fields, is_a, short
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.types import EnvSpec, RolloutResult, Step, StopReason, Trajectory, Turn
from ragen.utils import common_prefix_length

FORMAT = "ragen.rollout_dump"
# 2: RAGEN's prompts: a turn's response is the text after the answer prefix, a spec has state_legend
# and action_names, and its format_example is (observation, answer)
# 3: a turn's prompt ids as the engine saw them (prompt_ids, prompt_start)
VERSION = 3
COMPRESS_ABOVE_BYTES = 4 << 20  # a dump larger than this is written gzipped


class DumpError(RagenError, ValueError):
    """A file that is not a readable ragen rollout dump; the message names the file and line."""


class TurnPrompt(Sequence):
    """One turn's prompt messages: the first ``kept`` of the turn before's prompt, then
    this turn's ``new`` ones. It reads as the list of its messages (index, slice,
    iterate, ``==`` a list); a turn's whole list is built only while it is read, so the
    prompts of an episode take memory linear in its turns, not in their square."""

    __slots__ = ("_before", "_kept", "_new", "_len")

    def __init__(self, before: TurnPrompt | None, kept: int, new: Sequence[dict[str, str]]) -> None:
        if not 0 <= kept <= (len(before) if before is not None else 0):
            raise ValueError(f"prompt.from_previous={kept} but the previous prompt has "
                             f"{len(before) if before is not None else 0} messages")
        self._before, self._kept, self._new = before, kept, tuple(new)
        self._len = kept + len(self._new)

    @property
    def new(self) -> tuple[dict[str, str], ...]:
        """The messages this turn adds after the ones it keeps."""
        return self._new

    @property
    def kept(self) -> int:
        return self._kept

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, k):
        if isinstance(k, slice):
            return self.as_list()[k]
        if k < 0:
            k += self._len
        if not 0 <= k < self._len:
            raise IndexError("prompt message index out of range")
        node = self
        while k < node._kept:  # a kept message: the turn before holds it at the same place
            node = node._before
        return node._new[k - node._kept]

    def as_list(self) -> list[dict[str, str]]:
        """The turn's messages as a new list (a walk back over the turns it keeps from)."""
        pieces, need, node = [], self._len, self
        while need > 0:
            pieces.append(node._new[:need - node._kept] if need > node._kept else ())
            need, node = min(need, node._kept), node._before
        return [m for piece in reversed(pieces) for m in piece]

    def __iter__(self):
        return iter(self.as_list())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TurnPrompt, list, tuple)):
            return len(self) == len(other) and self.as_list() == list(other)
        return NotImplemented

    __hash__ = None  # a list, by value

    def __repr__(self) -> str:
        return repr(self.as_list())


@dataclass(frozen=True)
class DumpRecord:
    """One trajectory of a dump, typed."""

    split: str  # "train" or "val" (the benchmark's split too)
    step: int  # the training step, or the benchmark's rollout index
    spec: EnvSpec
    loop: LoopConfig
    trajectory: Trajectory
    messages: list[Sequence[dict[str, str]]]  # per turn: the prompt as sent (read_dump: a TurnPrompt each)
    request_seeds: list[int]  # per turn: the seed the engine's sampler got
    line: int  # where it is in its file (1-based)

    @property
    def env_id(self) -> int:
        return self.spec.env_id


def dump_name(split: str, step: int) -> str:
    return f"step_{step:06d}" if split == "train" else f"{split}_step_{step:06d}"


# ----------------------------------------------------------------------------- writing


def write_dump(directory: str | os.PathLike, name: str, result: RolloutResult, loop: LoopConfig,
               split: str, step: int) -> Path:
    """Write ``result`` to ``directory/<name>.jsonl`` (``.jsonl.gz`` when over
    ``COMPRESS_ABOVE_BYTES``); return the path written. Atomic: a reader never
    sees half a file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ctx = ContextManager(loop.context)
    loop_row = _loop_row(loop)
    # no spaces after separators: token ids are most of a line, and a space is a third of a short id's bytes
    lines = [json.dumps(_record_row(t, s, ctx, loop, loop_row, split, step), ensure_ascii=False, default=str,
                        separators=(",", ":"))
             for t, s in zip(result.trajectories, result.specs)]
    data = ("\n".join(lines) + "\n").encode()
    path = directory / f"{name}.jsonl"
    if len(data) > COMPRESS_ABOVE_BYTES:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data, compresslevel=1)  # fast: the dump is written between rollouts
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def _loop_row(loop: LoopConfig) -> dict[str, Any]:
    row = {f.name: getattr(loop, f.name) for f in dataclasses.fields(loop)}
    row["context"] = dataclasses.asdict(loop.context)
    row["sampling"] = loop.sampling.to_dict()
    return row


def _record_row(traj: Trajectory, spec: EnvSpec, ctx: ContextManager, loop: LoopConfig, loop_row: dict,
                split: str, step: int) -> dict[str, Any]:
    turns, previous = [], []
    # an agent episode's prompts are its calls' messages as sent; an env's, the context manager's
    sent = call_messages([AgentCall.of_turn(t, f"turns[{i}]") for i, t in enumerate(traj.turns)]) \
        if spec.is_agent else None
    for i, turn in enumerate(traj.turns):
        row = dict(turn.__dict__)
        row["steps"] = [s.__dict__ for s in turn.steps]
        messages = next(sent)[0] if sent is not None else \
            ctx.build_messages(spec, traj.turns[:i], turn.observation, turn.actions_left)
        # a turn's prompt is mostly the previous one: only the messages after the common start are written
        kept = common_prefix_length([previous, messages])
        row["prompt"] = {"from_previous": kept, "messages": messages[kept:]}
        previous = messages
        row["request_seed"] = request_seed(loop.sampling.seed, (spec.seed, spec.env_id, i))
        turns.append(row)
    row = {"format": FORMAT, "version": VERSION, "split": split, "step": step}
    row.update({f.name: getattr(traj, f.name) for f in dataclasses.fields(traj)})
    if traj.program is None:  # an env's episode: its line as before agent programs
        del row["program"]
    row.update(turns=turns, stop_reason=traj.stop_reason.value, reward=traj.reward, num_actions=traj.num_actions,
               spec={k: v for k, v in spec.__dict__.items() if k != "resume"}, loop=loop_row)
    # shallow: a spec holds plain data, and asdict's deep copy is the largest cost of a dump; a carried
    # episode's trajectory so far is the record's own turns
    return row


# ----------------------------------------------------------------------------- reading

_REQUIRED = ("split", "step", "env_id", "group_id", "tag", "seed", "turns", "stop_reason", "spec", "loop")


def read_dump(path: str | os.PathLike) -> list[DumpRecord]:
    """Every trajectory of the dump at ``path`` (``.jsonl`` or ``.jsonl.gz``)."""
    path = Path(path)
    if not path.is_file():
        hint = " (a folder: give one of its .jsonl files)" if path.is_dir() else ""
        raise DumpError(f"{path}: no such file{hint}")
    try:
        raw = path.read_bytes()
        text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8")
    except (EOFError, OSError, zlib.error) as exc:
        raise DumpError(f"{path}: cannot be read as a gzip file, truncated? ({exc})") from None
    except UnicodeDecodeError as exc:
        raise DumpError(f"{path}: not a text file ({exc.reason} at byte {exc.start}); "
                        "a rollout dump is JSON lines") from None
    lines = text.split("\n")
    cut = bool(lines[-1])  # the last line has no newline: the file was cut off while written
    if not cut:
        lines.pop()
    records: list[DumpRecord] = []
    first_line: dict[int, int] = {}  # env_id -> the line it is on
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            why = "the file is truncated (its last line is cut off)" if cut and number == len(lines) else \
                f"not JSON ({exc.msg} at column {exc.colno})"
            raise DumpError(f"{where}: {why}") from None
        except RecursionError:  # the JSON decoder's own depth guard: nothing a dump writes nests that deep
            raise DumpError(f"{where}: JSON nested too deeply to be a rollout dump") from None
        record = _record(row, where, number)
        if record.env_id in first_line:
            raise DumpError(f"{where}: env_id {record.env_id} again (first at line {first_line[record.env_id]}); "
                            "a dump holds one rollout, each env once")
        first_line[record.env_id] = number
        records.append(record)
    if not records:
        raise DumpError(f"{path}: empty: no trajectories in it")
    return records


def _record(row: Any, where: str, number: int) -> DumpRecord:
    _check_header(row, where)
    try:
        spec, loop = _spec_and_loop(row)
        # version 1 wrote whole answers; a response is now what follows the answer prefix
        prefix = ContextManager(loop.context).answer_prefix if row["version"] < 2 else ""

        def answer(text: Any) -> Any:
            return text[len(prefix):] if prefix and isinstance(text, str) and text.startswith(prefix) else text

        turns, messages, seeds = _read_turns(row["turns"], answer)
        traj_fields = {f.name for f in dataclasses.fields(Trajectory)}
        traj = Trajectory(**{**{k: v for k, v in row.items() if k in traj_fields},
                             "turns": turns, "stop_reason": StopReason(row["stop_reason"]),
                             "failed_response": answer(row.get("failed_response"))})
        _check_types(spec, loop, traj, messages)
        for name, value in (("split", row["split"]), ("step", row["step"])):
            if not is_a(value, str if name == "split" else int):
                raise BadField(f"{name}: expected {'str' if name == 'split' else 'int'}, got {short(value)}")
        if traj.env_id != spec.env_id:
            raise BadField(f"env_id {traj.env_id} but spec.env_id {spec.env_id}")
    except BadField as exc:
        raise DumpError(f"{where}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise DumpError(f"{where}: a field is missing or malformed ({type(exc).__name__}: {exc})") from None
    return DumpRecord(split=row["split"], step=row["step"], spec=spec, loop=loop, trajectory=traj,
                      messages=messages, request_seeds=seeds, line=number)


def _check_header(row: Any, where: str) -> None:
    """DumpError unless ``row`` is a ragen dump line of a version this code reads, with every field it needs."""
    if not isinstance(row, dict) or row.get("format") != FORMAT:
        raise DumpError(f"{where}: not a ragen rollout dump (no \"format\": \"{FORMAT}\"); dumps are written by "
                        "train.py with trainer.rollout_data_dir, or by test_parallel_rollout.py with "
                        "benchmark.dump_dir")
    if not isinstance(row.get("version"), int) or row["version"] > VERSION:
        raise DumpError(f"{where}: dump format version {row.get('version')!r}; this ragen reads versions up to "
                        f"{VERSION}")
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        raise DumpError(f"{where}: missing field(s) {missing}")


def _spec_and_loop(row: dict) -> tuple[EnvSpec, LoopConfig]:
    """The line's ``EnvSpec`` and ``LoopConfig``, as the earlier dump versions wrote them too."""
    spec_row = dict(row["spec"])
    if spec_row.get("format_example") is not None:
        obs, answer = spec_row["format_example"][:2]  # version 1 added the action names it showed
        spec_row["format_example"] = (obs, answer)
    if spec_row.get("action_names") is not None:
        spec_row["action_names"] = tuple(spec_row["action_names"])
    spec = EnvSpec(**spec_row)
    loop_row = dict(row["loop"])
    loop_row.pop("pipeline_depth", None)  # how a worker scheduled its envs (dump format 1): not what they played
    loop = LoopConfig(**{**loop_row, "context": ContextConfig(**loop_row["context"]),
                         "sampling": SamplingParams.from_dict(loop_row["sampling"])})
    return spec, loop


def _read_turns(rows: list, answer: Callable[[Any], Any]) -> tuple[list[Turn], list[TurnPrompt], list[int]]:
    """The turns of a line, each turn's prompt and each request's seed; ``answer`` reads a response."""
    turns, messages, seeds = [], [], []
    turn_fields = {f.name for f in dataclasses.fields(Turn)}
    previous: TurnPrompt | None = None
    episode_length = 0  # len(episode_ids(turns)), kept as the turns are read
    for t in rows:
        for name, value in (("prompt.from_previous", t["prompt"]["from_previous"]),
                            ("request_seed", t["request_seed"])):
            if not is_a(value, int):
                raise BadField(f"turns[{len(turns)}].{name}: expected int, got {short(value)}")
        try:
            previous = TurnPrompt(previous, t["prompt"]["from_previous"], list(t["prompt"]["messages"]))
        except ValueError as exc:
            raise ValueError(f"turn {len(turns)}: {exc}") from None
        messages.append(previous)
        seeds.append(t["request_seed"])
        ids = _token_fields(t, len(turns), episode_length)
        start, prompt_ids, response_ids = ids["prompt_start"], ids["prompt_ids"], ids["response_ids"]
        episode_length = min(start, episode_length) + len(prompt_ids) + len(response_ids)
        # JSON's lists as the turn's tuples (anything else is left for the type check to name)
        tools = {k: tuple(v) if isinstance(v, list) else v
                 for k, v in (("tool_results", t.get("tool_results", [])), ("tool_calls", t.get("tool_calls")))}
        turns.append(Turn(**{**{k: v for k, v in t.items() if k in turn_fields}, **tools,
                             "response": answer(t.get("response")),
                             "steps": tuple(Step(**s) for s in t["steps"]), **ids}))
    return turns, messages, seeds


def _check_types(spec: EnvSpec, loop: LoopConfig, traj: Trajectory, messages: list[TurnPrompt]) -> None:
    """``BadField`` naming the first field whose value is not of its annotation's type, or a prompt message
    that is not a role and a content."""
    check_fields(spec, "spec")
    check_fields(loop, "loop")
    check_fields(loop.context, "loop.context")
    check_fields(loop.sampling, "loop.sampling")
    check_fields(traj, "")
    for i, turn in enumerate(traj.turns):
        check_fields(turn, f"turns[{i}]")
        if spec.is_agent:
            try:
                AgentCall.of_turn(turn, f"turns[{i}]")
            except ValueError as exc:
                raise BadField(str(exc)) from None
        for j, step in enumerate(turn.steps):
            check_fields(step, f"turns[{i}].steps[{j}]")
        for m, message in enumerate(messages[i].new, messages[i].kept):  # the kept ones: checked before
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise BadField(f"turns[{i}].prompt.messages: message {m} is {short(message)}; expected "
                                '{"role": str, "content": str}')


def _token_fields(t: dict, i: int, episode_length: int) -> dict[str, Any]:
    """Turn ``i``'s ``prompt_ids``, ``prompt_start``, ``response_ids`` and ``logprobs``
    as ``Turn`` holds them (absent, as before version 3: no prompt ids); raise
    ``BadField`` naming the one of the wrong type, or a start past the ids of the
    turns before (``episode_length`` of them)."""
    out: dict[str, Any] = {}
    for name, hint, kind in (("prompt_ids", list[int], "a list of int"), ("response_ids", list[int], "a list of int"),
                             ("logprobs", list[float] | None, "a list of float or null")):
        value = t.get(name, [] if name != "logprobs" else None)
        if not is_a(value, hint):
            raise BadField(f"turns[{i}].{name}: expected {kind}, got {short(value)}")
        out[name] = None if value is None else tuple(value)
    start = t.get("prompt_start", 0)
    if not is_a(start, int):
        raise BadField(f"turns[{i}].prompt_start: expected int, got {short(start)}")
    if not 0 <= start <= episode_length:
        raise BadField(f"turns[{i}].prompt_start: {start}, but the turns before it hold {episode_length} token ids")
    out["prompt_start"] = start
    return out

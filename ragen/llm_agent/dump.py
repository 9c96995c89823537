"""Rollout dumps: every trajectory of a rollout written down, one JSON line each.

A dump holds what a person needs to understand an episode and what
``ragen.replay`` needs to play it again: the env's spec (tag, type, config,
seed, group), the turn loop's settings (prompt format, sampling), and per turn
the prompt messages, the raw answer, the actions parsed and executed, each
``env.step``'s observation, reward and done flag, the env's info, the policy
version and the request's sampling seed; then the stop reason, error text,
timings and the worker that ran it.

- ``write_dump(directory, name, result, loop, split=, step=)``: the driver
  writes one file after a rollout (never the workers): ``<name>.jsonl``, or
  ``<name>.jsonl.gz`` when it is large.
- ``read_dump(path) -> list[DumpRecord]``: every line checked; a missing,
  truncated or foreign file raises ``DumpError`` naming the file and line.
- ``DumpRecord``: one line as typed records (``EnvSpec``, ``LoopConfig``,
  ``Trajectory``), plus the prompts and request seeds.

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
from typing import Any

from ragen.llm.types import SamplingParams, request_seed
from ragen.llm_agent.ctx_manager import ContextConfig, ContextManager
from ragen.llm_agent.rollout_loop import LoopConfig
from ragen.llm_agent.types import EnvSpec, RolloutResult, Step, StopReason, Trajectory, Turn
from ragen.utils import common_prefix_length

FORMAT = "ragen.rollout_dump"
VERSION = 1
COMPRESS_ABOVE_BYTES = 4 << 20  # a dump larger than this is written gzipped


class DumpError(ValueError):
    """A file that is not a readable ragen rollout dump; the message names the file and line."""


@dataclass(frozen=True)
class DumpRecord:
    """One trajectory of a dump, typed."""

    split: str  # "train" or "val" (the benchmark's split too)
    step: int  # the training step, or the benchmark's rollout index
    spec: EnvSpec
    loop: LoopConfig
    trajectory: Trajectory
    messages: list[list[dict[str, str]]]  # per turn: the prompt as sent
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
    lines = [json.dumps(_record_row(t, s, ctx, loop, loop_row, split, step), ensure_ascii=False, default=str)
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
    for i, turn in enumerate(traj.turns):
        row = dict(turn.__dict__)
        row["steps"] = [s.__dict__ for s in turn.steps]
        messages = ctx.build_messages(spec, traj.turns[:i], turn.observation, turn.actions_left, traj.action_names)
        # a turn's prompt is mostly the previous one: only the messages after the common start are written
        kept = common_prefix_length([previous, messages])
        row["prompt"] = {"from_previous": kept, "messages": messages[kept:]}
        previous = messages
        row["request_seed"] = request_seed(loop.sampling.seed, (spec.seed, spec.env_id, i))
        turns.append(row)
    row = {"format": FORMAT, "version": VERSION, "split": split, "step": step}
    row.update({f.name: getattr(traj, f.name) for f in dataclasses.fields(traj)})
    row.update(turns=turns, stop_reason=traj.stop_reason.value, reward=traj.reward, num_actions=traj.num_actions,
               spec=dict(spec.__dict__), loop=loop_row)  # shallow: a spec holds plain data (asdict's deep copy
    # was a third of the dump's time)
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
    records = []
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
        records.append(_record(row, where, number))
    if not records:
        raise DumpError(f"{path}: empty: no trajectories in it")
    return records


def _record(row: Any, where: str, number: int) -> DumpRecord:
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
    try:
        spec_row = dict(row["spec"])
        if spec_row.get("format_example") is not None:
            obs, answer, names = spec_row["format_example"]
            spec_row["format_example"] = (obs, answer, tuple(names) if names is not None else None)
        spec = EnvSpec(**spec_row)
        loop_row = dict(row["loop"])
        loop = LoopConfig(**{**loop_row, "context": ContextConfig(**loop_row["context"]),
                             "sampling": SamplingParams.from_dict(loop_row["sampling"])})
        turns, messages, seeds = [], [], []
        turn_fields = {f.name for f in dataclasses.fields(Turn)}
        previous: list = []
        for t in row["turns"]:
            kept = int(t["prompt"]["from_previous"])
            if not 0 <= kept <= len(previous):
                raise ValueError(f"turn {len(turns)}: prompt.from_previous={kept} but the previous prompt has "
                                 f"{len(previous)} messages")
            previous = previous[:kept] + list(t["prompt"]["messages"])
            messages.append(previous)
            seeds.append(int(t["request_seed"]))
            logprobs = t.get("logprobs")
            turns.append(Turn(**{**{k: v for k, v in t.items() if k in turn_fields},
                                 "steps": tuple(Step(**s) for s in t["steps"]),
                                 "response_ids": tuple(t.get("response_ids") or ()),
                                 "logprobs": None if logprobs is None else tuple(logprobs)}))
        traj_fields = {f.name for f in dataclasses.fields(Trajectory)}
        traj = Trajectory(**{**{k: v for k, v in row.items() if k in traj_fields},
                             "turns": turns, "stop_reason": StopReason(row["stop_reason"])})
    except (TypeError, ValueError, KeyError) as exc:
        raise DumpError(f"{where}: a field is missing or malformed ({type(exc).__name__}: {exc})") from None
    return DumpRecord(split=str(row["split"]), step=int(row["step"]), spec=spec, loop=loop, trajectory=traj,
                      messages=messages, request_seeds=seeds, line=number)

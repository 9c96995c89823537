"""Rollout dumps (ragen.rollout.dump): what is written is what was played,
read back exactly; bad files are refused with the file and line."""

from __future__ import annotations

import dataclasses
import gzip
import json
import tracemalloc

import pytest

from ragen.agents.result import ProgramResult
from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import request_seed
from ragen.rollout import dump as dump_module
from ragen.rollout.dump import DumpError, dump_name, read_dump, write_dump
from ragen.serving import DirectClient, SharedLLMInferenceManager
from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings
from ragen.rollout.batching import Lockstep
from ragen.rollout.scheduler import KeptEnvs, run_envs
from ragen.rollout.types import RolloutResult, StopReason, episode_ids

from tests.dump_cases import BAD_DUMPS, write_as_version_2, write_bad_dump
from tests.rollout_helpers import custom_envs, fault_tag, loop_config, sequential, specs_for


class _Recording(ScriptedEngine):
    """A scripted engine that keeps every request it answered."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.requests = []

    def generate(self, requests, sampling):
        self.requests += list(requests)
        return super().generate(requests, sampling)


@pytest.fixture(scope="module")
def played():
    layout = (["SimpleSokoban", "FrozenLake", "Broken"], [2, 2, 1], 2)
    seed = specs_for(*layout, custom_envs(Broken=fault_tag()))[-1].seed
    specs = specs_for(*layout, custom_envs(Broken=fault_tag("raise_step", fault_seed=seed)))
    config = loop_config(max_turn=4)
    engine = _Recording(malformed_rate=0.2)
    trajectories, _ = run_envs(specs, DirectClient(engine), config, kept_envs=KeptEnvs())
    return RolloutResult(trajectories, specs), config, engine


def test_a_dump_reads_back_as_the_rollout_that_was_played(played, tmp_path):
    result, config, engine = played
    path = write_dump(tmp_path, dump_name("train", 12), result, config, split="train", step=12)
    assert path.name == "step_000012.jsonl"
    records = read_dump(path)
    assert [r.trajectory for r in records] == result.trajectories
    assert [r.spec for r in records] == result.specs
    assert all(r.loop == config and r.split == "train" and r.step == 12 for r in records)
    # how each answer was sampled (left out of a turn's equality): token ids and log-probs, exactly
    assert [[(t.response_ids, t.logprobs) for t in r.trajectory.turns] for r in records] == \
        [[(t.response_ids, t.logprobs) for t in tr.turns] for tr in result.trajectories]
    # every turn's prompt is the one the engine was sent, and its seed the one the engine drew from
    sent = {(q.env_id, q.turn): q for q in engine.requests}
    for r in records:
        for i, messages in enumerate(r.messages):
            request = sent[(r.env_id, i)]
            assert messages == request.messages and request.messages == messages
            # it reads as the list it is: its items, from either end, its slices
            assert list(messages) == request.messages and len(messages) == len(request.messages)
            assert messages[-1] == request.messages[-1] and messages[1:] == request.messages[1:]
            assert r.request_seeds[i] == request_seed(config.sampling.seed, request.key)
    # each env step is written: its observation, reward and done flag
    turns = [t for r in records for t in r.trajectory.turns]
    assert sum(len(t.steps) for t in turns) == sum(len(t.executed_actions) for t in turns) > 0
    assert all(sum(s.reward for s in t.steps) == pytest.approx(t.reward) for t in turns)
    # the failing env is there too, with its error text
    broken = [r.trajectory for r in records if r.trajectory.tag == "Broken"]
    assert broken and all(t.stop_reason == StopReason.ERROR and "RuntimeError" in t.error for t in broken)


@pytest.mark.timeout(120)
def test_a_records_memory_is_linear_in_its_turns(played, tmp_path):
    """Each turn's prompt keeps the turn before's messages and adds its own, as the file
    writes it: twice the turns is twice the file, and must be about twice the memory
    read, not four times (each turn's whole message list held)."""
    result, config, _ = played
    path = write_dump(tmp_path, "d", result, config, split="train", step=0)
    row = next(json.loads(x) for x in path.read_text().splitlines() if json.loads(x)["turns"])
    held = {}
    for n in (500, 1000):
        turn = row["turns"][0]
        added = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}] * 4
        turns = [turn] + [{**turn, "prompt_ids": [], "response_ids": [], "logprobs": None, "prompt_start": 0,
                           "prompt": {"from_previous": len(turn["prompt"]["messages"]) + 8 * (i - 1),
                                      "messages": added}}
                          for i in range(1, n)]
        long = tmp_path / f"long{n}.jsonl"
        long.write_text(json.dumps({**row, "turns": turns}) + "\n")
        tracemalloc.start()
        try:
            (record,) = read_dump(long)
            held[n] = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert len(record.messages) == n and len(record.messages[-1]) == len(turn["prompt"]["messages"]) + 8 * (n - 1)
        assert record.messages[-1][-8:] == added and record.messages[-1][0] == turn["prompt"]["messages"][0]
        del record
    assert held[1000] < 2.5 * held[500], {k: f"{v / 2**20:.1f} MiB" for k, v in held.items()}


def test_a_large_dump_is_gzipped_and_reads_back(played, tmp_path, monkeypatch):
    result, config, _ = played
    monkeypatch.setattr(dump_module, "COMPRESS_ABOVE_BYTES", 1000)
    path = write_dump(tmp_path, dump_name("val", 3), result, config, split="val", step=3)
    assert path.name == "val_step_000003.jsonl.gz"
    assert [r.trajectory for r in read_dump(path)] == result.trajectories
    assert not list(tmp_path.glob(".*tmp"))  # written atomically: no temporary left


def test_a_version_1_dump_reads_back_in_todays_terms(played, tmp_path):
    """Version 1 wrote whole answers (their own <think>), examples with action names, and no
    state_legend or action_names in a spec: it reads back as the same rollout."""
    result, config, _ = played
    rows = [json.loads(line) for line in _lines(played, tmp_path)]
    for row in rows:
        row["version"] = 1
        for key in ("state_legend", "action_names"):
            row["spec"].pop(key)
        row["spec"]["format_example"] = ["state", "<answer>Up</answer>", ["Up"]]
        for turn in row["turns"]:
            turn["response"] = "<think>" + turn["response"]
    old = tmp_path / "v1.jsonl"
    old.write_text("".join(json.dumps(row) + "\n" for row in rows))
    records = read_dump(old)
    assert [r.trajectory for r in records] == result.trajectories
    assert all(r.spec.format_example == ("state", "<answer>Up</answer>") for r in records)


def test_token_ids_read_back_as_the_engine_saw_and_sampled_them(tmp_path):
    """A turn's prompt ids are written as the ids added since the turn before; read back,
    every episode's ids are the engine's, token for token."""
    specs = specs_for(["SimpleSokoban", "FrozenLake"], [2, 1], 2, custom_envs())
    config = loop_config(max_turn=4)
    trajectories = sequential(specs, config)
    assert max(len(t.turns) for t in trajectories) >= 3
    assert all(turn.prompt_ids and turn.response_ids for t in trajectories for turn in t.turns)
    path = write_dump(tmp_path, "d", RolloutResult(trajectories, specs), config, split="train", step=0)
    records = read_dump(path)
    for r, t in zip(records, trajectories):
        for k in range(1, len(t.turns) + 1):
            assert episode_ids(r.trajectory.turns[:k]) == episode_ids(t.turns[:k])
        assert [(u.prompt_start, u.prompt_ids, u.response_ids, u.logprobs) for u in r.trajectory.turns] == \
            [(u.prompt_start, u.prompt_ids, u.response_ids, u.logprobs) for u in t.turns]
    # linear in turns: a later turn writes only what its prompt added, never the episode so far
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row, t in zip(rows, trajectories):
        for i, turn in enumerate(row["turns"][1:], 1):
            assert turn["prompt_start"] == len(episode_ids(t.turns[:i]))
            assert len(turn["prompt_ids"]) < len(episode_ids(t.turns[:i]))


def test_a_version_2_dump_reads_back_with_no_prompt_ids(played, tmp_path):
    result, config, _ = played
    records = read_dump(write_as_version_2(_lines(played, tmp_path), tmp_path / "v2.jsonl"))
    assert [r.trajectory for r in records] == result.trajectories
    turns = [(u, t) for r, tr in zip(records, result.trajectories) for u, t in zip(r.trajectory.turns, tr.turns)]
    assert all(u.prompt_ids == () and u.prompt_start == 0 and not u.has_prompt_ids for u, _ in turns)
    assert all((u.response_ids, u.logprobs) == (t.response_ids, t.logprobs) for u, t in turns)


def _lines(played, tmp_path) -> list[str]:
    result, config, _ = played
    return write_dump(tmp_path, "d", result, config, split="train", step=1).read_text().splitlines(keepends=True)


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file"),
    ("empty", "empty: no trajectories"),
    ("cut", "line 3: the file is truncated"),
    ("garbage", "line 2: not JSON"),
    ("foreign", "line 1: not a ragen rollout dump"),
    ("newer", "line 1: dump format version 99"),
    ("field", "line 2: missing field(s) ['turns']"),
    ("gzip_cut", "cannot be read as a gzip file"),
])
def test_a_bad_file_is_refused_naming_file_and_line(played, tmp_path, case, message):
    lines = _lines(played, tmp_path)
    bad = tmp_path / "bad.jsonl"
    if case == "empty":
        bad.write_text("")
    elif case == "cut":
        bad.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    elif case == "garbage":
        bad.write_text(lines[0] + "{oops\n")
    elif case == "foreign":
        bad.write_text('{"a": 1}\n')
    elif case == "newer":
        bad.write_text(json.dumps({**json.loads(lines[0]), "version": 99}) + "\n")
    elif case == "field":
        row = json.loads(lines[1])
        del row["turns"]
        bad.write_text(lines[0] + json.dumps(row) + "\n")
    elif case == "gzip_cut":
        data = gzip.compress("".join(lines).encode())
        bad = tmp_path / "bad.jsonl.gz"
        bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(DumpError) as err:
        read_dump(bad)
    assert str(bad) in str(err.value) and message in str(err.value)


@pytest.mark.parametrize("case", sorted(BAD_DUMPS))
def test_a_wrong_typed_deep_or_repeated_field_is_refused_naming_file_line_and_field(played, tmp_path, case):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(_lines(played, tmp_path)))
    bad, message = write_bad_dump(good, case, tmp_path / "bad.jsonl")
    with pytest.raises(DumpError) as err:
        read_dump(bad)
    assert str(err.value).startswith(f"{bad} ") and message in str(err.value), str(err.value)


@pytest.mark.timeout(300)
def test_sequential_and_parallel_dumps_are_identical_apart_from_timings_and_workers(tmp_path):
    specs = specs_for(["SimpleSokoban", "FrozenLake"], [3, 3], 2, custom_envs())
    config = loop_config(max_turn=4)
    engine = ScriptedEngine(malformed_rate=0.1)
    trajectories, _ = run_envs(specs, DirectClient(engine), config, kept_envs=KeptEnvs(), batching=Lockstep(depth=2))
    seq = write_dump(tmp_path / "seq", "d", RolloutResult(trajectories, specs), config, split="train", step=0)
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.005) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="loky")) as prm:
        result = prm.rollout(specs, config)
    assert {t.worker for t in result.trajectories} - {None}  # parallel: the worker that ran each env
    par = write_dump(tmp_path / "par", "d", result, config, split="train", step=0)

    def without_timings(path):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            for key in ("worker", "reset_s"):
                row.pop(key)
            for turn in row["turns"]:
                turn.pop("env_s")
        return rows

    assert without_timings(seq) == without_timings(par)


# ----------------------------------------------------------------------------- an agent episode's program output


def _with_program(played):
    """``played``'s result with program output on its first and its failed trajectories, as an agent
    episode's; the others left as env episodes."""
    result, config, _ = played
    failed = ProgramResult(error="boom", stdout="<script>alert(1)</script>\nworking\n", stderr="é warn\n",
                           traceback="Traceback (most recent call last):\n  ...\nRuntimeError: boom\n")
    outputs = {0: ProgramResult(reward=1.0, info={"answer": [4, {"steps": 2}], "note": None}).output()}
    outputs.update({i: failed.output() for i, t in enumerate(result.trajectories) if t.stop_reason.failed})
    trajectories = [dataclasses.replace(t, program=outputs.get(i)) for i, t in enumerate(result.trajectories)]
    return RolloutResult(trajectories, result.specs), config


def test_an_agent_episodes_program_output_reads_back_and_an_envs_line_has_none(played, tmp_path):
    result, config = _with_program(played)
    path = write_dump(tmp_path, "d", result, config, split="train", step=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("program") for r in rows] == [t.program for t in result.trajectories]
    assert sum("program" in r for r in rows) == sum(t.program is not None for t in result.trajectories) >= 2
    records = read_dump(path)
    assert [r.trajectory.program for r in records] == [t.program for t in result.trajectories]
    assert [r.trajectory for r in records] == result.trajectories


def test_a_dump_without_program_output_reads_as_env_episodes(played, tmp_path):
    result, config = _with_program(played)
    rows = [json.loads(line) for line in
            write_dump(tmp_path, "d", result, config, split="train", step=1).read_text().splitlines()]
    for row in rows:  # as a dump written before agent programs
        row.pop("program", None)
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r.trajectory.program for r in read_dump(old)] == [None] * len(rows)


@pytest.mark.parametrize("program, message", [
    ("stdout", "program: expected ProgramOutput | None, got str 'stdout'"),
    ({"info": {}, "traceback": None, "stdout": 5, "stderr": ""}, "program.stdout: expected str, got int 5"),
    ({"info": [1], "traceback": None, "stdout": "", "stderr": ""}, "program.info: expected dict[str, Any]"),
    ({"info": {}, "traceback": 3, "stdout": "", "stderr": ""}, "program.traceback: expected str | None, got int 3"),
    ({"info": {}, "stdout": "", "stderr": ""}, "program: missing key(s) ['traceback'], unknown key(s) []"),
    ({"info": {}, "traceback": None, "stdout": "", "stderr": "", "pid": 7}, "unknown key(s) ['pid']"),
])
def test_a_malformed_program_output_is_refused_naming_it(played, tmp_path, program, message):
    result, config = _with_program(played)
    rows = [json.loads(line) for line in
            write_dump(tmp_path, "d", result, config, split="train", step=1).read_text().splitlines()]
    rows[1]["program"] = program
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DumpError) as err:
        read_dump(bad)
    assert f"{bad} line 2: " in str(err.value) and message in str(err.value), str(err.value)

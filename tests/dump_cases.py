"""Dumps with a wrong-typed field, JSON nested too deep, or an env id twice:
each case is a rewrite of a good dump's lines and the message that names it.
Used by the reader's tests (test_dump.py) and the command lines' (test_replay.py, test_viewer.py)."""

from __future__ import annotations

import json
from pathlib import Path


def _set(path: list, value):
    def edit(rows: list[dict], i: int) -> None:
        node = rows[i]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


def _duplicate(rows: list[dict], i: int) -> None:
    rows[i + 1]["env_id"] = rows[i + 1]["spec"]["env_id"] = rows[i]["env_id"]


def _deep_config(rows: list[dict], i: int) -> None:
    deep: list = []
    for _ in range(500):  # within the JSON decoder's limit, beyond what building a config from it survives
        deep = [deep]
    rows[i]["spec"]["env_config"]["nested"] = deep


# case -> (edit of rows[i], the line at fault after line i + 1, what the message says); i: the first row
# whose first turn stepped its env
BAD_DUMPS = {
    "response_int": (_set(["turns", 0, "response"], 5), 0, "turns[0].response: expected str, got int 5"),
    "success_str": (_set(["success"], "yes"), 0, "success: expected bool, got str 'yes'"),
    "messages_not_dicts": (_set(["turns", 0, "prompt", "messages"], [5, None]), 0,
                           "turns[0].prompt.messages: message 0 is int 5"),
    "reward_str": (_set(["turns", 0, "steps", 0, "reward"], "1.0"), 0,
                   "turns[0].steps[0].reward: expected float, got str '1.0'"),
    "request_seed_inf": (_set(["turns", 0, "request_seed"], float("inf")), 0,
                         "turns[0].request_seed: expected int, got float inf"),
    "env_config_list": (_set(["spec", "env_config"], [1]), 0, "spec.env_config: expected dict"),
    "prompt_ids_str": (_set(["turns", 0, "prompt_ids"], "60 124"), 0,
                       "turns[0].prompt_ids: expected a list of int, got str '60 124'"),
    "response_ids_floats": (_set(["turns", 0, "response_ids"], [1.5]), 0,
                            "turns[0].response_ids: expected a list of int, got list [1.5]"),
    "logprobs_strs": (_set(["turns", 0, "logprobs"], ["-0.5"]), 0,
                      "turns[0].logprobs: expected a list of float or null, got list ['-0.5']"),
    "prompt_start_past_the_ids": (_set(["turns", 0, "prompt_start"], 3), 0,
                                  "turns[0].prompt_start: 3, but the turns before it hold 0 token ids"),
    "program_stdout_int": (_set(["program"], {"info": {}, "traceback": None, "stdout": 5, "stderr": ""}), 0,
                           "program.stdout: expected str, got int 5"),
    "deep_json": (None, 0, "JSON nested too deeply"),  # 100000 nested lists: the decoder's own limit
    "deep_env_config": (_deep_config, 0, "spec.env_config: lists and dicts nested more than"),
    "duplicate_env_id": (_duplicate, 1, "env_id {env_id} again (first at line {first})"),
}


def write_bad_dump(good: Path, case: str, out: Path) -> tuple[Path, str]:
    """``good`` rewritten as ``case``, at ``out``; and what the error must say (``line N: ...``)."""
    edit, after, message = BAD_DUMPS[case]
    rows = [json.loads(x) for x in good.read_text(encoding="utf-8").splitlines()]
    i = next(k for k, r in enumerate(rows[:-1]) if r["turns"] and r["turns"][0]["steps"])
    lines = [json.dumps(r) for r in rows]
    if edit is None:
        lines[i] = "[" * 100_000 + "]" * 100_000
    else:
        edit(rows, i)
        lines = [json.dumps(r) for r in rows]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out, f"line {i + 1 + after}: {message.format(first=i + 1, env_id=rows[i]['env_id'])}"


def write_as_version_2(lines: list[str], out: Path) -> Path:
    """The dump ``lines`` as format 2 wrote them (no prompt ids), in the file ``out``."""
    rows = [json.loads(line) for line in lines]
    for row in rows:
        row["version"] = 2
        for turn in row["turns"]:
            del turn["prompt_ids"], turn["prompt_start"]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out

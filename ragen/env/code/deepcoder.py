"""Problems from a DeepCoder file (RAGEN's ``deepcoder`` data, prepared by its ``prepare_deepcoder_data``).

A Parquet or JSON-lines file of rows with the statement in ``question`` (or
``prompt``, ``problem``), the tests in ``ground_truth`` (or ``tests``: a JSON
string or a list of ``{"input", "output", "testtype"}``), ``starter_code``
and ``metadata`` (a JSON string or a mapping; ``func_name`` names the
function of ``functional`` tests). ``stdin_stdout`` tests become stdin/stdout
tests; ``functional`` ones become calls: the input's lines are the JSON
arguments, the output the JSON return value, and the function is a top-level
one or a method of ``class Solution`` (LiveCodeBench's form). Rows that have
no usable tests are left out, and counted in the log.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from ..config_checks import EnvConfigError
from .problems import Problem, Test

__all__ = ["load_problems"]

logger = logging.getLogger(__name__)


def _rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        try:
            import pandas
        except ImportError:
            raise EnvConfigError("dataset_path", "reading Parquet needs pandas and pyarrow: "
                                                 "pip install pandas pyarrow") from None
        return pandas.read_parquet(path).to_dict("records")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise EnvConfigError("dataset_path", f"{path}:{n}: not JSON: {exc}") from None
    return rows


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, (str, bytes)) and value else value


def _problem(row: dict[str, Any], index: int) -> Problem | None:
    statement = next((row[k] for k in ("question", "prompt", "problem") if isinstance(row.get(k), str)), None)
    tests = _json(row.get("ground_truth", row.get("tests")))
    metadata = _json(row.get("metadata")) or {}
    if statement is None or not isinstance(tests, list) or not tests:
        return None
    kinds = {t.get("testtype", "stdin_stdout") for t in tests if isinstance(t, dict)}
    starter = row.get("starter_code") or ""
    func_name = metadata.get("func_name") if isinstance(metadata, dict) else None
    if kinds == {"stdin_stdout"}:
        converted = tuple(Test(str(t["input"]), str(t["output"])) for t in tests)
        kind = "stdio"
    elif kinds == {"functional"} and func_name:
        try:
            converted = tuple(Test([json.loads(line) for line in str(t["input"]).splitlines() if line.strip()],
                                   json.loads(t["output"]) if isinstance(t["output"], str) else t["output"])
                              for t in tests)
        except (ValueError, KeyError):
            return None
        kind = "call"
    else:
        return None
    text = f"{statement}\n\nStarter code:\n{starter}" if starter else statement
    return Problem(id=f"{row.get('uid', index)}", kind=kind, statement=text, tests=converted, func_name=func_name,
                   starter_code=starter)


@functools.lru_cache(maxsize=4)
def load_problems(path: str) -> tuple[Problem, ...]:
    """The usable problems of a DeepCoder file (EnvConfigError naming ``dataset_path`` when there are none)."""
    file = Path(path)
    if not file.is_file():
        raise EnvConfigError("dataset_path", f"{path!r} is not a file (a Parquet or JSON-lines DeepCoder file)")
    rows = _rows(file)
    problems = tuple(p for i, row in enumerate(rows) if (p := _problem(row, i)) is not None)
    if len(problems) < len(rows):
        logger.info("%s: %d of %d rows have no tests the code env can run, left out", path,
                    len(rows) - len(problems), len(rows))
    if not problems:
        raise EnvConfigError("dataset_path", f"{path!r} has no problem with stdin/stdout or functional tests")
    return problems

"""The shell commands of README.md and the guides (docs/*.md), as a new user runs them.

``doc_commands()`` reads every command of their ```bash blocks in reading
order: the README, then the guides in the order the README links them.
``DocCommand.skip`` says why one cannot run here (a placeholder, a GPU, a
server, a cluster); the others are ``train.py`` and ragen's tools.

``python tests/doc_commands.py PLAN.json`` runs a plan (written by
tests/test_doc_commands.py) in one process, one command after another in the
plan's folder, so the imports are paid once: each command's output goes to a
file and its exit status into the plan's result file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import runpy
import shlex
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the commands run here: train.py and the tools that read what it wrote
RUNNABLE = (("python", "train.py"), ("python", "-m", "ragen.tools.viewer"), ("python", "-m", "ragen.tools.replay"))
# (a piece of the command, why a command holding it does not run here)
SKIPS = (
    ("/path/to", "a placeholder path"),
    ("<", "a placeholder"),
    ("engine=vllm", "needs vLLM"),
    ("engine=openai", "needs an OpenAI-compatible server"),
    ("engine.device=cuda", "needs a GPU"),
    ("+cluster=", "a Dask or Ray cluster (tests/test_cluster_dask.py, test_cluster_ray.py)"),
    ("--config-dir myconf", "the guide's own config folder, shown as a file"),
    ("--config-name agent_", "an agent example: tests/test_agent_examples.py trains it on the tiny model"),
)


@dataclass(frozen=True)
class DocCommand:
    """One command of a ```bash block: where it is, its words as the shell splits
    them, the ``NAME=value`` words before them, and why it is skipped (None: it runs)."""

    source: str
    text: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    skip: str | None = None

    @property
    def is_train(self) -> bool:
        return self.argv[:2] == ("python", "train.py")


def guide_order() -> list[Path]:
    """The README, then the guides it links, in the order it links them, then any other guide."""
    readme = ROOT / "README.md"
    linked = list(dict.fromkeys(re.findall(r"\]\((docs/[\w.-]+\.md)", readme.read_text())))
    guides = [ROOT / p for p in linked if (ROOT / p).is_file()]
    return [readme, *guides, *sorted(set((ROOT / "docs").glob("*.md")) - set(guides))]


def _lines(path: Path):
    """(line number, logical line) of the file's ```bash blocks, continuation lines joined."""
    inside, pending, start = False, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if not inside:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def commands_of(path: Path) -> list[DocCommand]:
    out = []
    for number, line in _lines(path):
        words = shlex.split(line, comments=True)
        source = f"{path.relative_to(ROOT)}:{number}"
        while words:  # a && b && c: each in turn
            cut = words.index("&&") if "&&" in words else len(words)
            part, words = words[:cut], words[cut + 1:]
            env = []
            while part and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", part[0]):
                env.append(tuple(part.pop(0).split("=", 1)))
            if not any(tuple(part[:len(r)]) == r for r in RUNNABLE):
                continue
            text = shlex.join(part)
            unquoted = re.sub(r"'[^']*'", "", line)  # what the shell would expand
            skip = next((why for piece, why in SKIPS if piece in line), None)
            if skip is None and "$" in unquoted:
                skip = "shell expansion"
            out.append(DocCommand(source, text, tuple(part), tuple(env), skip))
    return out


def doc_commands() -> list[DocCommand]:
    return [c for path in guide_order() for c in commands_of(path)]


# ---------------------------------------------------------------- running a plan


def _run_one(argv: list[str]) -> int:
    if argv[:2] == ["python", "train.py"]:
        sys.argv = ["train.py", *argv[2:]]
        call = lambda: runpy.run_path("train.py", run_name="__main__")  # noqa: E731
    else:
        sys.argv = [argv[2], *argv[3:]]
        call = lambda: runpy.run_module(argv[2], run_name="__main__", alter_sys=True)  # noqa: E731
    try:
        call()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # the command's own failure, reported as its exit status with the traceback
        traceback.print_exc()
        return 1
    return 0


def run_plan(plan_path: Path) -> None:
    plan = json.loads(plan_path.read_text())
    os.chdir(plan["cwd"])
    results, last_train_second = [], None
    for i, step in enumerate(plan["steps"]):
        if step["argv"][:2] == ["python", "train.py"]:
            # the run folder is named to the second: a new run starts in a new second, as a person's would
            while last_train_second == int(time.time()):
                time.sleep(0.05)
            last_train_second = int(time.time())
        out_path = Path(plan["cwd"]) / f"command_{i:02d}.log"
        saved_env = dict(os.environ)
        os.environ.update(step.get("env", {}))
        with open(out_path, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = _run_one(list(step["argv"]))
        os.environ.clear()
        os.environ.update(saved_env)
        for handler in logging.root.handlers[:]:  # the command's handlers write to its closed log
            logging.root.removeHandler(handler)
            handler.close()
        results.append({"rc": rc, "log": str(out_path)})
        Path(plan["results"]).write_text(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    run_plan(Path(sys.argv[1]))

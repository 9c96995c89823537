"""An agent episode of a ``command``: a program in a process group of its own, within its time limit.

The task arrives as JSON on its stdin. Its environment is the parent's without any ``OPENAI_*``
or ``RAGEN_*`` variable, plus ``OPENAI_BASE_URL``, ``OPENAI_API_BASE`` and ``OPENAI_API_KEY`` of
its own session. Its stdout and stderr are captured (the last 64 KiB of each); its reward is
its stdout's last non-empty line. At the timeout its group gets SIGTERM, then SIGKILL after
``grace_s``; when it ends, whatever it left running in its group is killed.
"""

from __future__ import annotations

import codecs
import json
import os
import shlex
import signal
import subprocess
import threading
from typing import Any, BinaryIO

from ragen.agents.capture import Output, Tail
from ragen.agents.config import AgentConfig
from ragen.agents.llm import LLM
from ragen.agents.result import ProgramResult, read_reward_line
from ragen.env.reward_bound import EnvOutputError

GRACE_S = 5.0  # between SIGTERM and SIGKILL
_SECRET_PREFIXES = ("OPENAI_", "RAGEN_")


def command_environment(llm: LLM) -> dict[str, str]:
    """The parent's environment without its ``OPENAI_*``/``RAGEN_*`` keys, plus the session's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SECRET_PREFIXES)}
    return {**env, **llm.environment()}


def run_command(config: AgentConfig, task: dict[str, Any], llm: LLM, max_abs_reward: float,
                grace_s: float = GRACE_S) -> ProgramResult:
    """``config.command`` played on ``task`` with ``llm``'s session, to its ``ProgramResult``."""
    argv = list(config.command or ())
    source = f"command {_shown(argv)}"
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=command_environment(llm), start_new_session=True)
    except OSError as exc:
        return ProgramResult(error=f"{source} did not start: {exc}")
    output = Output()
    pumps = [threading.Thread(target=_feed, args=(proc.stdin, json.dumps(task) + "\n"), daemon=True),
             threading.Thread(target=_drain, args=(proc.stdout, output.stdout), daemon=True),
             threading.Thread(target=_drain, args=(proc.stderr, output.stderr), daemon=True)]
    for pump in pumps:
        pump.start()
    timed_out = not _exited(proc.pid, config.timeout_s)
    stubborn = False  # still running grace_s after SIGTERM
    if timed_out:
        _signal_group(proc.pid, signal.SIGTERM)
        stubborn = not _exited(proc.pid, grace_s)
    # The leader is not reaped yet, so its group id is not reused: kill what it left in its group.
    _signal_group(proc.pid, signal.SIGKILL)
    status = proc.wait()
    for pump in pumps:
        pump.join(grace_s)  # the pipes close once every process holding them is gone
    captured = {"stdout": output.stdout.text(), "stderr": output.stderr.text()}
    if timed_out:
        after = f", then SIGKILL after {grace_s:g} s" if stubborn else ""
        return ProgramResult(error=f"{source} ran past timeout_s={config.timeout_s:g} and was killed (SIGTERM to "
                                   f"its process group{after})", timed_out=True, **captured)
    if status != 0:
        how = f"was killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"
        return ProgramResult(error=f"{source} {how} (its stderr is kept)", **captured)
    try:
        reward, info = read_reward_line(captured["stdout"], max_abs_reward, source, config.where)
    except EnvOutputError as exc:
        return ProgramResult(error=str(exc), **captured)
    return ProgramResult(reward=reward, info=info, **captured)


def _shown(argv: list[str], limit: int = 120) -> str:
    text = shlex.join(argv)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _exited(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` (a child) exited within ``timeout_s``, left unreaped."""
    done = threading.Event()

    def wait() -> None:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # reaped already
            pass
        done.set()

    threading.Thread(target=wait, daemon=True, name=f"ragen-agent-wait-{pid}").start()
    return done.wait(timeout_s)


def _signal_group(pgid: int, sig: int) -> bool:
    """``sig`` sent to process group ``pgid``; False where no process of it is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def _feed(pipe: BinaryIO, text: str) -> None:
    try:
        with pipe:
            pipe.write(text.encode("utf-8"))
    except OSError:  # BrokenPipeError: a program that does not read its task is free not to
        pass


def _drain(pipe: BinaryIO, tail: Tail) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with pipe:
        while chunk := os.read(pipe.fileno(), 65536):
            tail.write(decoder.decode(chunk))
    tail.write(decoder.decode(b"", final=True))

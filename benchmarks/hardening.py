"""The reproductions of issue 42's review, run again as a user or a hostile peer would run them.

    python benchmarks/hardening.py [--cases 1,3,7,batch] [--json PATH]

Each row plays one reproduction against the ``ragen`` that imports (a fake
OpenAI-compatible server that answers badly, a streaming engine that breaks
its contract, a peer that stops reading, crafted frames, oversized configs,
a long dump), in a child process of its own with a wall-clock limit and a
memory bound (its process tree's RSS, and ``RLIMIT_AS`` where a case could
blow up), so that a case that hangs or eats memory is reported as such
instead of stopping the script. It prints, per row: what was done, what
happened, the figure the issue quotes (seconds waited, MB, frames, lines)
and whether the defect shows. ``--cases`` takes defect numbers (1-11) and
``batch`` (the bad batch of 65,536 items); by default every row runs.
Exit status 1 when a row shows its defect (or could not tell). Linux only
(it reads ``/proc``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import pickle
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent


# ----- rows ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One reproduction: its child process runs ``CASES[id]``."""

    id: str
    defect: str  # what --cases names: "1".."11" or "batch"
    did: str  # what the row does, in words
    limit_s: float  # wall-clock limit of its child process
    mem_mb: int  # its process tree is killed past this RSS


ROWS = [
    Row("1a", "1", "parallel rollout (loky, 2 workers), 8 SimpleSokoban envs x 3 turns, over one fake server whose "
                   "token ids include -1", 120, 3000),
    Row("1b", "1", "the same over three fake servers, one answering token id 2**32", 120, 3000),
    Row("2", "2", "env-level rollout (loky) on a streaming engine whose first request's future runs and never "
                  "resolves (engine_timeout_s=1), then a weight swap (`with proxy.engine_lock`)", 90, 3000),
    Row("3", "3", "a peer asks the shared manager for 1 MiB answers and reads none for 10 s; another worker "
                  "asks meanwhile; then the peer asks past the send bound", 90, 2000),
    Row("4a", "4", "env-level rollout on a streaming engine whose first submit returns None, then a healthy "
                   "rollout and a weight swap", 90, 3000),
    Row("4b", "4", "the same, the first submit returning one future too many", 90, 3000),
    Row("5", "5", "parallel rollout over two fake servers that both answer HTTP 500 for 1.5 s (max_retries=1)",
        90, 3000),
    Row("6a", "6", "rollout over three fake servers, one answering 200 with a body that is not JSON", 90, 3000),
    Row("6b", "6", "the same, one answering 200 with JSON that has no `choices`", 90, 3000),
    Row("7a", "7", "a peer sends a frame of under 1 MiB: 80 requests naming one history of 192 Ki ids",
        60, 2500),
    Row("7b", "7", "a peer sends a batch frame naming one 768 KiB gen message 100 times", 60, 2500),
    Row("7c", "7", "a peer sends a 7.5 MiB frame of 200,000 requests", 90, 3000),
    Row("8", "8", "two request lists coalesced into one hf call (tiny model), one with a history id past the "
                  "vocabulary", 120, 3000),
    Row("9a", "9", "config with SimpleSokoban dim_x = dim_y = 2**40, then a sequential rollout of 2 envs",
        60, 2000),
    Row("9b", "9", "config with SimpleSokoban dim_x = dim_y = 20000, then a sequential rollout of 2 envs",
        40, 2000),
    Row("9c", "9", "replay of a dump whose SimpleSokoban record says dim_x = dim_y = 30000", 60, 2000),
    Row("10", "10", "replay of a dump of one 1,000-turn episode (scripted engine, byte tokens: about 380 appended "
                    "ids a turn)", 150, 6000),
    Row("11a", "11", "es_manager.train.group_size = 10**7, then a sequential rollout", 30, 1200),
    Row("11b", "11", "es_manager.train.env_groups = 10**6, then a sequential rollout", 30, 1200),
    Row("batch", "batch", "a peer sends one batch frame of 65,536 gen messages, each with a bad seed", 90, 2500),
]


# ----- the parent: one child process a row, watched ---------------------------------------------


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def tree_rss_mb(pid: int) -> float:
    from ragen.env.sandbox import process_tree

    return sum(_rss_mb(p) for p in process_tree(pid))


@dataclass
class Watched:
    """How a watched process ended."""

    rc: int | None
    seconds: float
    peak_mb: float
    killed: str  # why it was killed; "" if it ended by itself


def watched(cmd: list[str], limit_s: float, mem_mb: float, **popen: Any) -> Watched:
    """Run ``cmd`` in a session of its own; kill the session past ``limit_s`` or once its tree passes ``mem_mb``."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    t0, peak, killed = time.monotonic(), 0.0, ""
    while proc.poll() is None:
        rss = tree_rss_mb(proc.pid)
        peak = max(peak, rss)
        elapsed = time.monotonic() - t0
        if rss > mem_mb:
            killed = f"past {mem_mb} MB (killed after {elapsed:.0f} s)"
        elif elapsed > limit_s:
            killed = f"hung (killed after {limit_s:.0f} s, at {rss:.0f} MB)"
        if killed:
            break
        time.sleep(0.1)
    seconds = time.monotonic() - t0
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # what is left of it (workers), or all of it
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    return Watched(proc.returncode, seconds, peak, killed)


def run_row(row: Row) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hardening-") as tmp:
        result, log = Path(tmp) / "result.json", Path(tmp) / "log.txt"
        env = {**os.environ, "MALLOC_ARENA_MAX": "2", "HARDENING_TMP": tmp}
        with open(log, "wb") as out:
            w = watched([sys.executable, str(Path(__file__).resolve()), "--child", row.id, "--result", str(result)],
                        row.limit_s, row.mem_mb, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        got = json.loads(result.read_text()) if result.exists() else None
        if got is None:
            tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-3:]
            happened = w.killed or f"the case's process ended with rc {w.rc} and no result: " + " | ".join(tail)
            reached = Path(f"{result}.stage")
            if reached.exists():
                happened = f"{reached.read_text()}; {happened}"
            got = {"happened": happened, "figure": f"peak RSS {w.peak_mb:.0f} MB", "fixed": False if w.killed
                   else None}
    return {"id": row.id, "defect": row.defect, "did": row.did, **got, "seconds": round(w.seconds, 1),
            "peak_rss_mb": round(w.peak_mb), "killed": w.killed}


def _ragen_version() -> dict[str, str]:
    code = ("import ragen, os, subprocess; d = os.path.dirname(os.path.dirname(ragen.__file__)); "
            "r = subprocess.run(['git', '-C', d, 'log', '-1', '--format=%h %s'], capture_output=True, text=True); "
            "print(d); print(r.stdout.strip()[:72])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=tempfile.gettempdir()).stdout.split("\n")
    return {"ragen": out[0] if out else "?", "commit": out[1] if len(out) > 1 else ""}


VERDICT = {True: "fixed", False: "DEFECT", None: "?"}
SCALE = ("scale: the issue's, except 3 (the peer reads nothing for 10 s, not 20), 7c (6.7 MiB, not 7.5), 10 (1,000 "
         "turns of about 370 byte tokens, not 1,500 of 200: about as many ids in all), and 9b, 9c, 11 (killed at "
         "the memory bound shown, not left to grow)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="", help="defect numbers and/or 'batch', comma-separated (default: all)")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    parser.add_argument("--peer", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child, args.result)
    if args.peer:
        return peer_main(args.peer)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    known = sorted({r.defect for r in ROWS}, key=lambda d: (not d.isdigit(), int(d) if d.isdigit() else 0))
    bad = [c for c in wanted if c not in known]
    if bad:
        parser.error(f"--cases: unknown {', '.join(bad)}; choose from {', '.join(known)}")
    rows = [r for r in ROWS if not wanted or r.defect in wanted]
    version = _ragen_version()
    print(f"ragen from {version['ragen']} ({version['commit']}); python {sys.version.split()[0]}, "
          f"{os.cpu_count()} cores", flush=True)
    print(SCALE + "\n", flush=True)
    results = []
    for row in rows:
        got = run_row(row)
        results.append(got)
        print(f"[{row.id}] {VERDICT[got['fixed']]} in {got['seconds']} s: {got['happened']}", flush=True)
    print()
    print("| # | what was done | what happened | figure | |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['id']} | {r['did']} | {r['happened']} | {r['figure']} | {VERDICT[r['fixed']]} |")
    if args.json:
        Path(args.json).write_text(json.dumps({**version, "scale": SCALE, "rows": results}, indent=1) + "\n")
    return 0 if all(r["fixed"] for r in results) else 1


# ----- the child: one row -----------------------------------------------------------------------


class Records(logging.Handler):
    """The messages of every log record of WARNING and above (the text only: a record's
    arguments may hold what the case measures the memory of)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(record.getMessage())
        except Exception:  # a record whose arguments do not format
            self.lines.append(str(record.msg))

    def messages(self, pattern: str = "") -> list[str]:
        return [m for m in list(self.lines) if not pattern or re.search(pattern, m)]


LOG = Records()
STAGE: list[str] = []  # where the child notes how far it got


def stage(text: str) -> None:
    """Note how far the case got: the parent reports it if it has to kill the case."""
    if STAGE:
        Path(STAGE[0]).write_text(text)


def child_main(row_id: str, result_path: str) -> int:
    STAGE.append(f"{result_path}.stage")
    sys.path.insert(0, str(HERE))  # the endless env below, by its import path hardening:EndlessEnv
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger().addHandler(LOG)
    try:
        got = CASES[row_id]()
    except BaseException as exc:  # reported as the row's result
        import traceback

        traceback.print_exc()
        got = {"happened": f"the reproduction itself failed: {describe(exc)}", "figure": "", "fixed": None}
    Path(result_path).write_text(json.dumps(got))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # threads the case left waiting (a hung engine call) do not hold the exit


def bound_memory(extra_mb: int) -> None:
    """Refuse allocations past ``extra_mb`` of address space more than this process holds now."""
    with open("/proc/self/status") as f:
        vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    limit = (vm_kb << 10) + (extra_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def describe(exc: BaseException, chars: int = 220) -> str:
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= chars else text[: chars - 3] + "..."


def bounded(fn: Callable[[], Any], within_s: float) -> tuple[str, Any, float]:
    """``fn()`` in a daemon thread: ("ok", value, s), ("raised", exc, s) or ("hung", None, within_s)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["ok"] = fn()
        except BaseException as exc:  # handed to the caller
            box["raised"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within_s)
    seconds = time.monotonic() - t0
    if thread.is_alive():
        return "hung", None, within_s
    kind = "ok" if "ok" in box else "raised"
    return kind, box[kind], seconds


def vm(field: str, pid: str = "self") -> float:
    """A ``/proc/<pid>/status`` size in MB (VmRSS, VmHWM, VmSize)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


# ----- rollouts as a user writes them -----------------------------------------------------------


def custom_envs() -> dict[str, Any]:
    from omegaconf import OmegaConf

    from ragen.config_files import config_dir

    return OmegaConf.to_container(OmegaConf.load(config_dir() / "envs.yaml"), resolve=True)["custom_envs"]


def setup(split: dict[str, Any] | None = None, envs: dict[str, Any] | None = None, **agent_proxy: Any):
    from ragen.llm_agent import AgentSetup

    split = split or {"env_groups": 4, "group_size": 2, "env_configs": {"tags": ["SimpleSokoban"], "n_groups": [4]}}
    return AgentSetup.from_config({
        "custom_envs": envs or custom_envs(), "seed": {"train": 3, "val": 11},
        "agent_proxy": {"max_turn": 3, "parallel_n_jobs": 2, **agent_proxy},
        "es_manager": {"train": split, "val": split}})


def stops(result) -> dict[str, int]:
    return dict(collections.Counter(str(t.stop_reason.value) for t in result.trajectories))


def in_error(result) -> list:
    return [t for t in result.trajectories if str(t.stop_reason.value) == "error"]


def play(engine, **agent_proxy: Any) -> tuple[str, Any, float]:
    """A train rollout of 8 SimpleSokoban envs on ``engine``: ("ok", result, s), ("raised", exc, s) or
    ("hung", None, s)."""
    from ragen.llm_agent import LLMAgentProxy

    proxy = LLMAgentProxy(setup(**agent_proxy), engine)
    outcome = bounded(lambda: proxy.rollout("train", rollout_index=1), 60)
    bounded(proxy.close, 10)
    return outcome


def said(outcome: tuple[str, Any, float]) -> str:
    kind, value, seconds = outcome
    if kind == "hung":
        return f"rollout did not return within {seconds:.0f} s"
    if kind == "raised":
        return f"rollout raised {describe(value)} after {seconds:.1f} s"
    return f"rollout completed in {seconds:.1f} s, stop reasons {stops(value)}"


# ----- a fake OpenAI-compatible server ------------------------------------------------------------


class FakeServer:
    """Chat completions on 127.0.0.1 with the scripted policy's answers, spoiled as ``bad`` says
    (``negative_ids``, ``huge_ids``, ``not_json``, ``no_choices``); HTTP 500 while ``outage`` says
    the servers are down."""

    def __init__(self, bad: str = "", outage: dict[str, Any] | None = None) -> None:
        from ragen.llm.scripted import ScriptedEngine

        self.bad, self.outage, self.policy = bad, outage, ScriptedEngine()
        self.requests = self.failures = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._send(200, {"object": "list", "data": [{"id": "m"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                code, payload = server.answer(body)
                try:
                    self._send(code, payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _send(self, code: int, payload: Any) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def down(self) -> bool:
        if self.outage is None:
            return False
        with self.lock:
            now = time.monotonic()
            if self.outage.get("start") is None:
                self.outage["start"] = now
            return now < self.outage["start"] + self.outage["for_s"]

    def answer(self, body: dict[str, Any]) -> tuple[int, Any]:
        from ragen.llm.types import GenerationRequest, SamplingParams

        with self.lock:
            self.requests += 1
        if self.down():
            with self.lock:
                self.failures += 1
            return 500, {"error": "the server is down"}
        messages, prefix = body["messages"], ""
        if body.get("continue_final_message"):
            messages, prefix = messages[:-1], messages[-1]["content"]
        text = self.policy.answer_text(GenerationRequest(messages, seed=body.get("seed") or 0, answer_prefix=prefix),
                                       SamplingParams())
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": text}}
        reply = {"id": "x", "object": "chat.completion", "model": body.get("model"), "choices": [choice]}
        ids = {"negative_ids": [1, 2, -1], "huge_ids": [1, 2, 2**32]}.get(self.bad, [1, 2, 3])
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            reply["prompt_token_ids"] = [7, 8]
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [{"token": f"t{i}", "logprob": -0.5, "bytes": [116], "top_logprobs": []}
                                              for i in range(len(ids))]}
        if self.bad == "not_json":
            return 200, b"<html><body>502 Bad Gateway</body></html>"
        if self.bad == "no_choices":
            del reply["choices"]
        return 200, reply

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def openai_engine(servers: list[FakeServer], **options: Any):
    from ragen.llm import make_engine

    where = {"base_url": servers[0].base_url} if len(servers) == 1 else {"base_urls": [s.base_url for s in servers]}
    return make_engine({"name": "openai", "model": "m", "return_token_ids": True, **where, **options})


def play_over_servers(servers: list[FakeServer], **options: Any) -> tuple:
    """A parallel rollout over an OpenAI engine on ``servers``; the engine closed and the servers stopped after."""
    engine = openai_engine(servers, **options)
    try:
        return play(engine, use_parallel_rollout=True)
    finally:
        engine.close()
        for s in servers:
            s.stop()


def naming(pattern: str) -> list[str]:
    return LOG.messages(pattern)


def portless(text: str, servers: list[FakeServer]) -> str:
    for s in servers:
        text = text.replace(f":{s.port}", ":PORT")
    return text


def server_named(url: str, servers: list[FakeServer]) -> tuple[bool, str]:
    """Whether a warning names the server ``url`` with its route, and what the warnings say, in words."""
    named = naming(re.escape(url) + r"/(chat/)?completions")
    if named:
        route = re.search(re.escape(url) + r"/(chat/)?completions", named[0]).group()
        return True, f"a warning names {portless(route, servers)}"
    failed = naming(r"finish_reason='error'")
    if failed:
        return False, f"the warning reads {portless(failed[0][-90:], servers)!r}, no server named"
    return False, "no warning names the server"


def case_1(n_servers: int, bad: str) -> dict[str, Any]:
    servers = [FakeServer(bad=bad if i == n_servers // 2 else "") for i in range(n_servers)]
    bad_url = servers[n_servers // 2].base_url
    outcome = play_over_servers(servers, max_retries=1, backoff_s=0.05)
    named, where = server_named(bad_url, servers)
    where = "; " + where
    if outcome[0] != "ok":
        return {"happened": said(outcome) + where, "figure": "the rollout lost (8 envs)", "fixed": False}
    result = outcome[1]
    failovers = int(result.metrics.get("engine/replica_failovers", 0))
    errors = in_error(result)
    happened = f"{said(outcome)}, {len(errors)} of {len(result.trajectories)} envs in error{where}"
    figure = f"{len(errors)} envs in error"
    if n_servers == 1:
        fixed = bool(named) and len(errors) == len(result.trajectories)
    else:
        figure += f", {failovers} failovers"
        fixed = bool(named) and not errors and failovers > 0
    return {"happened": happened, "figure": figure, "fixed": fixed}


# ----- streaming engines that break their contract -----------------------------------------------


def streaming_engine(spoil: Callable[[list[Future], int, Any], Any]):
    """The scripted policy, answered at once; each ``submit`` returns ``spoil(futures, call, engine)``
    (``call`` counts from 1)."""
    from ragen.llm.scripted import ScriptedEngine
    from ragen.llm.types import StreamingEngine

    class Spoiling(StreamingEngine):
        name = "spoiling"

        def __init__(self) -> None:
            super().__init__()
            self.inner = ScriptedEngine()
            self.calls = 0
            self.kept: list[Future] = []

        def submit(self, requests, sampling):
            futures = []
            for c in self.inner.generate(list(requests), sampling):
                f: Future = Future()
                f.set_result(c)
                futures.append(f)
            self.calls += 1
            return spoil(futures, self.calls, self)

    return Spoiling()


def weight_swap(gate, within_s: float) -> tuple[str, float, str]:
    """A weight swap's ``with gate``: ("got", seconds, ""), ("raised", seconds, error) or ("waiting", within_s, "")."""
    def swap() -> None:
        with gate:
            pass

    kind, value, seconds = bounded(swap, within_s)
    if kind == "ok":
        return "got", seconds, ""
    if kind == "raised":
        return "raised", seconds, describe(value)
    return "waiting", within_s, ""


def swap_said(swap: tuple[str, float, str], gate) -> str:
    kind, seconds, error = swap
    if kind == "got":
        return f"the weight swap got the engine lock in {seconds:.2f} s"
    if kind == "raised":
        return f"the weight swap's wait ended after {seconds:.1f} s: {error}"
    return f"the weight swap still waited after {seconds:.0f} s (requests in flight: {gate.in_flight})"


def case_2() -> dict[str, Any]:
    def hang_first(futures, call, engine):
        if call == 1:  # the first request's future runs and never resolves: a hung executor call
            f: Future = Future()
            f.set_running_or_notify_cancel()
            engine.kept.append(f)
            futures = [f] + futures[1:]
        return futures

    from ragen.llm_agent import LLMAgentProxy

    engine = streaming_engine(hang_first)
    proxy = LLMAgentProxy(setup(use_parallel_rollout=True, engine_timeout_s=1.0), engine)
    outcome = bounded(lambda: proxy.rollout("train", rollout_index=1), 60)
    swap = weight_swap(proxy.engine_lock, 20) if outcome[0] == "ok" else ("waiting", 0.0, "")
    happened = f"{said(outcome)}; {swap_said(swap, proxy.engine_lock)}"
    if swap[0] == "got":
        bounded(proxy.close, 10)
    gave_up = " (gave up)" if swap[0] == "waiting" else ""
    return {"happened": happened, "figure": f"swap waited {swap[1]:.2f} s{gave_up}",
            "fixed": outcome[0] == "ok" and swap[0] == "got"}


def case_4(kind: str) -> dict[str, Any]:
    def spoil(futures, call, engine):
        if call != 1:
            return futures
        return None if kind == "none" else futures + futures[:1]

    from ragen.llm_agent import LLMAgentProxy

    engine = streaming_engine(spoil)
    proxy = LLMAgentProxy(setup(use_parallel_rollout=True, engine_timeout_s=2.0), engine)
    first = bounded(lambda: proxy.rollout("train", rollout_index=1), 40)
    time.sleep(3.0)  # a training step: past the broken request's engine_timeout_s
    second = bounded(lambda: proxy.rollout("train", rollout_index=2), 40) if first[0] != "hung" else first
    swap = weight_swap(proxy.engine_lock, 10) if second[0] != "hung" else ("waiting", 0.0, "")
    named = ""
    if first[0] == "ok":
        errors = [t.error or "" for t in first[1].trajectories if t.error]
        named = f" ({' '.join(errors[0].split())[:170]})" if errors else ""
    happened = (f"first: {said(first)}{named}; then healthy: {said(second)}; {swap_said(swap, proxy.engine_lock)}")
    healthy = second[0] == "ok" and set(stops(second[1])) <= {"done", "max_turns", "action_budget"}
    if swap[0] == "got":
        bounded(proxy.close, 10)
    gave_up = " (gave up)" if swap[0] == "waiting" else ""
    figure = (f"healthy rollout: {stops(second[1]) if second[0] == 'ok' else second[0]}; "
              f"swap waited {swap[1]:.2f} s{gave_up}")
    return {"happened": happened, "figure": figure, "fixed": healthy and swap[0] == "got"}


def case_5() -> dict[str, Any]:
    outage = {"start": None, "for_s": 1.5}
    servers = [FakeServer(outage=outage), FakeServer(outage=outage)]
    outcome = play_over_servers(servers, max_retries=1)
    failures = sum(s.failures for s in servers)
    text = portless(said(outcome), servers)
    if outcome[0] != "ok":
        return {"happened": text, "figure": f"rollout lost {outcome[2]:.1f} s in ({failures} HTTP 500s answered)",
                "fixed": False}
    result = outcome[1]
    errors = in_error(result)
    failovers = int(result.metrics.get("engine/replica_failovers", 0))
    return {"happened": f"{text}, {len(errors)} envs in error, {failovers} failovers",
            "figure": f"rollout done in {outcome[2]:.1f} s ({failures} HTTP 500s answered)",
            "fixed": not errors and failures > 0}


def case_6(bad: str) -> dict[str, Any]:
    servers = [FakeServer(), FakeServer(bad=bad), FakeServer()]
    outcome = play_over_servers(servers, max_retries=1, backoff_s=0.05)
    named, warning = server_named(servers[1].base_url, servers)
    if outcome[0] != "ok":
        return {"happened": f"{portless(said(outcome), servers)}; {warning}", "figure": "", "fixed": False}
    result = outcome[1]
    errors = in_error(result)
    failovers = int(result.metrics.get("engine/replica_failovers", 0))
    return {"happened": f"{said(outcome)}, {len(errors)} of {len(result.trajectories)} envs in error; {warning}",
            "figure": f"{failovers} failovers, {len(errors)} envs in error",
            "fixed": bool(named) and failovers > 0 and not errors}


# ----- peers of the shared manager ----------------------------------------------------------------


def _requests(n: int, env0: int = 0, **fields: Any) -> list:
    from ragen.llm.types import GenerationRequest

    return [GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down"}],
                              env_id=env0 + i, turn=0, seed=1, **fields) for i in range(n)]


def connect(address: Any, authkey: bytes, rcvbuf: int = 0) -> socket.socket:
    """A connection to the manager that proves the key, as a worker's does."""
    from ragen.serving import wire

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connecting: no autotuning
    sock.settimeout(10)
    sock.connect(tuple(address))
    wire.client_handshake(sock, authkey, tuple(address), 10)
    return sock


def ask(client, requests, sampling, within_s: float) -> tuple[str, Any, float]:
    def wait():
        ticket = client.submit(requests, sampling)
        while True:
            got, completions = client.wait_any()
            if got == ticket:
                return completions

    return bounded(wait, within_s)


BIG_ENV = 100  # env ids from here on are answered with ANSWER_BYTES
ANSWER_BYTES = 1 << 20


def big_answers_engine():
    from ragen.llm.scripted import ScriptedEngine

    class BigAnswers(ScriptedEngine):
        def generate(self, requests, sampling):
            got = super().generate(requests, sampling)
            return [dataclasses.replace(c, text="x" * ANSWER_BYTES) if r.env_id >= BIG_ENV else c
                    for c, r in zip(got, requests)]

    return BigAnswers()


def case_3() -> dict[str, Any]:
    from ragen.llm.types import SamplingParams
    from ragen.serving import SharedLLMInferenceManager, messages, wire

    stuck_s = 10.0
    max_message = 4 << 20  # so that the send bound (two of the largest frames, by default) is 8 MiB

    def ask_big(sock, n, ticket0):
        for i in range(n):
            time.sleep(0.05)  # each its own engine call: one answer a frame, under max_message_bytes
            try:
                wire.send_frame(sock, {"op": "gen", "ticket": ticket0 + i, "sampling": SamplingParams().to_dict(),
                                       "requests": [messages.request_for_wire(r) for r in _requests(1, BIG_ENV + i)]})
            except OSError:  # the manager closed it
                return

    with SharedLLMInferenceManager(big_answers_engine(), max_message_bytes=max_message) as shared:
        handle = shared.client(timeout_s=30)
        stuck = connect(shared.address, handle.authkey, rcvbuf=64 << 10)
        n_first = 6  # more than the kernel holds for a peer that does not read (4 MiB), less than the bound
        ask_big(stuck, n_first, 1)
        deadline = time.monotonic() + 10
        while shared.stats.requests < n_first and time.monotonic() < deadline:
            time.sleep(0.02)  # its answers are made and wait to be sent
        unstick = threading.Timer(stuck_s, stuck.close)  # the peer reads nothing for stuck_s more, then leaves
        unstick.start()
        waited = ask(handle, _requests(2), SamplingParams(), stuck_s + 10)
        unstick.join()
        # a second peer asks past the bound and reads nothing
        stuck2 = connect(shared.address, handle.authkey, rcvbuf=64 << 10)
        peer2 = "%s:%d" % stuck2.getsockname()[:2]
        ask_big(stuck2, 24, 1)
        deadline = time.monotonic() + 8
        while not naming(re.escape(peer2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        dropped = naming(re.escape(peer2))
        later = ask(handle, _requests(1), SamplingParams(), 5)
        stuck2.close()
    wait_s = waited[2]
    first = (f"the worker was answered after {wait_s:.2f} s" if waited[0] == "ok"
             else f"the worker's request: {said(waited)}")
    then = (f"the peer past the bound was dropped, named in a warning ({dropped[0][:110]!r})" if dropped
            else "no peer was dropped within 8 s")
    after = "a later request was answered" if later[0] == "ok" else f"a later request was not answered ({later[0]})"
    return {"happened": f"{first}; {then}; {after}", "figure": f"worker waited {wait_s:.2f} s "
                                                              f"(peer unread for {stuck_s:.0f} s)",
            "fixed": waited[0] == "ok" and wait_s < 2.0 and bool(dropped) and later[0] == "ok"}


# crafted frames, built by a peer process of their own (what it allocates is not the manager's)

def frame_payload(name: str) -> tuple[bytes, list[int]]:
    """A crafted frame's payload and the tickets it asks for."""
    from ragen.serving import messages

    def gen(ticket, requests):
        return {"op": "gen", "ticket": ticket, "requests": requests, "sampling": {}}

    def raw(r):
        return messages.request_for_wire(r)

    def dump(msg):  # as a client's frame carries it: pickle keeps shared objects shared
        return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)

    history = bytes(4 * 3 * (1 << 16))  # 192 Ki ids, 768 KiB
    if name == "7a":
        return dump(gen(1, [{**raw(r), "history_token_ids": history} for r in _requests(80)])), [1]
    if name == "7b":
        item = dump(gen(1, [{**raw(_requests(1)[0]), "history_token_ids": history}]))
        return dump({"op": "batch", "msgs": [item] * 100}), [1]
    if name == "7c":
        return dump(gen(1, [{"messages": [{"role": "user", "content": "x"}], "env_id": i, "turn": 0, "seed": 1}
                            for i in range(200_000)])), [1]
    if name == "batch":
        bad = [dump(gen(t, [{**raw(_requests(1, env0=t)[0]), "seed": "x"}])) for t in range(1, (1 << 16) + 1)]
        return dump({"op": "batch", "msgs": bad}), list(range(1, (1 << 16) + 1))
    raise ValueError(name)


def peer_main(spec: str) -> int:
    """The crafted frame's sender: reads ``{"address", "key", "frame"}`` as JSON on stdin, prints what came back."""
    from ragen.serving import wire

    todo = json.loads(spec)
    payload, tickets = frame_payload(todo["frame"])
    sock = connect(todo["address"], bytes.fromhex(todo["key"]))
    sock.settimeout(None)
    print(json.dumps({"ready": len(payload)}), flush=True)
    sys.stdin.readline()  # go
    t0 = time.monotonic()
    sock.sendall(len(payload).to_bytes(wire.HEADER_BYTES, "big") + payload)
    left, frames, errors, deadline = set(tickets), 0, [], t0 + todo["within_s"]
    sock.settimeout(1.0)
    while left and time.monotonic() < deadline:
        try:
            data, _ = wire.recv_frame(sock, 256 << 20, deadline)
        except (TimeoutError, socket.timeout):
            continue
        except (OSError, EOFError, wire.ProtocolError) as exc:
            errors.append(f"connection closed: {describe(exc)}")
            break
        frames += 1
        for a in wire.loads(data).get("answers", []):
            if a.get("ticket") is None:  # an answer to the whole frame
                left.clear()
            left.discard(a.get("ticket"))
            if "error" in a and len(errors) < 3:
                errors.append(a["error"])
    print(json.dumps({"frames": frames, "unanswered": len(left), "errors": errors, "bytes": len(payload),
                      "seconds": time.monotonic() - t0}), flush=True)
    return 0


def send_from_peer(shared, frame: str, within_s: float, on_ready: Callable[[], None] = lambda: None) -> dict:
    """Has a peer process send the crafted ``frame`` to ``shared``; what the peer saw."""
    handle = shared.client()
    spec = json.dumps({"address": list(shared.address), "key": handle.authkey.hex(), "frame": frame,
                       "within_s": within_s})
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--peer", spec], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(HERE)] + os.environ.get("PYTHONPATH", "").split(os.pathsep))})
    try:
        ready = json.loads(proc.stdout.readline())
        on_ready()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        got = json.loads(line) if line else {"frames": 0, "unanswered": -1, "errors": ["the peer died"]}
    finally:
        proc.kill()
        proc.wait()
    return {**ready, **got}


def case_7(frame: str) -> dict[str, Any]:
    import gc

    from ragen.llm.scripted import ScriptedEngine
    from ragen.serving import SharedLLMInferenceManager

    bound_memory(3000)
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        gc.collect()
        before = {}

        def mark() -> None:
            before["rss"] = vm("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak RSS starts again from here

        got = send_from_peer(shared, frame, within_s=40, on_ready=mark)
        time.sleep(0.5)
        peak, after = vm("VmHWM") - before["rss"], vm("VmRSS")
        handle = shared.client(timeout_s=10)
        from ragen.llm.types import SamplingParams

        later = ask(handle, _requests(1), SamplingParams(), 15)
    answered = "refused" if got["errors"] and all(e.startswith("bad message") for e in got["errors"]) else "taken"
    if got["unanswered"]:
        what = f"{got['unanswered']} tickets unanswered after 40 s"
    elif answered == "refused":
        what = f"refused: {got['errors'][0][:150]!r}"
    else:
        what = "taken and answered" + (f" ({got['errors'][0][:100]!r})" if got["errors"] else "")
    return {"happened": f"frame of {got['ready'] / 2**20:.2f} MiB {what}; a later request "
                        f"{'was answered' if later[0] == 'ok' else 'was not answered'}",
            "figure": f"manager RSS +{peak:.0f} MB at peak, {after:.0f} MB after",
            # the unpickler builds a frame's objects before they can be counted: a few times its bytes
            "fixed": answered == "refused" and peak < 24 * got["ready"] / 2**20 + 20 and later[0] == "ok"}


def case_batch() -> dict[str, Any]:
    from ragen.llm.scripted import ScriptedEngine
    from ragen.serving import SharedLLMInferenceManager

    bound_memory(3000)
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        t0 = {}
        got = send_from_peer(shared, "batch", within_s=60, on_ready=lambda: t0.setdefault("n", len(LOG.lines)))
        warnings = len(LOG.lines) - t0["n"]
    n = 1 << 16
    unanswered = f", {got['unanswered']} tickets unanswered" if got["unanswered"] else ""
    return {"happened": f"{n - got['unanswered']} of {n} tickets answered in {got['frames']} reply frames over "
                        f"{got['seconds']:.1f} s, {warnings} WARNING lines{unanswered}",
            "figure": f"{got['frames']} reply frames, {warnings} warning lines, {got['seconds']:.1f} s",
            "fixed": got["unanswered"] == 0 and got["frames"] <= 2 and warnings <= 2}


def case_8() -> dict[str, Any]:
    from ragen.llm.hf import HFEngine
    from ragen.llm.tiny_model import build_tiny_model
    from ragen.llm.types import EngineError, SamplingParams
    from ragen.serving import SharedLLMInferenceManager

    path = build_tiny_model(Path(os.environ.get("HARDENING_TMP", tempfile.mkdtemp())) / "tiny", seed=0)
    engine = HFEngine(path, device="cpu")
    vocab = engine.model.get_input_embeddings().num_embeddings
    bad = _requests(1, env0=9, history_token_ids=[1, 2, vocab + 5], history_messages=1)
    sampling = SamplingParams(max_tokens=4)
    got, errors = {}, []
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.0, max_coalesce_wait_s=5.0) as shared:
        client = shared.client(timeout_s=60)
        client.open_streams(2)  # two request lists in flight: the manager waits for both, then one call
        bad_ticket = client.submit(bad, sampling)
        good_ticket = client.submit(_requests(2), sampling)
        deadline = time.monotonic() + 60
        while len(got) + len(errors) < 2 and time.monotonic() < deadline:
            try:
                ticket, completions = client.wait_any()
                got[ticket] = completions
            except EngineError as exc:
                errors.append((exc.ticket, describe(exc, 160)))
                client.close_stream()
    bad_failed = [e for t, e in errors if t == bad_ticket]
    good_failed = [e for t, e in errors if t == good_ticket]
    happened = (f"bad list: {'error ' + repr(bad_failed[0]) if bad_failed else 'answered'}; "
                f"good list: {'error ' + repr(good_failed[0][:80]) if good_failed else 'answered'}")
    return {"happened": happened, "figure": f"{len(errors)} of 2 request lists failed",
            "fixed": bool(bad_failed) and good_ticket in got and f"{vocab + 5}" in bad_failed[0]}


# ----- sizes of envs, rollouts and dumps ----------------------------------------------------------


def sokoban_envs(dim: int) -> dict[str, Any]:
    envs = custom_envs()
    simple = envs["SimpleSokoban"]
    return {"SimpleSokoban": {**simple, "env_config": {**simple["env_config"], "dim_x": dim, "dim_y": dim}}}


def two_envs() -> dict[str, Any]:
    return {"env_groups": 1, "group_size": 2, "env_configs": {"tags": ["SimpleSokoban"], "n_groups": [1]}}


def case_9(dim: int) -> dict[str, Any]:
    from ragen.llm.scripted import ScriptedEngine
    from ragen.llm_agent import LLMAgentProxy

    bound_memory(2500)
    try:
        proxy = LLMAgentProxy(setup(two_envs(), sokoban_envs(dim)), ScriptedEngine())
    except ValueError as exc:
        return {"happened": f"refused at config read: {describe(exc, 200)}", "figure": "0 envs built",
                "fixed": "dim_" in str(exc) and "64" in str(exc)}
    stage("config accepted, rollout started")
    outcome = bounded(lambda: proxy.rollout("train"), 30)
    if outcome[0] != "ok":
        return {"happened": f"config accepted; {said(outcome)}", "figure": f"RSS {vm('VmRSS'):.0f} MB",
                "fixed": False}
    errors = [t.error for t in outcome[1].trajectories if t.error]
    first = f": {errors[0][:80]!r}" if errors else ""
    return {"happened": f"config accepted; {said(outcome)}{first}", "figure": f"{len(errors)} of 2 envs in error",
            "fixed": False}


def small_dump(directory: Path, envs: dict[str, Any], split: dict[str, Any], max_turn: int,
               engine=None) -> Path:
    """A dump of one sequential rollout, as the trainer writes it (``trainer.rollout_data_dir``)."""
    from ragen.llm.scripted import ScriptedEngine
    from ragen.llm_agent import LLMAgentProxy
    from ragen.rollout.dump import write_dump

    s = setup(split, envs, max_turn=max_turn)
    with LLMAgentProxy(s, engine or ScriptedEngine(seed=1)) as proxy:
        result = proxy.rollout("train")
    return write_dump(directory, "step_000001", result, s.loop, split="train", step=1)


def replay_cmd(path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ragen.tools.replay", str(path), *extra]


def case_9c() -> dict[str, Any]:
    tmp = Path(os.environ.get("HARDENING_TMP", tempfile.mkdtemp()))
    path = small_dump(tmp, {"SimpleSokoban": custom_envs()["SimpleSokoban"]}, two_envs(), 2)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["spec"]["env_config"].update(dim_x=30000, dim_y=30000)
    tampered = tmp / "tampered.jsonl"
    tampered.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env_id = str(rows[0]["env_id"])
    w, out = run_bounded(replay_cmd(tampered, "--env-id", env_id), 40, 1800)
    out = out.replace(str(tmp) + os.sep, "")
    if w.killed:
        return {"happened": f"replay {w.killed}", "figure": f"replay peak RSS {w.peak_mb:.0f} MB", "fixed": False}
    last = out.strip().splitlines()[-1] if out.strip() else ""
    return {"happened": f"replay exited {w.rc} after {w.seconds:.1f} s: {last[-200:]!r}",
            "figure": f"replay peak RSS {w.peak_mb:.0f} MB",
            "fixed": w.rc == 2 and "dim_" in last and "64" in last}


def run_bounded(cmd: list[str], limit_s: float, mem_mb: int) -> tuple[Watched, str]:
    with tempfile.TemporaryFile() as out:
        w = watched(cmd, limit_s, mem_mb, stdout=out, stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE)] + os.environ.get(
                        "PYTHONPATH", "").split(os.pathsep))})
        out.seek(0)
        return w, out.read().decode(errors="replace")


def _endless_env_class():
    from ragen.env.base import BaseDiscreteActionEnv

    class Endless(BaseDiscreteActionEnv):
        """Counts up for ever: an episode as long as max_turn."""

        ACTION_LOOKUP = {1: "Up", 2: "Down"}

        def __init__(self, config: Any = None) -> None:
            super().__init__(config)
            self.count = 0

        def reset(self, seed: int | None = None, **kwargs: Any) -> str:
            self.count = 0
            return self._obs()

        def _obs(self) -> str:
            return f"count {self.count}. Available actions: Up, Down"

        def step(self, action: Any) -> tuple[str, float, bool, dict]:
            valid = self.is_valid_action(action)
            self.count += 1
            return self._obs(), 0.0, False, {"action_is_valid": valid, "action_is_effective": valid,
                                             "success": False}

    return Endless


def __getattr__(name: str) -> Any:
    """``hardening:EndlessEnv``, the env type of case 10's dump (built on first use: the parent imports no ragen)."""
    if name == "EndlessEnv":
        cls = globals()[name] = _endless_env_class()
        return cls
    raise AttributeError(name)


def case_10() -> dict[str, Any]:
    tmp = Path(os.environ.get("HARDENING_TMP", tempfile.mkdtemp()))
    turns = 1000
    envs = {"Endless": {"env_type": "hardening:EndlessEnv", "max_actions_per_traj": 10**6, "max_tokens": 100,
                        "env_instruction": "Count up.", "env_config": {}}}
    split = {"env_groups": 1, "group_size": 1, "env_configs": {"tags": ["Endless"], "n_groups": [1]}}
    t0 = time.monotonic()
    path = small_dump(tmp, envs, split, turns)
    made_s = time.monotonic() - t0
    import gzip

    text = (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)).read()
    size = len(text.encode())
    row = json.loads(text.splitlines()[0])
    ids = sum(len(t.get("prompt_ids") or []) + len(t.get("response_ids") or []) for t in row["turns"])
    per_turn = f", {ids / turns:.0f} appended ids a turn"
    w, out = run_bounded(replay_cmd(path, "--allow-env-type", "hardening:EndlessEnv"), 100, 5500)
    if w.killed:
        happened = f"replay {w.killed}"
    else:
        last = out.strip().splitlines()[-1] if out.strip() else ""
        happened = f"replay exited {w.rc} after {w.seconds:.1f} s ({last[-80:]!r})"
    return {"happened": f"dump of {turns} turns, {size / 2**20:.2f} MiB of JSON{per_turn} (made in {made_s:.0f} s); "
                        f"{happened}",
            "figure": f"replay peak RSS {w.peak_mb:.0f} MB",
            "fixed": not w.killed and w.rc == 0 and w.peak_mb < 400}


def case_11(key: str, value: int) -> dict[str, Any]:
    from ragen.llm.scripted import ScriptedEngine
    from ragen.llm_agent import LLMAgentProxy

    bound_memory(1500)
    split = {"env_groups": 1, "group_size": 1, "env_configs": {"tags": ["Bandit"], "n_groups": [1]}}
    split[key] = value
    if key == "env_groups":
        split["env_configs"]["n_groups"] = [value]
    t0 = time.monotonic()
    stage("no error at start-up so far")
    try:
        proxy = LLMAgentProxy(setup(split), ScriptedEngine())
    except (ValueError, MemoryError) as exc:
        refused = isinstance(exc, ValueError) and f"es_manager.train.{key}" in str(exc)
        return {"happened": f"{'refused at start-up' if refused else 'failed at start-up'} after "
                            f"{time.monotonic() - t0:.1f} s: {describe(exc, 200)}",
                "figure": f"RSS {vm('VmRSS'):.0f} MB", "fixed": refused}
    stage("config accepted, rollout started")
    outcome = bounded(lambda: proxy.rollout("train"), 25)
    return {"happened": f"config accepted; {said(outcome)}", "figure": f"RSS {vm('VmRSS'):.0f} MB",
            "fixed": False}


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "1a": lambda: case_1(1, "negative_ids"),
    "1b": lambda: case_1(3, "huge_ids"),
    "2": case_2,
    "3": case_3,
    "4a": lambda: case_4("none"),
    "4b": lambda: case_4("too_many"),
    "5": case_5,
    "6a": lambda: case_6("not_json"),
    "6b": lambda: case_6("no_choices"),
    "7a": lambda: case_7("7a"),
    "7b": lambda: case_7("7b"),
    "7c": lambda: case_7("7c"),
    "8": case_8,
    "9a": lambda: case_9(2**40),
    "9b": lambda: case_9(20000),
    "9c": case_9c,
    "10": case_10,
    "11a": lambda: case_11("group_size", 10**7),
    "11b": lambda: case_11("env_groups", 10**6),
    "batch": case_batch,
}


if __name__ == "__main__":
    sys.exit(main())

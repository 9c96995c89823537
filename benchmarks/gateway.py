"""The gateway (``ragen.gateway``) measured: its added time per call, coalescing, and malformed requests.

    PYTHONPATH=. python benchmarks/gateway.py [--calls 2000] [--sessions 64] [--malformed 10000]

The manager (scripted engine) and the gateway run in this process, as in the driver;
clients run in other processes, as agents would.

1. Added time per call: the same chat request (a system and a user message, prompt
   ids given) sent ``--calls`` times by a worker's connection (``SharedLLMClient``)
   and through the gateway (a raw keep-alive HTTP client, and the ``openai`` client),
   alternating in rounds; median and p90 of each, and the gateway's median less the
   worker's. Engine latency 0.
2. Coalescing: ``--sessions`` sessions from 2 client processes (half each, a thread a
   session), each playing a growing chat of 8 turns, twice; the engine takes
   ``--engine-ms`` a call. The mean engine batch against the gateway's calls waiting
   (read and not yet answered) as each engine call starts.
3. Where the gateway runs: in the driver (beside the manager and the engine) or in a
   rollout worker's process (a ``ManagerLink`` over the worker's own connection):
   ``--calls`` calls from another process each way; the median call, and the driver's
   CPU time per call (what the driver's process spends beyond the engine's call).
4. Malformed requests: ``--malformed`` of them (bad JSON, wrong types, unknown roles,
   oversized bodies, no key), then a good call; the server's RSS before and after.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
from typing import Any

SYSTEM = ("You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
          "Available actions: Up, Down, Left, Right. You can take up to 3 actions per turn.")
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "#####\n#._P#\n#.X.#\n#####\nGo."}]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _post(conn: http.client.HTTPConnection, path: str, body: bytes, key: str | None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body=body, headers=headers)
    response = conn.getresponse()
    return response.status, response.read()


def _overhead_client(client: Any, request: Any, sampling: Any, host: str, port: int, path: str, key: str,
                     base_url: str, calls: int, out: Any) -> None:
    """Child process: the worker's path and the gateway's, alternating in rounds of 50."""
    import openai

    conn = http.client.HTTPConnection(host, port, timeout=30)
    oai = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    times: dict[str, list[float]] = {"worker": [], "gateway_http": [], "gateway_openai": []}
    for _ in range(max(1, calls // 50)):
        for name in times:
            for _ in range(50):
                t0 = time.perf_counter()
                if name == "worker":
                    ticket = client.submit([request], sampling)
                    got = client.wait_any(30)
                    assert got is not None and got[0] == ticket
                elif name == "gateway_http":
                    status, _ = _post(conn, path, body, key)
                    assert status == 200
                else:
                    oai.chat.completions.create(model="m", messages=MESSAGES)
                times[name].append(time.perf_counter() - t0)
    out.put(times)


def _chatters(host: str, port: int, sessions: list[tuple[str, str]], turns: int, rounds: int, out: Any) -> None:
    """Child process: a thread a session, each a growing chat of ``turns`` calls, ``rounds`` times."""
    def chat(path: str, key: str) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=60)
        for _ in range(rounds):
            messages = list(MESSAGES)
            for turn in range(turns):
                status, raw = _post(conn, path, json.dumps({"model": "m", "messages": messages}).encode(), key)
                assert status == 200, raw
                answer = json.loads(raw)["choices"][0]["message"]["content"]
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"Turn {turn}."}]

    errors: list[str] = []

    def run(path: str, key: str) -> None:
        try:
            chat(path, key)
        except Exception as exc:  # noqa: BLE001 - reported with the result
            errors.append(f"{type(exc).__name__}: {exc}"[:300])

    threads = [threading.Thread(target=run, args=s) for s in sessions]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((time.perf_counter() - t0, errors))


def _http_calls(host: str, port: int, path: str, key: str, calls: int, out: Any) -> None:
    """Child process: ``calls`` chat calls on one keep-alive connection, each timed."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        status, _ = _post(conn, path, body, key)
        assert status == 200
        times.append(time.perf_counter() - t0)
    out.put(times)


def _worker_gateway(client: Any, opened: Any, stop: Any) -> None:
    """Child process: a rollout worker's gateway over its own connection to the driver's manager."""
    from ragen.gateway.gateway import Gateway
    from ragen.gateway.link import ManagerLink
    from ragen.gateway.server import GatewayServer
    from ragen.llm.scripted import byte_chat
    from ragen.llm.types import SamplingParams

    server = GatewayServer(Gateway(ManagerLink(client, byte_chat(), "scripted", timeout_s=60),
                                   SamplingParams(max_tokens=64)))
    session = server.open_session()
    opened.put((server.host, server.port, f"/sessions/{session.id}/v1/chat/completions", session.key))
    stop.wait(900)
    server.close()


def _cpu_s() -> float:
    usage = os.times()
    return usage.user + usage.system


def placement(calls: int) -> dict[str, Any]:
    from ragen.llm.scripted import ScriptedEngine
    from ragen.serving.server import SharedLLMInferenceManager

    ctx = mp.get_context("spawn")
    result = {}
    for where in ("driver", "worker"):
        manager, server, worker = None, None, None
        stop, out = ctx.Event(), ctx.Queue()
        if where == "driver":
            manager, server = _serve()
            session = server.open_session()
            target = (server.host, server.port, f"/sessions/{session.id}/v1/chat/completions", session.key)
        else:
            manager = SharedLLMInferenceManager(ScriptedEngine())
            worker = ctx.Process(target=_worker_gateway, args=(manager.client(60), out, stop))
            worker.start()
            target = out.get(timeout=120)
        try:
            child = ctx.Process(target=_http_calls, args=(*target, calls, out))
            cpu0 = _cpu_s()
            child.start()
            times = out.get(timeout=900)
            cpu = _cpu_s() - cpu0
            child.join()
        finally:
            stop.set()
            if worker is not None:
                worker.join(60)
            if server is not None:
                server.close()
            manager.close()
        result[where] = {"median_ms": round(statistics.median(times) * 1e3, 3),
                         "driver_cpu_ms_per_call": round(cpu / calls * 1e3, 3)}
    return result


def _malformed(host: str, port: int, path: str, key: str, n: int, out: Any) -> None:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    bodies = [b"{not json", json.dumps({"messages": "hi"}).encode(),
              json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(),
              json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
              json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 3}).encode(),
              json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
              b"[" * 5000, json.dumps({"messages": [{"role": "user", "content": "x" * 9_000_000}]}).encode()]
    statuses: dict[int, int] = {}
    for i in range(n):
        body = bodies[i % len(bodies)]
        try:
            status, _ = _post(conn, path, body, key if i % 11 else None)
        except (ConnectionError, http.client.HTTPException):  # a refused oversized body closes the connection
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=30)
            status = -1
        statuses[status] = statuses.get(status, 0) + 1
        if status in (413, -1):
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=30)
    out.put(statuses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--engine-ms", type=float, default=20.0)
    parser.add_argument("--malformed", type=int, default=10000)
    args = parser.parse_args()
    print(json.dumps({"overhead": overhead(args.calls), "coalescing": coalescing(args.sessions, args.engine_ms),
                      "placement": placement(args.calls), "malformed": malformed(args.malformed)}, indent=1))


def _serve(engine_s: float = 0.0) -> tuple[Any, Any]:
    from ragen.gateway.gateway import Gateway
    from ragen.gateway.link import ManagerLink
    from ragen.gateway.server import GatewayServer
    from ragen.llm.scripted import ScriptedEngine
    from ragen.llm.types import SamplingParams
    from ragen.serving.server import SharedLLMInferenceManager

    manager = SharedLLMInferenceManager(ScriptedEngine(base_s=engine_s))
    return manager, GatewayServer(Gateway(ManagerLink.of(manager, timeout_s=60), SamplingParams(max_tokens=64)))


def overhead(calls: int) -> dict[str, Any]:
    from ragen.llm.types import GenerationRequest, SamplingParams

    manager, server = _serve()
    try:
        session = server.open_session()
        ids = server.gateway.link.chat.full(MESSAGES)
        request = GenerationRequest(messages=MESSAGES, prompt_token_ids=ids)
        out = mp.get_context("spawn").Queue()
        child = mp.get_context("spawn").Process(target=_overhead_client, args=(
            manager.client(30), request, SamplingParams(max_tokens=64), server.host, server.port,
            f"/sessions/{session.id}/v1/chat/completions", session.key, server.base_url(session), calls, out))
        child.start()
        times = out.get(timeout=600)
        child.join()
    finally:
        server.close()
        manager.close()
    result = {name: {"median_ms": round(statistics.median(t) * 1e3, 3),
                     "p90_ms": round(statistics.quantiles(t, n=10)[-1] * 1e3, 3), "calls": len(t)}
              for name, t in times.items()}
    result["gateway_added_ms"] = round(result["gateway_http"]["median_ms"] - result["worker"]["median_ms"], 3)
    return result


def coalescing(sessions: int, engine_ms: float) -> dict[str, Any]:
    manager, server = _serve(engine_ms / 1e3)
    try:
        opened = [server.open_session() for _ in range(sessions)]
        pairs = [(f"/sessions/{s.id}/v1/chat/completions", s.key) for s in opened]
        before = len(manager.stats.batch_sizes)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        children = [ctx.Process(target=_chatters, args=(server.host, server.port, pairs[i::2], 8, 2, out))
                    for i in range(2)]
        for c in children:
            c.start()
        got = [out.get(timeout=900) for _ in children]
        walls, errors = [w for w, _ in got], [e for _, es in got for e in es]
        for c in children:
            c.join()
        sizes = manager.stats.batch_sizes[before:]
        starts = [start for start, _ in manager.stats.call_spans[before:]]
        offset = time.time() - time.monotonic()  # records are stamped in epoch seconds, calls in monotonic ones
        calls = [(r.started_at - offset, r.started_at - offset + r.total_s) for s in opened for r in s.records]
    finally:
        server.close()
        manager.close()
    # the gateway's calls waiting (read, not yet answered) as each engine call starts
    waiting = [sum(a <= t < b for a, b in calls) for t in starts]
    mean, mean_waiting = statistics.fmean(sizes), statistics.fmean(waiting)
    return {"sessions": sessions, "engine_ms": engine_ms, "engine_calls": len(sizes), "calls": sum(sizes),
            "mean_batch": round(mean, 2), "mean_waiting_at_call_start": round(mean_waiting, 2),
            "mean_batch_over_waiting": round(mean / mean_waiting, 3), "wall_s": round(max(walls), 2),
            "errors": errors[:5], "failed_sessions": len(errors)}


def malformed(n: int) -> dict[str, Any]:
    manager, server = _serve()
    try:
        session = server.open_session()
        path = f"/sessions/{session.id}/v1/chat/completions"
        ctx = mp.get_context("spawn")

        def run(count: int) -> dict[int, int]:
            out = ctx.Queue()
            child = ctx.Process(target=_malformed, args=(server.host, server.port, path, session.key, count, out))
            child.start()
            got = out.get(timeout=900)
            child.join()
            return got

        run(max(1, n // 10))  # warm: every kind of refusal seen once
        gc.collect()
        rss_before = _rss_mb()
        statuses = run(n)
        gc.collect()
        rss_after = _rss_mb()
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        good, _ = _post(conn, path, json.dumps({"model": "m", "messages": MESSAGES}).encode(), session.key)
    finally:
        server.close()
        manager.close()
    return {"requests": n, "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(rss_after, 1), "good_call_after": good,
            "pid": os.getpid()}


if __name__ == "__main__":
    main()

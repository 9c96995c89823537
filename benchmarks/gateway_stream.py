"""The gateway's time to the first streamed byte: a streamed chat call, timed as a client sees it.

    python benchmarks/gateway_stream.py [--engine scripted|continuous|hf] [--calls 20] [--max-tokens 64]

Serves one engine through the shared manager and the gateway, in this process, and
makes ``--calls`` streamed chat calls one after another over HTTP (``http.client``,
one session each), each timed from its request's send to: the first event (the role
chunk, sent before the engine answers), the first content byte, and ``data: [DONE]``.
Prints the median of each. Engines: ``scripted`` (the batch engine, timed as a GPU's
call: ``per_token_s`` 2 ms a token; its answer told in 4 parts), ``continuous`` (the
scripted engine that batches continuously: decode steps of 4 ms, 64 steps an answer,
told in 4 parts at their steps) and ``hf`` (the tiny random model built in a temporary
folder, on CPU, told token by token).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragen.gateway.gateway import Gateway  # noqa: E402
from ragen.gateway.link import ManagerLink  # noqa: E402
from ragen.gateway.server import GatewayServer  # noqa: E402
from ragen.llm.scripted import ScriptedEngine, ScriptedStreamingEngine  # noqa: E402
from ragen.llm.types import SamplingParams  # noqa: E402
from ragen.serving.server import SharedLLMInferenceManager  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are a helper. Available actions: Up, Down, Left, Right."},
            {"role": "user", "content": "Go."}]


def build(name: str):
    if name == "scripted":
        return ScriptedEngine(per_token_s=0.002)
    if name == "continuous":
        return ScriptedStreamingEngine(continuous_batching={"step_s": 0.004, "tokens_median": 64,
                                                            "tokens_sigma": 0.0})
    from ragen.llm import make_engine
    from ragen.llm.tiny_model import build_tiny_model

    path = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    return make_engine({"name": "hf", "device": "cpu"}, path)


def timed_call(server: GatewayServer, index: int) -> tuple[float, float, float]:
    """One streamed call: seconds to its first event, its first content byte and its end."""
    session = server.open_session(seed=index, env_id=index)
    body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True}).encode()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    t0 = time.perf_counter()
    conn.request("POST", f"/sessions/{session.id}/v1/chat/completions", body,
                 {"Authorization": f"Bearer {session.key}", "Content-Type": "application/json"})
    response = conn.getresponse()
    first = content = None
    for line in response:
        if not line.startswith(b"data: "):
            continue
        now = time.perf_counter() - t0
        first = first if first is not None else now
        if line.strip() == b"data: [DONE]":
            break
        choices = json.loads(line[6:]).get("choices") or [{}]
        if content is None and choices[0].get("delta", {}).get("content"):
            content = now
    end = time.perf_counter() - t0
    conn.close()
    return first or end, content if content is not None else end, end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("scripted", "continuous", "hf"), default="scripted")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    engine = build(args.engine)
    manager = SharedLLMInferenceManager(engine)
    server = GatewayServer(Gateway(ManagerLink.of(manager), SamplingParams(max_tokens=args.max_tokens)))
    try:
        timed_call(server, -1)  # warm up
        times = [timed_call(server, i) for i in range(args.calls)]
    finally:
        server.close()
        manager.close()
        engine.close()
    first, content, end = (statistics.median(t[k] for t in times) * 1e3 for k in range(3))
    print(f"{args.engine}: {args.calls} streamed calls, median ms: first event {first:.1f}, "
          f"first content byte {content:.1f}, [DONE] {end:.1f}")


if __name__ == "__main__":
    main()

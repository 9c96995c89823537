"""Serve the configured engine as an OpenAI-compatible gateway, without a rollout (``python -m ragen.tools.gateway``).

    python -m ragen.tools.gateway                                  # config/base.yaml: hf, the default model
    python -m ragen.tools.gateway engine=vllm model_path=Qwen/Qwen2.5-1.5B-Instruct gateway.port=8401
    python -m ragen.tools.gateway --record runs/gateway engine=scripted

Builds the engine of a config (Hydra's ``--config-name``, default ``base``, with
overrides) and its ``SharedLLMInferenceManager`` as a rollout does, and serves
them as the gateway (``ragen.gateway``) at ``gateway.host:gateway.port`` (8400
in config/base.yaml), sampling as the rollout does (``ctx_manager.generation``,
seeds from ``seed.train``). Once it listens it opens a first session and prints
it on stdout as two lines a shell can use, ``OPENAI_BASE_URL=...`` and
``OPENAI_API_KEY=...``; on stderr it says how to open more, ``POST /sessions``
with the server's key: the one in the environment variable ``gateway.key_env``
names (``RAGEN_GATEWAY_KEY``) or, where that is unset, a new one, printed once
(a host beyond loopback needs the variable set). ``--record DIR`` writes each
session's calls to ``DIR/<session id>.jsonl`` as it closes or expires
(``ragen.gateway.recording``). It serves until SIGINT or SIGTERM, then stops
taking requests, closes the manager and the engine, and closes (and writes)
every session still open. Exit status 0; 1 where a session's file could not be written; 2 for a
bad config (found before any model loads) or a port in use.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ragen.config_files import compose
from ragen.config_reader import read, to_plain
from ragen.env.keys import export_line, server_key
from ragen.errors import ConfigError, RagenError
from ragen.gateway.gateway import Gateway, GatewaySettings
from ragen.gateway.link import ManagerLink
from ragen.gateway.recording import SessionRecorder
from ragen.gateway.server import GatewayServer
from ragen.gateway.session import Session, Sessions
from ragen.llm import check_engine_config, make_engine
from ragen.llm.types import Engine
from ragen.rollout.backends import make_serving
from ragen.rollout.proxy import AgentSetup
from ragen.trainer.config import check_top_level
from ragen.utils import closed_on_failure, is_loopback_host

__all__ = ["GatewayRun", "ServedGateway", "check_config", "main"]

DRAIN_S = 5.0  # at exit, how long calls in flight get to end before their sessions are written as they stand


@dataclass(frozen=True)
class GatewayRun:
    """A gateway's config, checked before any model loads: the ``gateway`` section, the rollout's
    sections (sampling, the manager's batches and address), the engine's, and the server's key."""

    settings: GatewaySettings
    setup: AgentSetup
    engine_cfg: dict[str, Any]
    model_path: str | None
    key: str = field(repr=False)  # the server's: it opens sessions
    key_generated: bool  # a new key (the variable was unset): printed once


def check_config(cfg: Mapping[str, Any]) -> GatewayRun:
    """Every check of ``cfg`` that needs no model; ``ConfigError`` (a ValueError) naming the key at fault."""
    plain = to_plain(cfg)
    check_top_level(plain)
    settings = read(GatewaySettings, plain.get("gateway"), "gateway")
    setup = AgentSetup.from_config(plain)
    engine_cfg = dict(plain.get("engine") or {})
    check_engine_config(engine_cfg)
    key, generated = server_key(settings.key_env)
    if generated and not is_loopback_host(settings.host):
        raise ConfigError(f"gateway.host={settings.host!r} is beyond this machine: set the server's key in the "
                          f"environment variable {settings.key_env} (gateway.key_env) so that strangers cannot "
                          "open sessions")
    return GatewayRun(settings, setup, engine_cfg, plain.get("model_path"), key, generated)


class ServedGateway:
    """``engine`` served as the gateway ``run`` describes: its manager, the gateway's sessions (each
    written to ``record`` as it closes, where given) and its HTTP server, listening once built.
    ``close`` stops them; the engine stays the caller's."""

    def __init__(self, run: GatewayRun, engine: Engine, record: str | Path | None = None) -> None:
        s = run.settings
        self.manager = make_serving(run.setup.agent_proxy, engine, run.setup.llm_server)
        with closed_on_failure(self.manager.close):
            link = ManagerLink.of(self.manager, s.call_timeout_s, s.served_name)
            self.recorder = SessionRecorder(record) if record is not None else None
            self.sessions = Sessions(link.chat, s.max_sessions, s.session_ttl_s, on_close=self.recorder)
            gateway = Gateway(link, run.setup.loop.sampling, s, self.sessions)
            try:
                self.server = GatewayServer(gateway, s.host, s.port, run.key)
            except OSError as exc:  # the port is taken
                raise OSError(f"gateway.port={s.port}: cannot listen on {s.host}:{s.port}: "
                              f"{exc.strerror or exc}") from None

    @property
    def root(self) -> str:
        return f"http://{self.server.host}:{self.server.port}"

    def serve(self, stop: threading.Event) -> None:
        """Serves until ``stop`` is set, closing the sessions idle past ``gateway.session_ttl_s`` as it goes."""
        ttl = self.sessions.ttl_s
        sweep = min(max(ttl / 4, 0.05), 5.0) if ttl else None
        while not stop.wait(sweep):
            self.sessions.expire()

    def close(self) -> None:
        """Stops taking requests, then the manager (a call still waiting for the engine ends in error),
        then closes every open session, each written where recorded."""
        self.server.close()
        self.manager.close()
        deadline = time.monotonic() + DRAIN_S
        while any(s.in_flight for s in self.sessions.all()) and time.monotonic() < deadline:
            time.sleep(0.02)
        for session in self.sessions.all():
            self.sessions.close(session.id)


def shell_lines(served: ServedGateway, session: Session) -> str:
    """The two lines that give a client ``session``: its base URL and its key."""
    return f"OPENAI_BASE_URL={served.server.base_url(session)}\nOPENAI_API_KEY={session.key}"


def how_to_open_more(served: ServedGateway, run: GatewayRun) -> str:
    """What stderr says once the gateway listens: more sessions, the key, recording, stopping."""
    lines = [f"gateway: serving {served.server.gateway.link.served_name!r} at {served.root}; the lines on stdout "
             "are a first session's"]
    if run.key_generated:
        lines.append(export_line(run.settings.key_env, run.key))
    lines += [f"more sessions: curl -s -X POST -H \"Authorization: Bearer ${run.settings.key_env}\" "
              f"{served.root}/sessions   # -> {{\"id\", \"base_url\", \"api_key\"}}; DELETE /sessions/<id> closes one"]
    if served.recorder is not None:
        lines.append(f"recording each session's calls to {served.recorder.directory}/<session id>.jsonl as it closes")
    lines.append("Ctrl-C stops (every open session is closed first)")
    return "\n".join(lines)


def _serve(run: GatewayRun, engine: Engine, record: str | None) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    served = ServedGateway(run, engine, record)
    try:
        first = served.sessions.open()
        print(shell_lines(served, first), flush=True)
        print(how_to_open_more(served, run), file=sys.stderr, flush=True)
        served.serve(stop)
    finally:
        served.close()
    recorder = served.recorder
    if recorder is None:
        print("gateway: stopped", file=sys.stderr, flush=True)
        return 0
    failed = f" ({recorder.failed} could not be: see the errors above)" if recorder.failed else ""
    print(f"gateway: stopped; {recorder.written} sessions written to {recorder.directory}{failed}", file=sys.stderr,
          flush=True)
    return 1 if recorder.failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragen.tools.gateway", description=__doc__.split("\n\n")[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", default="base", help="a config in config/ (default: base)")
    parser.add_argument("--record", metavar="DIR",
                        help="write each session's calls to DIR/<session id>.jsonl as JSON lines when it closes")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. engine=vllm gateway.port=8401")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from hydra.errors import HydraException

    try:
        run = check_config(compose(args.config_name, args.overrides))
        if args.record is not None:
            Path(args.record).mkdir(parents=True, exist_ok=True)
    except (ValueError, HydraException, OSError) as exc:  # Hydra's: an override of a key the config does not have
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = make_engine(run.engine_cfg, run.model_path)
    try:
        return _serve(run, engine, args.record)
    except (ValueError, OSError, RagenError) as exc:  # a port in use, an engine without a tokenizer
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.close()


if __name__ == "__main__":
    raise SystemExit(main())

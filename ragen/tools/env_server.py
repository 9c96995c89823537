"""Serve envs over HTTP (``python -m ragen.tools.env_server``).

    python -m ragen.tools.env_server --tags SimpleSokoban,LargerSokoban --port 8101
    python -m ragen.tools.env_server --tags HeavySokoban --port 8101 \\
        --config-name base-parallel benchmark=env_bound_heavy

Serves the ``custom_envs`` tags of a config (Hydra's ``--config-name``, default
``base``, with overrides), each as its own env per session at
``http://host:port/<tag>/ws`` (OpenEnv's WebSocket protocol); a rollout plays
them with ``env_type: remote`` (docs/envs.md). Every session needs the
server's key, on loopback too: the one in the environment variable
``--key-env`` names (``RAGEN_ENV_KEY``), or, where that is unset, a new one.
Prints ``serving <tags> at <url>`` once it listens, then, for a new key, the
line that gives it to a client (``export RAGEN_ENV_KEY=...``); ends on SIGINT
or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Sequence

from ragen.config_files import compose
from ragen.env import make_env
from ragen.env.background import serve_until_stop_signal
from ragen.env.keys import ENV_SERVER_KEY_ENV, export_line, server_key
from ragen.env.remote.server import DEFAULT_MAX_SEND_QUEUE_BYTES, EnvServer
from ragen.rollout.envs import tag_spec

__all__ = ["main", "makers_of"]


def makers_of(tags: Sequence[str], custom_envs: Any) -> dict[str, Any]:
    """tag -> a function making a new env of it, each tag's config checked now (ValueError naming it)."""
    makers = {}
    for tag in tags:
        spec = tag_spec(tag, custom_envs)
        if spec["env_type"] == "remote":
            raise ValueError(f"custom_envs.{tag} is a remote env: an env server serves envs it makes itself")
        makers[tag] = _Maker(tag, spec["env_type"], spec["env_config"], spec["config_type"])
    return makers


class _Maker:
    """A new env of one tag per call."""

    def __init__(self, tag: str, env_type: str, env_config: Any, config_type: str | None) -> None:
        self.tag, self.env_type, self.env_config, self.config_type = tag, env_type, env_config, config_type

    def __call__(self) -> Any:
        return make_env(self.env_type, self.env_config, config_type=self.config_type, tag=self.tag)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragen.tools.env_server",
                                     description="Serve the envs of custom_envs tags over HTTP (OpenEnv's protocol).")
    parser.add_argument("--tags", required=True, help="the custom_envs tags to serve, comma separated")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8101, help="port to listen on (0: a free one; default 8101)")
    parser.add_argument("--config-name", default="base", help="a config in config/ (default: base)")
    parser.add_argument("--key-env", default=ENV_SERVER_KEY_ENV,
                        help=f"environment variable holding the key clients send (default {ENV_SERVER_KEY_ENV}); "
                             "unset: a new key, printed once")
    parser.add_argument("--max-sessions", type=int, default=256, help="sessions open at once (default 256)")
    parser.add_argument("--max-message-bytes", type=int, default=1024 * 1024,
                        help="largest request taken (default 1 MiB)")
    parser.add_argument("--idle-timeout-s", type=float, default=300.0,
                        help="a session without a message this long is closed (default 300)")
    parser.add_argument("--max-send-queue-bytes", type=int, default=DEFAULT_MAX_SEND_QUEUE_BYTES,
                        help="answers waiting for one client past this drop it: a client that does not read "
                             "(default 4 MiB)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. custom_envs.SimpleSokoban.env_config.dim_x=8")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tags = [t.strip() for t in args.tags.split(",") if t.strip()]
    if not tags:
        parser.error("--tags names no tag")
    for flag, value in (("--max-sessions", args.max_sessions), ("--max-message-bytes", args.max_message_bytes),
                        ("--idle-timeout-s", args.idle_timeout_s),
                        ("--max-send-queue-bytes", args.max_send_queue_bytes)):
        if value <= 0:
            parser.error(f"{flag} must be > 0, got {value}")
    key, generated = server_key(args.key_env)
    try:
        makers = makers_of(tags, compose(args.config_name, args.overrides).get("custom_envs") or {})
        server = EnvServer(makers, args.host, args.port, key=key, max_sessions=args.max_sessions,
                           max_message_bytes=args.max_message_bytes, idle_timeout_s=args.idle_timeout_s,
                           max_send_queue_bytes=args.max_send_queue_bytes)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve_until_stop_signal(server, ",".join(tags), lambda: f"{server.sessions_served} sessions",
                                   then=export_line(args.key_env, key) if generated else None)


if __name__ == "__main__":
    raise SystemExit(main())

"""Serve a corpus for search envs (``python -m ragen.tools.retrieval_server``).

    python -m ragen.tools.retrieval_server --port 8000                  # the shipped corpus
    python -m ragen.tools.retrieval_server --corpus corpus.jsonl --port 8000
    python -m ragen.tools.retrieval_server --filler 100000 --port 0     # the shipped corpus in 100k more documents

BM25 over the corpus (JSON lines ``{"id", "contents"}``), behind RAGEN's
``/retrieve`` and ``/health`` API (``ragen/env/search/server.py``). A search
needs the server's key, on loopback too: the one in the environment variable
``--key-env`` names (``RAGEN_RETRIEVAL_KEY``), or, where that is unset, a new
one. Prints ``serving <N> documents at <url>`` once it listens, then, for a
new key, the line that gives it to a client (``export
RAGEN_RETRIEVAL_KEY=...``); ends on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

from ragen.env.background import serve_until_stop_signal
from ragen.env.keys import RETRIEVAL_KEY_ENV, export_line, server_key
from ragen.env.search.corpus import load_corpus, shipped_corpus
from ragen.env.search.server import RetrievalServer

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragen.tools.retrieval_server",
                                     description="BM25 retrieval over a corpus, behind RAGEN's /retrieve API.")
    parser.add_argument("--corpus", type=Path, default=None,
                        help="a JSON-lines corpus ({\"id\", \"contents\"} a line); default: the shipped one")
    parser.add_argument("--filler", type=int, default=0,
                        help="documents added to the shipped corpus that answer nothing (a corpus of a real size)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one; default 8000)")
    parser.add_argument("--max-connections", type=int, default=None,
                        help="connections served at once, past them HTTP 503 (default: 256, or half the open-files "
                             "limit where that is fewer)")
    parser.add_argument("--key-env", default=RETRIEVAL_KEY_ENV,
                        help=f"environment variable holding the key clients send (default {RETRIEVAL_KEY_ENV}); "
                             "unset: a new key, printed once")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.filler < 0:
        parser.error(f"--filler must be >= 0, got {args.filler}")
    if args.corpus is not None and args.filler:
        parser.error("--filler adds to the shipped corpus; a --corpus file is served as it is")
    if args.max_connections is not None and args.max_connections < 1:
        parser.error(f"--max-connections must be >= 1, got {args.max_connections}")
    key, generated = server_key(args.key_env)
    try:
        docs = load_corpus(args.corpus) if args.corpus is not None else shipped_corpus(args.filler)
        server = RetrievalServer(docs, args.host, args.port, key=key, max_connections=args.max_connections)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve_until_stop_signal(server, f"{len(docs)} documents", lambda: f"{server.requests} searches",
                                   then=export_line(args.key_env, key) if generated else None)


if __name__ == "__main__":
    raise SystemExit(main())

"""Serve a corpus for search envs (``python -m ragen.tools.retrieval_server``).

    python -m ragen.tools.retrieval_server --port 8000                  # the shipped corpus
    python -m ragen.tools.retrieval_server --corpus corpus.jsonl --port 8000
    python -m ragen.tools.retrieval_server --filler 100000 --port 0     # the shipped corpus in 100k more documents

BM25 over the corpus (JSON lines ``{"id", "contents"}``), behind RAGEN's
``/retrieve`` and ``/health`` API (``ragen/env/search/server.py``). Prints
``serving <N> documents at <url>`` once it listens; ends on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

from ragen.env.search.corpus import load_corpus, shipped_corpus
from ragen.env.search.server import RetrievalServer
from ragen.env.background import serve_until_stop_signal
from ragen.utils import is_loopback_host

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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.filler < 0:
        parser.error(f"--filler must be >= 0, got {args.filler}")
    if args.corpus is not None and args.filler:
        parser.error("--filler adds to the shipped corpus; a --corpus file is served as it is")
    if not is_loopback_host(args.host):
        logging.warning("listening on %s: the retrieval server has no key; firewall its port", args.host)
    try:
        docs = load_corpus(args.corpus) if args.corpus is not None else shipped_corpus(args.filler)
        server = RetrievalServer(docs, args.host, args.port)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve_until_stop_signal(server, f"{len(docs)} documents", lambda: f"{server.requests} searches")


if __name__ == "__main__":
    raise SystemExit(main())

"""``SessionRecorder``: each session's calls written as JSON lines once it closes; ``read_session`` reads them back.

A session's file, ``<directory>/<session id>.jsonl``, holds a header line, then
one line per call, ``CallRecord.to_dict()``, in call order. The header says
which session it is and what came of it: ``{"kind": "ragen.gateway.session",
"session", "seed", "env_id", "calls", "metrics", "closed_at"}`` (``calls``: how
many lines follow; ``metrics``: ``Session.metrics()``). A call's record holds
only what it adds to its segment (its prompt ids and messages; its segment's
tools on the segment's first call; its answer), so ``record.prompt_ids(records, i)``
rebuilds any call's whole prompt from the records read back. A file written
before records kept messages reads back with none. The session's key is never
written. A file is written whole under a temporary name and then renamed, so
a reader never sees half of one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragen.gateway.record import CallRecord
from ragen.gateway.session import Session

logger = logging.getLogger(__name__)

KIND = "ragen.gateway.session"  # the header's "kind"


class SessionRecorder:
    """Writes each session that closes (or expires) to ``directory``: give it to ``Sessions``
    as ``on_close``. A file it cannot write is logged and counted in ``failed``, never raised,
    so that closing the other sessions goes on."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.written = 0
        self.failed = 0
        self._lock = threading.Lock()

    def path(self, session_id: str) -> Path:
        return self.directory / f"{session_id}.jsonl"

    def __call__(self, session: Session) -> None:
        path = self.path(session.id)
        with session.lock:  # a call that is still in flight is written as it stands
            records = list(session.records)
        header = {"kind": KIND, "session": session.id, "seed": session.seed, "env_id": session.env_id,
                  "calls": len(records), "metrics": session.metrics(), "closed_at": time.time()}
        lines = [json.dumps(header)] + [json.dumps(r.to_dict()) for r in records]
        staging = path.with_name(path.name + ".tmp")
        try:
            staging.write_text("\n".join(lines) + "\n")
            os.replace(staging, path)
        except OSError as exc:  # a full disk or a removed folder: said, and the other sessions still written
            logger.error("gateway: session %s's calls could not be written to %s: %s", session.id, path, exc)
            with self._lock:
                self.failed += 1
            return
        with self._lock:
            self.written += 1


@dataclass(frozen=True)
class SessionLog:
    """One session's file read back: its header and its calls' records."""

    header: dict[str, Any]
    records: list[CallRecord]


def read_session(path: str | os.PathLike) -> SessionLog:
    """The session file at ``path``; ValueError naming the file and line when it is not one
    (no header, a truncated file, a line that is not a call record)."""
    lines = Path(path).read_text().splitlines()
    if not lines:
        raise ValueError(f"{path}: empty, not a gateway session's file")
    try:
        header = json.loads(lines[0])
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("kind") != KIND:
        raise ValueError(f"{path} line 1: not a gateway session's header (kind {KIND!r})")
    records = []
    for number, line in enumerate(lines[1:], start=2):
        try:
            records.append(CallRecord.from_dict(json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path} line {number}: not a call record: {exc}") from None
    if len(records) != header.get("calls"):
        raise ValueError(f"{path}: the header says {header.get('calls')} calls, the file holds {len(records)}")
    return SessionLog(header, records)

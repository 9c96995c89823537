"""The viewer: a rollout dump as one self-contained HTML page.

``python -m ragen.tools.viewer DUMP.jsonl [-o out.html] [--metrics metrics.jsonl]``
writes the page (by default beside the dump, with ``.html`` for its suffix).

- Page (``page.py``): the episodes of one dump: a table filtered by tag,
  success and stop reason, and each episode turn by turn: the state shown, the
  prompt, the model's ``<think>`` and ``<answer>``, the actions parsed and
  executed, each step's reward and the state after it, the prompt tokens
  added and the tokens sampled; failed envs' errors
  highlighted. An agent episode (``agent.py``) call by call: where each
  segment starts and why, the messages each call added, its answer and tool
  calls, its trained tokens. Inline CSS and JS, no network.
- Grid (``grid.py``): a grid env's text observation (Sokoban, FrozenLake, or
  any env whose config has a ``grid_vocab``) as cells with a kind each (wall,
  box, target, hole, goal, player, ...), with a legend of them; other envs are
  shown as text.
- Curve (``curve.py``): the run's ``metrics.jsonl`` (beside the dump, in the
  folder above, or given) as SVG line charts of ``val/success``,
  ``train/reward`` and ``train/success`` against step, with a note on what
  reward and success measure (and, for Bandit, why they part).

``render_html(records, metrics=None) -> str`` builds the page from
``read_dump``'s records and metrics rows; ``write_viewer(dump_path, out=None,
metrics_path=None) -> Path`` reads, renders and writes it. Unreadable inputs
raise ``DumpError`` (the dump) or ``ViewerError`` (the metrics), naming the file
and line.

A dump is data: the viewer builds no env, and builds an env's config class
(for its ``grid_vocab``) only when the user's setup names its type
(``env_types``: ``ragen.env.allowed``; default: the registered names). Any
other type is never imported: its episodes are drawn with the default symbols,
with a warning saying how to allow it (``--config``, ``--allow-env-type``). An
agent tag's episode (``env_type: agent``) has no env and no config: its calls
are drawn, with no warning.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ragen.env.allowed import AllowedEnvTypes
from ragen.rollout.dump import DumpError, read_dump
from ragen.viewer.curve import ViewerError, find_metrics, read_curve
from ragen.viewer.page import render_html

__all__ = ["DumpError", "ViewerError", "default_output", "render_html", "write_viewer"]

logger = logging.getLogger(__name__)


def default_output(dump_path: str | os.PathLike) -> Path:
    """``step_000001.jsonl`` (or ``.jsonl.gz``) -> ``step_000001.html`` beside it."""
    path = Path(dump_path)
    name = path.name
    for suffix in (".jsonl.gz", ".jsonl", ".gz"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return path.with_name(name + ".html")


def write_viewer(dump_path: str | os.PathLike, out: str | os.PathLike | None = None,
                 metrics_path: str | os.PathLike | None = None, env_types: AllowedEnvTypes | None = None) -> Path:
    """Write the page of the dump at ``dump_path`` to ``out`` and return its path.

    Metrics: ``metrics_path`` when given (an unreadable one raises
    ``ViewerError``); else a ``metrics.jsonl`` beside the dump or in the folder
    above, left out with a warning when it cannot be read."""
    records = read_dump(dump_path)
    metrics = None
    if metrics_path is not None:
        metrics = read_curve(metrics_path)
    elif (found := find_metrics(dump_path)) is not None:
        try:
            metrics = read_curve(found)
        except ViewerError as exc:  # not asked for: show the episodes anyway
            logger.warning("learning curve left out: %s", exc)
    out = Path(out) if out is not None else default_output(dump_path)
    page = render_html(records, metrics, title=f"ragen rollout: {Path(dump_path).name}", env_types=env_types)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    logger.info("wrote %s (%d episodes, %d bytes)", out, len(records), len(page))
    return out

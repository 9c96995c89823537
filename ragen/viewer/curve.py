"""The learning curve: ``metrics.jsonl`` as inline SVG.

- ``read_curve(path)``: the rows of a training run's ``metrics.jsonl`` (one JSON
  object with a ``step`` per line), strictly: a file that is not one raises
  ``ViewerError`` naming the file and line. Only a last line cut off while
  written (the run is still going) is left out. Unlike the trainer's lenient
  ``read_metrics`` (which resumes past a crash), the viewer says what is wrong.
- ``find_metrics(dump_path)``: the ``metrics.jsonl`` beside a dump (its folder
  or the folder above), or None.
- ``curve_svg(rows)``: one small line chart per metric of ``CURVE_METRICS``
  that the rows hold, against step; "" when they hold none.
- ``curve_notes(configs)``: what reward and success measure, said wherever a
  curve shows both (here and the trainer's ``learning_curve.png``): they can
  move apart, and an env whose two measure different things says how
  (``BaseEnvConfig.reward_and_success``: Bandit's).
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any, Iterable

from ragen.errors import RagenError

CURVE_METRICS = ("val/success", "train/reward", "train/success")
METRICS_FILE = "metrics.jsonl"
_W, _H, _PAD_L, _PAD_R, _PAD_T, _PAD_B = 420, 200, 52, 12, 24, 30


REWARD_AND_SUCCESS = ("reward is what the env paid over an episode, format penalties included; success is "
                      "whether the env counts the episode as solved. They measure different things and can move apart.")


def curve_notes(configs: Iterable[Any]) -> list[str]:
    """``REWARD_AND_SUCCESS``, then what each env config (None: unknown) says of its own two, once each."""
    notes = [REWARD_AND_SUCCESS]
    for config in configs:
        note = config.reward_and_success() if hasattr(config, "reward_and_success") else None
        if note and note not in notes:
            notes.append(note)
    return notes


class ViewerError(RagenError, ValueError):
    """An input the viewer cannot show; the message names the file (and line)."""


def find_metrics(dump_path: str | Path) -> Path | None:
    folder = Path(dump_path).resolve().parent
    for candidate in (folder / METRICS_FILE, folder.parent / METRICS_FILE):
        if candidate.is_file():
            return candidate
    return None


def read_curve(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise ViewerError(f"{path}: no such metrics file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ViewerError(f"{path}: not a text file ({exc.reason} at byte {exc.start}); "
                          "metrics.jsonl is JSON lines") from None
    lines = text.split("\n")
    cut = bool(lines[-1])  # no newline at the end: the last line is still being written
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if cut and number == len(lines):
                break
            raise ViewerError(f"{path} line {number}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row["step"], bool):
            raise ViewerError(f"{path} line {number}: not a metrics row (a JSON object with an integer "
                              "\"step\"); metrics.jsonl is written by train.py")
        rows.append(row)
    return rows


def series(rows: list[dict[str, Any]], name: str) -> list[tuple[int, float]]:
    """(step, value) of ``name`` where it is a finite number, in step order (the last row of a step wins)."""
    points: dict[int, float] = {}
    for row in rows:
        value = row.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            points[row["step"]] = float(value)
    return sorted(points.items())


def _number(value: float) -> str:
    """A value as shown: to four decimal places, so that float noise (8.674e-19 for rewards that
    cancel) reads 0, in at most four significant digits."""
    return f"{round(value, 4) + 0.0:.4g}"  # + 0.0: -0.0 reads 0


def curve_svg(rows: list[dict[str, Any]]) -> str:
    charts = [_chart(name, pts) for name in CURVE_METRICS if (pts := series(rows, name))]
    return "\n".join(charts)


def _chart(name: str, points: list[tuple[int, float]]) -> str:
    x0, x1 = points[0][0], points[-1][0]
    lo, hi = min(v for _, v in points), max(v for _, v in points)
    if name.endswith("success"):  # a rate: keep the 0..1 frame so runs compare by eye
        lo, hi = min(lo, 0.0), max(hi, 1.0)
    if hi == lo:
        lo, hi = lo - 1.0, hi + 1.0
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    plot_w, plot_h = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B

    def xy(step: float, value: float) -> tuple[float, float]:
        return (_PAD_L + (step - x0) / (x1 - x0) * plot_w, _PAD_T + (hi - value) / (hi - lo) * plot_h)

    coords = [xy(s, v) for s, v in points]
    poly = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
    dots = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5"><title>step {s}: {_number(v)}</title></circle>'
                   for (x, y), (s, v) in zip(coords, points))
    label = html.escape(name)
    left, bottom = _PAD_L, _PAD_T + plot_h
    return (
        f'<svg class="curve" data-metric="{label}" data-points="{len(points)}" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{label} against step">'
        f'<text x="{_W / 2:.0f}" y="15" text-anchor="middle" class="title">{label}</text>'
        f'<line x1="{left}" y1="{_PAD_T}" x2="{left}" y2="{bottom}" class="axis"/>'
        f'<line x1="{left}" y1="{bottom}" x2="{_W - _PAD_R}" y2="{bottom}" class="axis"/>'
        f'<text x="{left - 4}" y="{_PAD_T + 4}" text-anchor="end">{_number(hi)}</text>'
        f'<text x="{left - 4}" y="{bottom}" text-anchor="end">{_number(lo)}</text>'
        f'<text x="{left}" y="{bottom + 16}" text-anchor="middle">{x0}</text>'
        f'<text x="{_W - _PAD_R}" y="{bottom + 16}" text-anchor="end">{x1}</text>'
        f'<text x="{left + plot_w / 2:.0f}" y="{bottom + 26}" text-anchor="middle">step</text>'
        f'<polyline points="{poly}" class="line"/>{dots}</svg>'
    )

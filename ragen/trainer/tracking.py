"""Tracking: where a run's metrics go, and how they are read back.

- ``Tracking``: one ``log(metrics, step)`` call fans out to the backends named
  in ``trainer.logger``: ``jsonl`` (always on: one JSON object per line in
  ``<run dir>/metrics.jsonl``; resume, the learning curve and the tests read
  it), ``console`` (a one-line summary handed to a callback; the CLI prints
  it, a library user gets it through ``logging``), and ``tensorboard`` /
  ``wandb`` when installed and asked for.
- ``summary_line``: the one-line step summary (reward, success, response
  length, timings, policy version).
- ``read_metrics`` / ``truncate_metrics``: read the jsonl log; drop the rows
  of steps after a checkpoint on resume, so every step is logged once.
- ``plot_learning_curve``: a PNG of validation success / reward and training
  reward / success against the step, with what reward and success measure
  written under it.

Metric names are stable (CleanRL's habit): ``train/...`` and ``val/...`` for
rollouts, ``actor/...`` for the update, ``timing/...``, ``policy_version``
and ``step``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "learning_curve.png"


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    return value


class Tracking:
    """Where a run's metrics go: ``log(metrics, step)`` appends to ``metrics.jsonl`` and to tensorboard /
    wandb when ``trainer.logger`` names them; ``summary(line)`` goes to the console when it is named."""

    def __init__(self, run_dir: str | os.PathLike, backends: Sequence[str], project: str, experiment: str,
                 config: Mapping[str, Any] | None = None,
                 console: Callable[[str], None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.backends = list(backends)
        self.path = self.run_dir / METRICS_FILE
        self.console = console
        self._tb = None
        self._wandb = None
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in self.backends:
            import wandb

            self._wandb = wandb.init(project=project, name=experiment, config=dict(config or {}),
                                     dir=str(self.run_dir), resume="allow")

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        row = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items() if k != "step"}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def summary(self, line: str) -> None:
        if "console" not in self.backends:
            return
        if self.console is not None:
            self.console(line)
        else:
            logger.info("%s", line)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    rows = []
    p = Path(path)
    if not p.is_file():
        return rows
    for line in p.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash mid-write
            logger.warning("skipping an unreadable line of %s", p)
    return rows


def truncate_metrics(path: str | os.PathLike, last_step: int) -> int:
    """Keep the rows of steps <= ``last_step`` (atomically); return how many were dropped."""
    p = Path(path)
    rows = read_metrics(p)
    kept = [r for r in rows if int(r.get("step", 0)) <= last_step]
    if len(kept) == len(rows) and p.is_file():
        return 0
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for r in kept:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    os.replace(tmp, p)
    return len(rows) - len(kept)


def _fmt(metrics: Mapping[str, Any], key: str, spec: str = ".3f") -> str | None:
    value = metrics.get(key)
    if value is None:
        return None
    return format(value, spec)


def summary_line(metrics: Mapping[str, Any], total_steps: int) -> str:
    """``step 3/20 | reward 0.125 | success 0.250 | resp_len 9.4 | val/success 0.31 | ...``"""
    parts = [f"step {metrics.get('step', '?')}/{total_steps}"]
    for label, key, spec in (
        ("reward", "train/reward", ".3f"),
        ("success", "train/success", ".3f"),
        ("resp_len", "response_length/mean", ".1f"),
        ("val/success", "val/success", ".3f"),
        ("val/reward", "val/reward", ".3f"),
        ("pg_loss", "actor/pg_loss", ".4f"),
        ("entropy", "actor/entropy", ".3f"),
        ("rollout", "timing/rollout_s", ".1f"),
        ("update", "timing/update_s", ".1f"),
        ("step", "timing/step_s", ".1f"),
    ):
        text = _fmt(metrics, key, spec)
        if text is not None:
            parts.append(f"{label} {text}{'s' if key.startswith('timing/') else ''}")
    if "policy_version" in metrics:
        parts.append(f"policy v{metrics['policy_version']}")
    return " | ".join(parts)


def plot_learning_curve(metrics_path: str | os.PathLike, out_path: str | os.PathLike, title: str = "",
                        notes: Sequence[str] = ()) -> Path:
    """Validation success and reward, and training reward and success, against the step; ``notes``
    (``ragen.viewer.curve.curve_notes``: what reward and success measure) written under them."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)

    def series(key: str) -> tuple[list[int], list[float]]:
        pts = [(int(r["step"]), float(r[key])) for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = (
        ("validation", (("val/success", "o-"), ("val/reward", "s--"))),
        ("training rollouts", (("train/reward", "-"), ("train/success", "--"))),
    )
    for ax, (panel_title, curves) in zip(axes, panels):
        for key, style in curves:
            xs, ys = series(key)
            if xs:
                ax.plot(xs, ys, style, label=key)
        ax.set_xlabel("step")
        ax.set_title(panel_title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if notes:  # under the panels, wrapped to the figure's width
        import textwrap

        text = "\n".join(textwrap.fill(note, 150) for note in notes)
        lines = text.count("\n") + 1
        fig.set_figheight(fig.get_figheight() + 0.17 * lines)
        fig.subplots_adjust(bottom=(0.17 * lines + 0.5) / fig.get_figheight())
        fig.text(0.01, 0.01, text, fontsize=7, va="bottom", ha="left", wrap=False)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

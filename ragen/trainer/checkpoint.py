"""Checkpoints: everything needed to continue a run as if it had not stopped.

A checkpoint is a folder ``<run dir>/checkpoints/global_step_<N>/`` holding

- ``state.pt``: the trainable weights (the whole model, or only the LoRA
  adapter's tensors), the optimizer state, the step, the policy version, the
  torch / numpy / python RNG states and the env state managers' state dicts
  (their rollout counters decide the next rollout's env seeds);
- ``meta.json``: the same scalars, readable by a person;
- ``lora_adapter/`` (LoRA runs): the adapter in peft's format, for use elsewhere.

*Atomic*: a checkpoint is written into a temporary folder that is renamed into
place, then ``latest_checkpointed_iteration.txt`` (verl's name) is replaced
atomically. A crash at any moment leaves the previous checkpoint intact and
findable; a half-written folder is never taken for a checkpoint.

*Findable*: ``mark_latest_run`` points ``latest`` beside a run folder at it
(``runs/ragen/bandit_grpo/latest``), so the newest of an experiment's run
folders, one per run, has a path that does not change. The trainer marks a
run once it has written its first step: a run killed before that leaves
``latest`` where it was.

A checkpoint damaged afterwards (a ``state.pt`` cut short by a copy or a full
disk, a ``meta.json`` that is not JSON) raises ``CheckpointError`` naming the
file and the previous checkpoint to resume from instead.

*Loaded as data*: ``state.pt`` is read with ``torch.load(weights_only=True)``
and an allow-list of the types a checkpoint holds besides tensors and plain
Python (``SAFE_TYPES``), so a crafted file cannot run code when it is loaded;
one that names any other type is refused with a ``CheckpointError``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ragen.errors import RagenError
from ragen.rollout.types import Step, StopReason, Trajectory, Turn

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
LATEST_RUN = "latest"
STATE_FILE = "state.pt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")

# What a checkpoint holds besides tensors and plain Python, each harmless to make: the trajectories of
# the groups an over-sampled rollout carries, and numpy arrays (older checkpoints hold numpy's RNG
# state as one).
_multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray  # numpy 2, numpy 1
SAFE_TYPES: list[Any] = [Trajectory, Turn, Step, StopReason,
                         _multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def rng_state() -> dict[str, Any]:
    """The torch, numpy, python (and CUDA) RNG states, as tensors and plain Python."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": (name, keys.tolist(), pos, has_gauss, cached_gaussian),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoint_root(run_dir) / f"global_step_{step}"


def mark_latest_run(run_dir: str | os.PathLike) -> Path | None:
    """Point the link ``latest`` beside ``run_dir`` at it (a relative link, swapped atomically);
    return the link, or None where there is something else of that name or links cannot be made."""
    run_dir = Path(run_dir)
    link = run_dir.parent / LATEST_RUN
    if run_dir.name == LATEST_RUN or (link.exists() and not link.is_symlink()):
        logger.warning("%s is not a link that ragen made: it is left alone, and does not name the newest run", link)
        return None
    tmp = link.with_name(f".{LATEST_RUN}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)
        os.symlink(run_dir.name, tmp, target_is_directory=True)
        os.replace(tmp, link)
    except OSError as exc:  # a file system without links: the run folder is still printed at the end
        tmp.unlink(missing_ok=True)
        logger.warning("could not point %s at %s: %s", link, run_dir, exc)
        return None
    return link


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(run_dir: str | os.PathLike, step: int, state: dict[str, Any],
                    meta: dict[str, Any] | None = None, peft_model: Any = None,
                    max_to_keep: int | None = None) -> Path:
    """Write checkpoint ``step`` atomically; return its folder."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(run_dir, step)
    staging = Path(tempfile.mkdtemp(prefix=f".global_step_{step}.tmp-", dir=root))
    try:
        torch.save(state, staging / STATE_FILE)
        (staging / "meta.json").write_text(json.dumps({"step": step, **(meta or {})}, indent=2, sort_keys=True))
        if peft_model is not None:
            peft_model.save_pretrained(str(staging / "lora_adapter"))
        if final.exists():  # a checkpoint of the same step from an earlier attempt: replace it
            shutil.rmtree(final)
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _atomic_write_text(root / LATEST_FILE, str(step))
    if max_to_keep:
        for old in list_checkpoints(run_dir)[:-max_to_keep]:
            shutil.rmtree(step_dir(run_dir, old), ignore_errors=True)
    logger.info("saved checkpoint of step %d in %s", step, final)
    return final


def list_checkpoints(run_dir: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints, ascending."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / STATE_FILE).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def checkpoint_folder(folder: str | os.PathLike) -> tuple[Path, int]:
    """The run folder and step of a checkpoint's folder (``<run>/checkpoints/global_step_<N>``);
    CheckpointError where ``folder`` is not one."""
    folder = Path(folder)
    match = _STEP_DIR.match(folder.name)
    if not match or folder.parent.name != "checkpoints" or not (folder / STATE_FILE).is_file():
        raise CheckpointError(f"{folder} is not a checkpoint folder: one is <run folder>/checkpoints/global_step_<N>, "
                              f"holding {STATE_FILE}")
    return folder.parent.parent, int(match.group(1))


def latest_checkpoint(run_dir: str | os.PathLike) -> int | None:
    """The step named by the latest file, else the highest complete checkpoint, else None."""
    root = checkpoint_root(run_dir)
    steps = list_checkpoints(run_dir)
    try:
        named = int((root / LATEST_FILE).read_text().strip())
        if named in steps:
            return named
    except (OSError, ValueError):
        pass
    return steps[-1] if steps else None


class CheckpointError(RagenError, ValueError):
    """A checkpoint that cannot be read; the message names the file and what to do instead."""


def load_checkpoint(run_dir: str | os.PathLike, step: int) -> dict[str, Any]:
    path = step_dir(run_dir, step) / STATE_FILE
    try:
        with _allowing(SAFE_TYPES):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" not in str(exc):
            raise CheckpointError(_damaged(run_dir, step, path, exc)) from exc
        raise CheckpointError(_refused(path, exc)) from None
    except Exception as exc:  # a cut file fails in torch's zip reader or in unpickling, with varied types
        raise CheckpointError(_damaged(run_dir, step, path, exc)) from exc
    if not isinstance(state, dict):
        raise CheckpointError(_damaged(run_dir, step, path, f"it holds a {type(state).__name__}, not a state dict"))
    return state


def damaged(run_dir: str | os.PathLike, step: int, why: str) -> CheckpointError:
    """The error of checkpoint ``step``'s ``state.pt`` when an entry in it is not what a checkpoint holds
    (``why`` names it)."""
    return CheckpointError(_damaged(run_dir, step, step_dir(run_dir, step) / STATE_FILE, why))


def load_meta(run_dir: str | os.PathLike, step: int) -> dict[str, Any]:
    """Checkpoint ``step``'s ``meta.json`` (``{}`` when it has none)."""
    path = step_dir(run_dir, step) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(_damaged(run_dir, step, path, exc)) from exc
    if not isinstance(meta, dict):
        raise CheckpointError(_damaged(run_dir, step, path, f"it holds a {type(meta).__name__}, not an object"))
    return meta


def _allowing(types: list[Any]) -> Any:
    """torch's allow-list context for ``weights_only`` loads (torch >= 2.5; before it, nothing more is allowed)."""
    allow = getattr(torch.serialization, "safe_globals", None)
    return allow(types) if allow is not None else contextlib.nullcontext()


def _refused(path: Path, exc: BaseException) -> str:
    """Why a checkpoint naming something a checkpoint never holds is not loaded."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    what = found.group(1) if found else "something outside the allow-list"
    if not hasattr(torch.serialization, "safe_globals"):
        return (f"checkpoint {path} names {what}, which torch {torch.__version__} cannot allow in a safe load: "
                f"resume with torch >= 2.5")
    return (f"checkpoint {path} is refused: it names {what}, which a ragen checkpoint never holds, and loading it "
            f"could run code. It was not written by ragen's trainer, or was altered since; do not resume from it")


def _damaged(run_dir: str | os.PathLike, step: int, path: Path, why: BaseException | str) -> str:
    if isinstance(why, BaseException):
        why = f"{type(why).__name__}: {str(why).strip().splitlines()[0] if str(why).strip() else 'no detail'}"
    earlier = [s for s in list_checkpoints(run_dir) if s < step]
    folder = step_dir(run_dir, step)
    if earlier:
        advice = (f"resume from the previous checkpoint, {step_dir(run_dir, earlier[-1])}: move or delete {folder} "
                  f"and run again with trainer.resume=true trainer.default_local_dir={Path(run_dir)}")
    else:
        advice = f"there is no earlier checkpoint: delete {folder} to start the run afresh"
    return f"checkpoint {path} is truncated or corrupt ({why}); {advice}"

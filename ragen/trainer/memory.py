"""The peak memory of a training step: this process's resident set (and the GPU's allocations on a GPU).

Linux keeps a process's peak resident set (``VmHWM`` in ``/proc/self/status``) and resets it when
``5`` is written to ``/proc/self/clear_refs``; each step resets it at its start and reads it at its
end. Where that cannot be reset (another OS, a locked-down ``/proc``), the figure is the peak since
the process started (``resource.getrusage``), and ``memory/peak_rss_since_start`` says so. Worker
processes (the parallel rollout's) are not counted: the figure is the trainer's own, where the
model, its activations and the optimizer live.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
GB = 1024**3


class StepMemory:
    """``start()`` at a step's start; ``metrics()`` at its end."""

    def __init__(self) -> None:
        self.resettable = True

    def start(self) -> None:
        try:
            _CLEAR_REFS.write_text("5")  # the peak resident set starts again from the current one
        except OSError:
            self.resettable = False
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def metrics(self) -> dict[str, float]:
        out = {"memory/peak_rss_gb": self._peak_rss_bytes() / GB,
               "memory/peak_rss_since_start": float(not self.resettable)}
        if torch.cuda.is_available():
            out["memory/peak_gpu_gb"] = torch.cuda.max_memory_allocated() / GB
        return out

    def _peak_rss_bytes(self) -> int:
        if self.resettable:
            try:
                for line in _STATUS.read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024  # kB
            except (OSError, ValueError, IndexError):
                pass
            self.resettable = False
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB on Linux

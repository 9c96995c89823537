"""Where a rollout's CPU goes: the driver's threads and each worker process.

    python benchmarks/rollout_cpu.py [--preset overhead] [--rollouts 200] [--modes sequential parallel]

Runs ``--rollouts`` rollouts of the preset in each mode (after 3 untimed
warm-ups) and prints, per rollout: the wall time, the CPU time of the driver
process and of each of its threads (by thread name, summed over threads of
one name: the manager's connection threads are many), the CPU time of each
worker process, and, in parallel mode, the frames the shared manager
received. CPU times are the kernel's user + system time (``psutil``), so a
wait costs nothing and contention shows as work that took longer. Run it with
nothing else on the machine.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

ROOT = Path(__file__).resolve().parent.parent
MODES = ("sequential", "parallel")


def cpu_by_thread(process) -> collections.Counter:
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: collections.Counter = collections.Counter()
    for t in process.threads():
        out[names.get(t.id, f"thread {t.id}")] += t.user_time + t.system_time
    return out


def measure(preset: str, mode: str, rollouts: int) -> None:
    import psutil
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ragen.llm import make_engine
    from ragen.llm_agent import AgentSetup, LLMAgentProxy

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        cfg = compose(config_name="base-parallel", overrides=[f"benchmark={preset}"])
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["agent_proxy"]["use_parallel_rollout"] = mode == "parallel"
    me = psutil.Process()
    with LLMAgentProxy(AgentSetup.from_config(plain), make_engine(cfg.engine, cfg.model_path)) as proxy:
        for i in range(3):
            proxy.rollout("train", rollout_index=10_000 + i)
        workers = me.children(recursive=True)

        def reading():
            stats = proxy.shared.stats.snapshot() if proxy.shared is not None else None
            return (cpu_by_thread(me), [w.cpu_times() for w in workers], stats)

        threads0, workers0, stats0 = reading()
        t0 = time.perf_counter()
        for i in range(rollouts):
            proxy.rollout("train", rollout_index=i)
        wall = time.perf_counter() - t0
        threads1, workers1, stats1 = reading()
    per = 1000.0 / rollouts
    driver = {name: (threads1[name] - threads0.get(name, 0.0)) * per for name in threads1}
    print(f"{mode}: wall {wall * per:.1f} ms a rollout, driver CPU {sum(driver.values()):.1f} ms")
    for name, ms in sorted(driver.items(), key=lambda kv: -kv[1]):
        if ms >= 0.05:
            print(f"  driver thread {name:24} {ms:6.2f} ms")
    for w, (a, b) in zip(workers, zip(workers0, workers1)):
        ms = (b.user + b.system - a.user - a.system) * per
        if ms >= 0.05:
            print(f"  worker process {w.pid:<23} {ms:6.2f} ms")
    if stats1 is not None:
        print(f"  frames to the manager {(stats1.messages_in - stats0.messages_in) / rollouts:.1f}, "
              f"engine calls {(stats1.engine_calls - stats0.engine_calls) / rollouts:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="overhead")
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    if args.rollouts < 1:
        parser.error(f"--rollouts must be >= 1, got {args.rollouts}")
    try:
        import psutil  # noqa: F401
    except ImportError:
        parser.error("needs psutil (pip install psutil)")
    for mode in args.modes:
        measure(args.preset, mode, args.rollouts)


if __name__ == "__main__":
    main()

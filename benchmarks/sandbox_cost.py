"""What each sandbox backend adds to a run: the wall time of an empty script and of a judged submission.

    python benchmarks/sandbox_cost.py [--runs 100] [--backends none,bwrap,unshare]

For each backend that works here (``none`` is the unisolated reference), in turn, ``--runs`` times:
``run_python("pass")`` (the bare cost: wrapper, namespaces, mounts, cgroup, interpreter start, the
prelude's seccomp filter) and ``judge`` of a right solution of a shipped problem (the code env's step).
Reports the median and p90 of each in ms, and the median's excess over ``none``. Run it with nothing
else on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragen.env.code.harness import judge  # noqa: E402
from ragen.env.code.problems import problem, solutions  # noqa: E402
from ragen.env.sandbox import Limits, SandboxUnavailable, backend, run_python  # noqa: E402


def _ms(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1000, ordered[int(0.9 * (len(ordered) - 1))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--backends", default="none,bwrap,unshare")
    args = parser.parse_args()
    task = problem(3)
    right, _ = solutions(3)
    rows = {}
    for name in args.backends.split(","):
        try:
            backend(name)
        except SandboxUnavailable as exc:
            print(f"{name}: not here ({exc})")
            continue
        limits = Limits(sandbox=name)
        bare, judged = [], []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            run_python("pass", "", limits)
            t1 = time.perf_counter()
            assert judge(right, task, limits).correct
            t2 = time.perf_counter()
            bare.append(t1 - t0)
            judged.append(t2 - t1)
        rows[name] = (_ms(bare), _ms(judged))
    base = rows.get("none")
    print(f"\n{'backend':8} {'empty p50':>10} {'p90':>7} {'judged p50':>11} {'p90':>7} "
          f"{'added p50 (empty / judged)':>28}")
    for name, ((b50, b90), (j50, j90)) in rows.items():
        added = f"{b50 - base[0][0]:+.1f} / {j50 - base[1][0]:+.1f} ms" if base else "-"
        print(f"{name:8} {b50:10.1f} {b90:7.1f} {j50:11.1f} {j90:7.1f} {added:>28}")


if __name__ == "__main__":
    main()

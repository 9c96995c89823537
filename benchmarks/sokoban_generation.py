"""Benchmark of Sokoban room generation: RAGEN's generator against ours, side by side.

For each setting and seed it makes one room with each generator, in one run on
the same machine:

- **RAGEN**: RAGEN's own ``SokobanEnv.reset(seed)`` (gym-sokoban's reverse play
  under ``all_seed``, with RAGEN's retry seeds), imported from ``--ragen-src``
  (a RAGEN checkout; needs gym, gym_sokoban, omegaconf, matplotlib). Optional:
  without it the RAGEN columns read n/a.
- **ours, ragen**: ``generate_ragen_room`` (``generator: ragen``, the default),
  which makes RAGEN's room for the seed; the run checks that the rooms are
  identical to RAGEN's.
- **ours, fast**: ``generate_room`` (``generator: fast``), our own rooms.

Our generators are timed with their memo bypassed (every room from scratch).
Reported per generator: mean and p95 milliseconds per room, and the speed-up
of ours over RAGEN's (mean); per kind of room, the mean length of the shortest
solution in moves (player moves + pushes) and the share solvable within 10
actions (SimpleSokoban's action budget).

Usage::

    python benchmarks/sokoban_generation.py [--ragen-src /tmp/ragen-src] [--seeds 300] [--first-seed 0]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import types
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from ragen.env.sokoban import generate_room, solve  # noqa: E402
from ragen.env.sokoban.ragen_rooms import generate_ragen_room  # noqa: E402

# (rows, cols, boxes, search_depth): RAGEN's SimpleSokoban, LargerSokoban, and 8x8 / 2 boxes at the default depth
SETTINGS = [(6, 6, 1, 300), (8, 8, 2, 10), (8, 8, 2, 300)]


def percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def load_ragen_env(src: Path):
    """RAGEN's SokobanEnv class, its package ``__init__`` files skipped (they import its trainer stack)."""
    # RAGEN's modules import each other as ``ragen``: ours is set aside while they load
    # (they keep what they imported), then put back
    sys.path.insert(0, str(src))
    ours = {k: v for k, v in sys.modules.items() if k == "ragen" or k.startswith("ragen.")}
    for k in ours:
        del sys.modules[k]
    try:
        for name, sub in (("ragen", "ragen"), ("ragen.env", "ragen/env")):
            module = types.ModuleType(name)
            module.__path__ = [str(src / sub)]
            sys.modules[name] = module
        warnings.filterwarnings("ignore")
        from ragen.env.sokoban.config import SokobanEnvConfig
        from ragen.env.sokoban.env import SokobanEnv
    finally:
        for k in [k for k in sys.modules if k == "ragen" or k.startswith("ragen.")]:
            del sys.modules[k]
        sys.modules.update(ours)
        sys.path.remove(str(src))
    return SokobanEnv, SokobanEnvConfig


def timed(make, seeds: range) -> tuple[list[float], list]:
    for seed in range(seeds.stop, seeds.stop + 3):  # warm up the interpreter's caches
        make(seed)
    gc.collect()  # start each series without the garbage of the one before
    times, rooms = [], []
    for seed in seeds:
        start = time.perf_counter()
        rooms.append(make(seed))
        times.append((time.perf_counter() - start) * 1000)
    return times, rooms


def summary(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.fmean(ordered), percentile(ordered, 0.95)


def difficulty(rooms: list) -> tuple[float, float]:
    moves = []
    for fixed, state in rooms:
        solution = solve(fixed, state)
        if solution is None:
            raise AssertionError("a generated room has no solution")
        moves.append(len(solution))
    return statistics.fmean(moves), sum(m <= 10 for m in moves) / len(moves)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ragen-src", type=Path, default=None, help="RAGEN checkout to time RAGEN's generator")
    parser.add_argument("--seeds", type=int, default=300, help="rooms per setting")
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args(argv)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    ragen_env = load_ragen_env(args.ragen_src.resolve()) if args.ragen_src else None

    print(f"Sokoban room generation, {args.seeds} rooms per setting (seeds {seeds.start}..{seeds.stop - 1})\n")
    print("| setting | RAGEN mean / p95 ms | ours ragen mean / p95 ms | speed-up | identical rooms "
          "| ours fast mean / p95 ms | speed-up | RAGEN rooms: moves, solvable in <=10 "
          "| fast rooms: moves, solvable in <=10 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rows, cols, boxes, depth in SETTINGS:
        exact = generate_ragen_room.__wrapped__  # bypass the memos: time real generation
        fast = generate_room.__wrapped__
        t_exact, r_exact = timed(lambda s: exact(rows, cols, boxes, depth, s), seeds)
        t_fast, r_fast = timed(lambda s: fast(rows, cols, boxes, depth, s), seeds)
        exact_rooms = [(r.room_fixed, r.room_state) for r in r_exact]
        m_exact, e_mean = difficulty(exact_rooms), summary(t_exact)[0]
        m_fast, f_mean = difficulty([(r.room_fixed, r.room_state) for r in r_fast]), summary(t_fast)[0]
        exact_ms = "{:.3f} / {:.3f}".format(*summary(t_exact))
        fast_ms = "{:.3f} / {:.3f}".format(*summary(t_fast))
        ragen_ms = speed_exact = speed_fast = same = "n/a"
        if ragen_env is not None:
            env_cls, cfg_cls = ragen_env
            env = env_cls(cfg_cls(dim_room=(rows, cols), num_boxes=boxes, search_depth=depth, max_steps=100))

            def ragen_reset(seed: int):
                env.reset(seed=seed)
                return env.room_fixed.astype(int).tolist(), env.room_state.astype(int).tolist()

            t_ragen, r_ragen = timed(ragen_reset, seeds)
            ours = [[list(map(list, f)), list(map(list, s))] for f, s in exact_rooms]
            same = f"{sum(a == list(b) for a, b in zip(ours, r_ragen))}/{len(seeds)}"
            g_mean, g_p95 = summary(t_ragen)
            ragen_ms = f"{g_mean:.2f} / {g_p95:.2f}"
            speed_exact, speed_fast = f"{g_mean / e_mean:.1f}x", f"{g_mean / f_mean:.0f}x"
        row = f"{ragen_ms} | {exact_ms} | {speed_exact} | {same} | {fast_ms} | {speed_fast}"
        print(
            f"| {rows}x{cols}, {boxes} box{'es' if boxes > 1 else ''}, depth {depth} | {row} "
            f"| {m_exact[0]:.2f}, {m_exact[1]:.0%} | {m_fast[0]:.2f}, {m_fast[1]:.0%} |"
        )


if __name__ == "__main__":
    main()

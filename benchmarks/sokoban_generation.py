"""Benchmark of Sokoban room generation: time per room and difficulty.

For each setting it generates one room per seed with the memo bypassed (every
room is generated from scratch), then solves each room with the exact BFS
solver. Reported: mean, p95 and worst milliseconds per room; the mean length of
the shortest solution in moves (player moves + pushes) and in pushes; and the
share of rooms solvable within 10 actions (SimpleSokoban's action budget).

The RAGEN columns are RAGEN's generator (gym-sokoban's reverse play) measured
on the 2-core development machine, for comparison.

Usage::

    python benchmarks/sokoban_generation.py [--seeds 300] [--first-seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from ragen.env.sokoban import generate_room, solve  # noqa: E402

# (rows, cols, boxes, search_depth) -> RAGEN's (mean ms, worst ms or None, mean moves)
SETTINGS = {
    (6, 6, 1, 300): (4.0, None, 3.8),
    (8, 8, 2, 300): (76.0, 386.0, 15.6),
}


def percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def measure(rows: int, cols: int, boxes: int, depth: int, seeds: range) -> dict:
    build = generate_room.__wrapped__  # bypass the memo: time real generation
    for seed in range(-5, 0):  # warm up imports and caches of the interpreter
        build(rows, cols, boxes, depth, seed)
    times, moves, pushes = [], [], []
    for seed in seeds:
        start = time.perf_counter()
        room = build(rows, cols, boxes, depth, seed)
        times.append((time.perf_counter() - start) * 1000)
        solution = solve(room.room_fixed, room.room_state)
        if solution is None:
            raise AssertionError(f"room for seed {seed} has no solution")
        moves.append(len(solution))
        pushes.append(room.min_pushes)
    times.sort()
    return {
        "mean_ms": statistics.fmean(times),
        "p95_ms": percentile(times, 0.95),
        "worst_ms": times[-1],
        "moves": statistics.fmean(moves),
        "pushes": statistics.fmean(pushes),
        "within_10": sum(m <= 10 for m in moves) / len(moves),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=300, help="rooms per setting")
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args(argv)
    seeds = range(args.first_seed, args.first_seed + args.seeds)

    print(f"Sokoban room generation, {args.seeds} rooms per setting (seeds {seeds.start}..{seeds.stop - 1})\n")
    print("| setting | ours mean ms | ours p95 ms | ours worst ms | RAGEN mean ms | RAGEN worst ms | speed-up (mean) "
          "| ours mean moves | RAGEN mean moves | ours mean pushes | ours solvable in <=10 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (rows, cols, boxes, depth), (ragen_ms, ragen_worst, ragen_moves) in SETTINGS.items():
        r = measure(rows, cols, boxes, depth, seeds)
        worst = f"{ragen_worst:.0f}" if ragen_worst is not None else "n/a"
        print(
            f"| {rows}x{cols}, {boxes} box{'es' if boxes > 1 else ''}, depth {depth} "
            f"| {r['mean_ms']:.3f} | {r['p95_ms']:.3f} | {r['worst_ms']:.3f} "
            f"| {ragen_ms:.0f} | {worst} | {ragen_ms / r['mean_ms']:.0f}x "
            f"| {r['moves']:.2f} | {ragen_moves} | {r['pushes']:.2f} | {r['within_10']:.0%} |"
        )


if __name__ == "__main__":
    main()

"""Cost of checking a tool call against a ``pattern`` that backtracks exponentially.

A tool whose ``word`` argument has ``pattern: ^(a|aa)+$`` gets one call of ``n`` a's and a
``!`` (no match: every way to split the a's is tried). Reported per ``n``: the wall and CPU
seconds of ``parse_hermes`` on it, how many times a second thread advanced a counter meanwhile
(0: the GIL was held throughout), and what the model is told.

Usage::

    PYTHONPATH=. python benchmarks/tool_patterns.py [--lengths 30,34,38]
"""

from __future__ import annotations

import argparse
import threading
import time

from ragen.llm.tool_calls import call_text, check_tools, parse_hermes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="30,34,38", help="numbers of a's, comma-separated")
    args = parser.parse_args()
    tools = check_tools([{"type": "function", "function": {"name": "q", "parameters": {
        "type": "object", "properties": {"word": {"type": "string", "pattern": "^(a|aa)+$"}}}}}], "bench")
    parse_hermes(call_text("q", {"word": "a"}), tools)  # the validator built once, as in a rollout
    print("| a's | wall s | CPU s | other thread's steps | told |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        steps, stop = [0], threading.Event()

        def spin() -> None:
            while not stop.is_set():
                steps[0] += 1

        other = threading.Thread(target=spin)
        other.start()
        time.sleep(0.05)
        before = steps[0]
        wall, cpu = time.perf_counter(), time.thread_time()
        (call,) = parse_hermes(call_text("q", {"word": "a" * n + "!"}), tools)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        during = steps[0] - before
        stop.set()
        other.join()
        print(f"| {n} | {wall:.2f} | {cpu:.2f} | {during} | {call.error.split(': ', 1)[1][:70]} |")


if __name__ == "__main__":
    main()

"""Agent programs for the runner's tests (``tests/test_agents_program.py``) and the agent fault
matrix (``tests/test_agent_faults.py``): entries named ``tests.agent_programs:<name>``, a tasks
function, and command lines run with this Python.

``RELEASE`` holds ``hangs``, ``calls_late`` and ``calls_then_hangs`` until a test sets it, so the
thread a timed-out episode abandons ends with its test; ``LATE`` keeps what ``calls_late``'s call met.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

RELEASE = threading.Event()
LATE: dict = {}
NOT_CALLABLE = 42


def add(task: dict, llm) -> float:
    return float(task["a"] + task["b"])


def with_info(task: dict, llm) -> dict:
    print(f"thinking about {task['a']}")
    print("a warning", file=sys.stderr)
    return {"reward": 0.5, "answer": task["a"] + task["b"], "steps": [1, 2]}


def raises(task: dict, llm) -> float:
    raise ValueError("no answer for this task")


def hangs(task: dict, llm) -> float:
    print("started")
    RELEASE.wait(60)
    return 1.0


async def async_add(task: dict, llm) -> dict:
    await asyncio.sleep(0)
    print("from the event loop")
    return {"reward": float(task["a"] + task["b"]), "loop": True}


def says(task: dict, llm) -> float:
    """Prints its task's marker many times: two episodes at once must each keep only their own."""
    for _ in range(200):
        print(task["marker"])
        print(task["marker"], file=sys.stderr)
    return 1.0


def floods(task: dict, llm) -> float:
    for i in range(20_000):
        print(f"line {i:06d}")
    return 1.0


def returns_text(task: dict, llm) -> str:
    return "high"


def returns_nan(task: dict, llm) -> float:
    return float("nan")


def returns_huge(task: dict, llm) -> dict:
    return {"reward": 1e12}


def returns_object(task: dict, llm) -> dict:
    return {"reward": 1.0, "thing": object()}


def exits(task: dict, llm) -> float:
    sys.exit(3)


def chats(task: dict, llm) -> dict:
    """One call through the episode's own session, with the ready sync client."""
    reply = llm.client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["q"]}])
    return {"reward": 1.0, "answer": reply.choices[0].message.content}


async def chats_async(task: dict, llm) -> dict:
    reply = await llm.async_client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}])
    return {"reward": 0.5, "answer": reply.choices[0].message.content}


def calls_late(task: dict, llm) -> float:
    """Waits past its timeout, then calls: its session is closed by then."""
    RELEASE.wait(60)
    try:
        llm.client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "late"}])
        LATE["error"] = None
    except Exception as exc:  # whatever the client raises is what the test looks at
        LATE["error"] = exc
    return 1.0


def task_of(seed: int) -> dict:
    return {"seed": seed, "a": seed, "b": 1}


def not_a_task(seed: int) -> list:
    return [seed]


def python(code: str) -> list[str]:
    """A command line running ``code`` with this Python."""
    return [sys.executable, "-c", code]


PRINTS_SUM = python("import json, sys\ntask = json.load(sys.stdin)\nprint('working')\nprint(task['a'] + task['b'])\n"
                    "print()\n")
PRINTS_OBJECT = python("import json, sys\ntask = json.load(sys.stdin)\n"
                       "print(json.dumps({'reward': 0.25, 'answer': task['a'], 'calls': 2}))\n")
FAILS = python("import sys\nprint('1.0')\nsys.stderr.write('it went wrong\\n')\nsys.exit(3)\n")
PRINTS_WORDS = python("print('the answer is four')\n")
IGNORES_TERM = python("import os, signal, subprocess, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "subprocess.Popen([sys.executable, '-c', 'import signal, time\\n"
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\ntime.sleep(60)'])\n"
                      "print(os.getpgid(0), flush=True)\ntime.sleep(60)\n")
LEAVES_CHILD = python("import os, subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      "print(os.getpgid(0))\nprint(1.0)\n")
SHOWS_ENV = python("import json, os\nseen = {k: v for k, v in os.environ.items() if k.startswith(('OPENAI_', 'RAGEN_'))}\n"
                   "print(json.dumps({'reward': 1.0, 'env': seen}))\n")
FLOODS = python("import sys\nfor i in range(200000):\n    sys.stdout.write('x' * 20 + '\\n')\nprint(0.75)\n")
CLEANS_UP = python("import signal, sys, time\n"
                   "def end(*_):\n    sys.stderr.write('cleaned up\\n')\n    sys.stderr.flush()\n    sys.exit(0)\n"
                   "signal.signal(signal.SIGTERM, end)\nprint('ready', flush=True)\ntime.sleep(60)\n")


def growing_chat(llm, first: str, then: str) -> tuple[str, str]:
    """Two calls of one chat: ``first``, then its answer and ``then``; the two answers."""
    messages = [{"role": "user", "content": first}]
    answer = llm.client.chat.completions.create(model=llm.model, messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": then}]
    return answer, llm.client.chat.completions.create(model=llm.model, messages=messages).choices[0].message.content


def counts(task: dict, llm) -> dict:
    """Two calls of a growing chat; its reward reads the second answer (deterministic on the scripted engine)."""
    _, second = growing_chat(llm, f"Count to {task['a']}.", "More.")
    return {"reward": float(len(second) % 3), "seen": task["a"]}


def restarts(task: dict, llm) -> dict:
    """Two chats: the second does not grow the first (a new segment), then a call that grows the second."""
    llm.client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": f"Count to {task['a']}."}])
    growing_chat(llm, "Start again.", "More.")
    return 1.0


def never_calls(task: dict, llm) -> float:
    """Returns a reward without a call: nothing to train."""
    return 1.0


def calls_then_hangs(task: dict, llm) -> float:
    """One call (its client keeps the connection open), then waits past its timeout."""
    llm.client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "hello"}])
    RELEASE.wait(60)
    return 1.0


def calls_after_its_end(task: dict, llm) -> float:
    """Sleeps ``task['late_s']``, past its timeout, then calls once: its session is closed by then.
    What the call met (an HTTP status, or the error's name) is appended as a line to the file
    ``task['report']`` names (the episode may run in another process than the test)."""
    time.sleep(task["late_s"])
    import openai

    try:
        llm.client.with_options(max_retries=0).chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": "late"}])
        met = "200"
    except openai.APIStatusError as exc:
        met = str(exc.status_code)
    except Exception as exc:  # whatever the client raises is what the test looks at
        met = type(exc).__name__
    with open(task["report"], "a", encoding="utf-8") as f:
        f.write(met + "\n")
    return 1.0


def floods_calls(task: dict, llm) -> float:
    """Bursts of 32 calls started together, none retried, until the gateway refuses one: raises what refused it."""
    import openai

    client = llm.client.with_options(max_retries=0)
    refused: list = []

    def call(start: threading.Barrier) -> None:
        start.wait()
        try:
            client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "flood"}])
        except openai.APIStatusError as exc:
            refused.append(exc)

    while not refused:
        start = threading.Barrier(32)
        burst = [threading.Thread(target=call, args=(start,)) for _ in range(32)]
        for t in burst:
            t.start()
        for t in burst:
            t.join()
    raise refused[0]


def kills_its_process(task: dict, llm) -> float:
    """SIGKILL to the process it runs in (a worker's: the rollout's fallback finds it)."""
    os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


KILLS_ITSELF = python("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")

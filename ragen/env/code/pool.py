"""Answers for the scripted policy on code problems (``engine.answers: ragen.env.code.pool:scripted_answer``).

The ``code_exec`` benchmark's policy: for the problem its prompt states, a
correct solution with probability ``CORRECT``, else one of the problem's wrong
ones (an off-by-one, a wrong rule, a crash, a loop that never ends), each run
in the sandbox as a model's answer would be; a call of the ``run_tests`` tool
when the prompt lists tools (the env's ``tool_calls`` form).
"""

from __future__ import annotations

import functools
import math
import random

from ragen.llm.tool_calls import call_text

from .problems import FAMILIES, solutions

__all__ = ["CORRECT", "scripted_answer"]

CORRECT = 0.5


@functools.lru_cache(maxsize=1)
def _by_statement() -> dict[str, int]:
    """Each statement -> a seed of its problem (the family and variant decide the solutions)."""
    table = {}
    for f, family in enumerate(FAMILIES):
        for v in range(family.variants):
            table[family.statement(v)] = f + v * len(FAMILIES)
    return table


def scripted_answer(prompt: str, rng: random.Random) -> tuple[str, float] | None:
    """(the code in a fenced block, the log-probability of the choice), or None when the prompt states no
    shipped problem."""
    seed = next((s for statement, s in _by_statement().items() if statement in prompt), None)
    if seed is None:
        return None
    right, wrong = solutions(seed)
    if rng.random() < CORRECT:
        code, logp = right, math.log(CORRECT)
    else:
        code, logp = wrong[rng.randrange(len(wrong))], math.log(1 - CORRECT) - math.log(len(wrong))
    if "<tools>" in prompt:
        return call_text("run_tests", {"code": code}), logp
    return f"```python\n{code}```", logp

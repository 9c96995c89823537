"""Answers for the scripted policy on search questions (``engine.answers: ragen.env.search.pool:scripted_answer``).

A reader of the prompt, as a search agent would act: with no results yet it
searches the question's names; when the last results hold the fact asked, it
answers it (the truth with probability ``CORRECT``, else another document's
fact); for a region's largest town it searches that town first. Every search
goes to the retrieval server. When the prompt lists tools (the env's
``tool_calls`` form), the same actions are tool calls.
"""

from __future__ import annotations

import math
import random
import re

from ragen.llm.tool_calls import call_text

__all__ = ["CORRECT", "scripted_answer"]

CORRECT = 0.7
_QUESTION = re.compile(r"Question: (.+?)\n")
_FACTS = {
    "founded": re.compile(r"(\w+) is a town .*? founded in (\d+)\."),
    "mayor": re.compile(r"(\w+) is a town .*?Its mayor is ([\w ]+?)\."),
    "river": re.compile(r"(\w+) is a town .*? on the (\w+) river\."),
    "known": re.compile(r"(\w+) is a town .*? known for its ([\w ]+?);"),
}
_LARGEST = re.compile(r"The (\w+) region .*?Its largest town is (\w+)\.")


def _kind(question: str) -> str:
    for kind in _FACTS:
        if kind in question:
            return kind
    return "known"


def scripted_answer(prompt: str, rng: random.Random) -> tuple[str, float] | None:
    found = _text_answer(prompt, rng)
    if found is None or "<tools>" not in prompt:
        return found
    answer, logp = found
    kind, arg = answer.split("[", 1)
    return call_text(kind, {"query" if kind == "search" else "answer": arg[:-1]}), logp


def _text_answer(prompt: str, rng: random.Random) -> tuple[str, float] | None:
    found = _QUESTION.search(prompt)
    if found is None:
        return None
    question = found.group(1)
    results = prompt.rsplit("Search results for", 1)[1] if "Search results for" in prompt else ""
    names = [w.strip("?") for w in question.split()[1:] if w[:1].isupper()]
    if "largest town" in question:  # two searches: the region's largest town, then its mayor
        region = names[-1] if names else ""
        town = dict(_LARGEST.findall(prompt)).get(region)
        if town is None:
            return f"search[{region} region largest town]", 0.0
        facts = dict(_FACTS["mayor"].findall(results))
        if town not in facts:
            return f"search[{town}]", 0.0
        return _finish(facts[town], list(facts.values()), rng)
    facts = dict(_FACTS[_kind(question)].findall(results))
    subject = names[-1] if names else ""
    if subject not in facts:
        return f"search[{' '.join(names) or question}]", 0.0
    return _finish(facts[subject], list(facts.values()), rng)


def _finish(truth: str, others: list[str], rng: random.Random) -> tuple[str, float]:
    wrong = [o for o in others if o != truth] or ["I do not know"]
    if rng.random() < CORRECT:
        return f"finish[{truth}]", math.log(CORRECT)
    return f"finish[{wrong[rng.randrange(len(wrong))]}]", math.log(1 - CORRECT) - math.log(len(wrong))

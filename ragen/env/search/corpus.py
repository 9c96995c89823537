"""The search env's shipped corpus and questions, built from a seed (nothing is downloaded).

Made-up towns, so that a model cannot answer from what it learnt: each town
has a document (its region, river, founding year, mayor and what it is known
for), each region one naming its largest town. Questions ask one fact of a
town (one search), or the mayor of a region's largest town (two: the region,
then the town). ``filler`` adds documents of other made-up places that answer
nothing, so that a search has a corpus of a real size to rank.

A corpus file (``python -m ragen.tools.retrieval_server --corpus FILE``) is
JSON lines ``{"id": ..., "contents": ...}``, the format of pyserini's and
FlashRAG's corpora (``text`` is read too).
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Doc", "Question", "load_corpus", "questions", "shipped_corpus"]

_SYLLABLES = ("ka", "lor", "ven", "mi", "dra", "tes", "quo", "bel", "ru", "zan", "fi", "mor", "tal", "ow", "ny",
              "sel", "gra", "pe", "dun", "vik", "ar", "lo", "xi", "brem")
_EXPORTS = ("glass beads", "blue cheese", "river salt", "copper bells", "silk rope", "smoked eel", "clay pipes",
            "linen", "honey wine", "slate tiles", "wool hats", "paper lanterns")
_FIRST = ("Ada", "Bram", "Cora", "Dov", "Elin", "Faro", "Gus", "Hana", "Ivo", "Juna", "Kel", "Lisa", "Moe", "Nia")
TOWNS, REGIONS = 400, 40


@dataclass(frozen=True)
class Doc:
    id: str
    contents: str


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    hops: int


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


@functools.lru_cache(maxsize=4)
def _world(seed: int = 0) -> tuple[tuple[Doc, ...], tuple[Question, ...]]:
    rng = random.Random(f"ragen-search-{seed}")
    names: set[str] = set()

    def fresh(parts: int) -> str:
        while True:
            name = _name(rng, parts)
            if name not in names:
                names.add(name)
                return name

    regions = [fresh(2) for _ in range(REGIONS)]
    docs, qs = [], []
    largest: dict[str, tuple[str, str, int]] = {}
    for t in range(TOWNS):
        town, region, river = fresh(3), regions[t % REGIONS], fresh(3)
        year, mayor = rng.randint(1100, 1950), f"{rng.choice(_FIRST)} {fresh(3)}"
        export, people = rng.choice(_EXPORTS), rng.randint(800, 90000)
        docs.append(Doc(f"town-{t}", f"{town} is a town in the {region} region, on the {river} river. It was founded "
                                     f"in {year}. Its mayor is {mayor}. {town} is known for its {export}; about "
                                     f"{people} people live there."))
        qs += [Question(f"In which year was {town} founded?", str(year), 1),
               Question(f"Who is the mayor of {town}?", mayor, 1),
               Question(f"Which river flows through {town}?", river, 1),
               Question(f"What is {town} known for?", export, 1)]
        if region not in largest or people > largest[region][2]:
            largest[region] = (town, mayor, people)
    for r, region in enumerate(regions):
        town, mayor, _ = largest[region]
        docs.append(Doc(f"region-{r}", f"The {region} region lies between hills and the sea. Its largest town is "
                                       f"{town}."))
        qs.append(Question(f"Who is the mayor of the largest town of the {region} region?", mayor, 2))
    order = random.Random(f"ragen-search-order-{seed}")
    order.shuffle(qs)
    return tuple(docs), tuple(qs)


def questions() -> tuple[Question, ...]:
    """The shipped questions; an env's seed picks ``questions()[seed % len]``."""
    return _world()[1]


def shipped_corpus(filler: int = 0) -> list[Doc]:
    """The shipped documents, and ``filler`` documents of other made-up places."""
    docs = list(_world()[0])
    rng = random.Random("ragen-search-filler")
    for i in range(filler):
        place = _name(rng, 4)
        docs.append(Doc(f"filler-{i}", f"{place} is a village of {rng.choice(_EXPORTS)} makers by the "
                                       f"{_name(rng, 2)} lake, far from any town; {rng.randint(10, 900)} people "
                                       f"live there and its fair is held in {rng.choice(_FIRST)}'s barn."))
    return docs


def load_corpus(path: str | Path) -> list[Doc]:
    """A JSON-lines corpus: ``{"id", "contents"}`` (or ``"text"``) a line; ValueError naming the line at fault."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = row.get("contents", row.get("text"))
                if not isinstance(text, str):
                    raise ValueError("no 'contents' or 'text' string")
            except (ValueError, AttributeError) as exc:
                raise ValueError(f"{path}:{n}: not a corpus line ({exc}): {line[:100]!r}") from None
            docs.append(Doc(str(row.get("id", n - 1)), text))
    if not docs:
        raise ValueError(f"{path}: the corpus is empty")
    return docs

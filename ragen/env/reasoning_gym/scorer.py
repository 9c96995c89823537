"""The scorer process: reasoning-gym's ``score_answer``, run in the sandbox, one request a line.

``scoring.py`` starts this file in the sandbox. It writes ``{"ready": true}`` once reasoning-gym is
imported, then for each request line ``{"id", "dataset", "options", "seed", "item", "answer"}`` one
reply line ``{"id", "score"}`` or ``{"id", "error"}``; for a line ``{"id", "question": true, "dataset",
"options", "seed"}``, ``{"id", "chars"}``: the length of the question that seed makes (a reset asks it
first, so the dataset's time and memory on these options are bounded here, not in the rollout's
process). ``item`` is the env's item, pickled (base64):
some datasets' items depend on the process's hash seed, so one built again here could differ from
the question the model answered (the pickle comes from the rollout's process, never the other way).
The dataset, seeded with the seed, scores it with the global generators seeded too (``own_rng``);
the last few datasets are kept, since a group's envs share their seed. The replies go out on a copy
of stdout taken before any scorer runs; stdout itself is /dev/null, so what a scorer prints is not
a reply.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
from collections import OrderedDict
from typing import Any, TextIO

_KEPT_DATASETS = 32


class _Datasets:
    """The last datasets made: (name, options, seed) -> the dataset object."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, Any] = OrderedDict()

    def score(self, request: dict[str, Any]) -> float:
        from ragen.env.global_rng import GlobalRngState, own_rng

        item = pickle.loads(base64.b64decode(request["item"]))  # noqa: S301 - the rollout process's own data
        with own_rng(GlobalRngState(), seed=request["seed"]):
            dataset = self._get(request["dataset"], request["options"], request["seed"])
            return float(dataset.score_answer(answer=request["answer"], entry=item))

    def question_chars(self, request: dict[str, Any]) -> int:
        from ragen.env.global_rng import GlobalRngState, own_rng

        with own_rng(GlobalRngState(), seed=request["seed"]):
            item = self._get(request["dataset"], request["options"], request["seed"])[0]
        return len(item["question"])

    def _get(self, name: str, options: dict[str, Any], seed: int) -> Any:
        import reasoning_gym

        key = json.dumps([name, options, seed], sort_keys=True)
        if key not in self._kept:
            self._kept[key] = reasoning_gym.create_dataset(name, seed=seed, size=1, **options)
            if len(self._kept) > _KEPT_DATASETS:
                self._kept.popitem(last=False)
        self._kept.move_to_end(key)
        return self._kept[key]


def serve(requests: TextIO, replies: TextIO) -> None:
    """Answer each request line with one reply line, until the requests end."""
    datasets = _Datasets()
    _send(replies, {"ready": True})
    for line in requests:
        request = json.loads(line)
        try:
            if request.get("question"):
                reply = {"id": request["id"], "chars": datasets.question_chars(request)}
            else:
                reply = {"id": request["id"], "score": datasets.score(request)}
        except Exception as exc:  # noqa: BLE001 - any scorer's (or dataset's) error is said in the reply
            reply = {"id": request["id"], "error": f"{type(exc).__name__}: {exc}"[:500]}
        _send(replies, reply)


def _send(replies: TextIO, reply: dict[str, Any]) -> None:
    replies.write(json.dumps(reply) + "\n")
    replies.flush()


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the process's life
    import reasoning_gym  # noqa: F401 - imported before "ready", so no request waits for it

    serve(sys.stdin, replies)


if __name__ == "__main__":
    # run as a file: import the ragen this file belongs to (an editable install may name another)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()

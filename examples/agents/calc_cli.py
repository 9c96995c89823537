"""The calculator agent of ``openai_calc.py`` as a command: the task as JSON on stdin, the
endpoint from ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (which the ``openai`` client reads),
the result as a JSON object on the last line of stdout. ``config/agent_command.yaml`` runs it
as ``command: [python, examples/agents/calc_cli.py]``; by hand, against ``python -m
ragen.tools.gateway``:

    echo '{"question": "What is 37 * 41 + 5?", "answer": 1522}' | python examples/agents/calc_cli.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for examples.agents

import openai  # noqa: E402

from examples.agents.openai_calc import solve  # noqa: E402


def main() -> None:
    task = json.loads(sys.stdin.read())
    with openai.OpenAI() as client:
        result = solve(task, client, os.environ.get("OPENAI_MODEL", "any"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""The viewer's command line: ``python -m ragen.tools.viewer DUMP.jsonl [-o out.html] [--metrics metrics.jsonl]
[--config FILE] [--allow-env-type MODULE:CLASS]``.

Prints the page's path; an unreadable input prints ``error: <file and line: what
is wrong>`` on stderr and exits with status 2. ``--config`` and
``--allow-env-type`` name the env types whose config classes may be built for
their ``grid_vocab`` (as in ``python -m ragen.tools.replay``); the dump's other types
are never imported.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ragen.env.allowed import add_allow_options, allowed_env_types
from ragen.viewer import DumpError, ViewerError, write_viewer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ragen.tools.viewer",
        description="Write a rollout dump's episodes as one self-contained HTML page.")
    parser.add_argument("dump", help="a rollout dump: <name>.jsonl or <name>.jsonl.gz")
    parser.add_argument("-o", "--out", help="the HTML file to write (default: the dump's name with .html, beside it)")
    parser.add_argument("--metrics", help="a metrics.jsonl for the learning curve (default: the one beside the "
                                          "dump or in the folder above, if any)")
    add_allow_options(parser, "build the config class of")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        env_types = allowed_env_types(args.config, args.allow_env_type)
        path = write_viewer(args.dump, args.out, args.metrics, env_types=env_types)
    except (DumpError, ViewerError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the output cannot be written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

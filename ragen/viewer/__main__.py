"""The viewer's command line: ``python -m ragen.viewer DUMP.jsonl [-o out.html] [--metrics metrics.jsonl]``.

Prints the page's path; an unreadable input prints ``error: <file and line: what
is wrong>`` on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ragen.viewer import DumpError, ViewerError, write_viewer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ragen.viewer",
        description="Write a rollout dump's episodes as one self-contained HTML page.")
    parser.add_argument("dump", help="a rollout dump: <name>.jsonl or <name>.jsonl.gz")
    parser.add_argument("-o", "--out", help="the HTML file to write (default: the dump's name with .html, beside it)")
    parser.add_argument("--metrics", help="a metrics.jsonl for the learning curve (default: the one beside the "
                                          "dump or in the folder above, if any)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        path = write_viewer(args.dump, args.out, args.metrics)
    except (DumpError, ViewerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the output cannot be written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

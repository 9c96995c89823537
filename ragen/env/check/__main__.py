"""``python -m ragen.env.check``: see ``ragen.env.check.cli``."""

from ragen.env.check.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

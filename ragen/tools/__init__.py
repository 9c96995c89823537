"""The command-line tools, each run as ``python -m ragen.tools.<name>``:
``check`` (an env author's env checker), ``replay`` (re-run a dumped env),
``viewer`` (a dump as an HTML page), ``soak`` (many rollouts, watching for leaks)."""

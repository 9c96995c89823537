"""Test helper: a blocking call through an ``LLMClient`` (the library's loop
submits and waits on its own; tests with one request list use this)."""

from __future__ import annotations


def ask(client, requests, sampling):
    """Submit ``requests`` and wait for their completions (answers to other tickets are skipped)."""
    ticket = client.submit(requests, sampling)
    while True:
        got, completions = client.wait_any()
        if got == ticket:
            return completions

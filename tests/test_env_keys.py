"""``ragen.env.keys``: a server's key, read or made, and the headers that carry it."""

from __future__ import annotations

import base64

import pytest

from ragen.env.keys import auth_headers, authorized, export_line, server_key


def test_a_server_reads_its_key_or_makes_one(monkeypatch):
    monkeypatch.setenv("SOME_KEY", "s3cret")
    assert server_key("SOME_KEY") == ("s3cret", False)
    monkeypatch.setenv("SOME_KEY", "")
    made, generated = server_key("SOME_KEY")
    assert generated and len(made) >= 40 and made != server_key("SOME_KEY")[0]
    assert export_line("SOME_KEY", made).startswith(f"export SOME_KEY={made}  # ")


def _basic(user_key: str) -> str:
    return "Basic " + base64.b64encode(user_key.encode()).decode()


@pytest.mark.parametrize("header, ok", [
    ("Bearer s3cret", True), ("bearer  s3cret ", True), (_basic("anyone:s3cret"), True), (_basic(":s3cret"), True),
    (None, False), ("", False), ("Bearer", False), ("Bearer s3cre", False), ("Bearer s3cretx", False),
    ("s3cret", False), ("Token s3cret", False), (_basic("s3cret"), False), (_basic("s3cret:x"), False),
    ("Basic !!!", False), ("Basic " + base64.b64encode(b"a:\xff").decode(), False),
])
def test_a_request_is_authorized_only_by_the_key(header, ok):
    assert authorized(header, "s3cret") is ok


def test_a_client_sends_the_key_of_its_variable_and_none_without(monkeypatch):
    monkeypatch.delenv("SOME_KEY", raising=False)
    assert auth_headers("SOME_KEY") == {}
    monkeypatch.setenv("SOME_KEY", "s3cret")
    assert auth_headers("SOME_KEY") == {"Authorization": "Bearer s3cret"}

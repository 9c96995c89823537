"""``TextStream`` (``ragen.gateway.streaming``): a streamed answer's ids shown as text as they
come, never more than the answer's content: an incomplete character, a tool call's opening
and a stop string are held back, and the content decides the rest."""

from __future__ import annotations

from ragen.gateway.streaming import TextStream
from ragen.llm.tool_calls import CALL_OPEN


def utf8(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def shown(stream, text, sizes):
    """``text``'s bytes pushed in parts of ``sizes``: what each push showed."""
    data, out = list(text.encode()), []
    for n in sizes:
        part, data = data[:n], data[n:]
        out.append(stream.push(part))
    return out


def test_an_incomplete_character_is_held_until_its_last_byte():
    stream = TextStream(utf8)
    assert shown(stream, "aé€b", [2, 1, 2, 1, 1]) == ["a", "é", "", "€", "b"]
    assert stream.rest("aé€b") == ""


def test_a_tool_call_is_never_shown_and_white_space_before_it_waits_for_the_end():
    text = f"<think>go</think> \n{CALL_OPEN}\n{{\"name\": \"f\", \"arguments\": {{}}}}\n</tool_call>"
    stream = TextStream(utf8, [CALL_OPEN], strip_end=True)
    parts = shown(stream, text, [1] * len(text.encode()))
    assert "".join(parts) == "<think>go</think>" and all("<" not in p for p in parts[17:])
    assert stream.rest("<think>go</think>") == ""  # the content read_answer gives: nothing more
    plain = TextStream(utf8, [CALL_OPEN], strip_end=True)
    shown(plain, "say <tool and more ", [6, 5, 8])
    assert plain.shown == "say <tool and more" and plain.rest("say <tool and more ") == " "


def test_a_stop_string_and_what_may_begin_it_are_held():
    stream = TextStream(utf8, ["STOP"])
    assert shown(stream, "abcSTxSTOPdef", [5, 1, 4, 3]) == ["abc", "STx", "", ""]
    assert stream.rest("abcSTx") == ""


def test_the_content_decides_the_rest():
    stream = TextStream(utf8)
    shown(stream, "hello", [3])
    assert stream.rest("hello world") == "lo world"

"""``TextStream``: a streamed answer's ids turned into the text a client may be shown as they come.

The ids are decoded incrementally, as the engine writes an answer's text (special tokens
left out): each new piece is the decode of the ids since a settled point minus the decode
of those before it, held back while it ends in an incomplete character (the replacement
character a partial UTF-8 sequence decodes to). What is shown is only ever a prefix of the
answer's content: text from a ``held`` marker on (``<tool_call>`` where the call has tools,
a stop string the engine cuts at) is never shown, nor a trailing part that may begin one,
nor, with ``strip_end``, trailing white space (the content before a tool call is stripped).
``rest(content)`` is what the final content adds to what was shown: the answer, not the
stream, decides the content.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

logger = logging.getLogger(__name__)

_INCOMPLETE = "\ufffd"


class TextStream:
    """One streamed answer's text (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], held: Sequence[str] = (), strip_end: bool = False) -> None:
        self.decode = decode
        self.held = [m for m in held if m]
        self.strip_end = strip_end
        self.ids: list[int] = []
        self.text = ""  # the decoded text so far
        self.shown = ""  # what the client was given: a prefix of the answer's content
        self._prefix_at = 0  # ids before it are settled in ``text``
        self._read_at = 0  # ids before it are decoded into ``text``
        self._closed = False  # a held marker was met: nothing more is shown before the end

    def push(self, ids: list[int]) -> str:
        """The text ``ids`` add that may be shown now ("" while it is held back)."""
        self.ids += ids
        before = self.decode(self.ids[self._prefix_at:self._read_at])
        after = self.decode(self.ids[self._prefix_at:])
        if not after.startswith(before):
            return ""
        new = after[len(before):]
        if new.endswith(_INCOMPLETE):  # the ids so far end inside a character: the text before it
            return self._show(self.text + new.rstrip(_INCOMPLETE))
        self.text += new
        self._prefix_at, self._read_at = self._read_at, len(self.ids)
        return self._show(self.text)

    def _show(self, text: str) -> str:
        if self._closed:
            return ""
        cuts = [text.find(m) for m in self.held if m in text]
        if cuts:
            text, self._closed = text[:min(cuts)], True
        else:
            text = text[:len(text) - max((_partial_marker(text, m) for m in self.held), default=0)]
        if self.strip_end:
            text = text.rstrip()
        if len(text) <= len(self.shown) or not text.startswith(self.shown):
            return ""
        new, self.shown = text[len(self.shown):], text
        return new

    def rest(self, content: str) -> str:
        """What ``content`` (the answer's) adds to what was shown."""
        if not content.startswith(self.shown):
            logger.warning("a streamed answer showed %r, which its content %r does not start with",
                           self.shown[-40:], content[:80])
            return ""
        rest, self.shown = content[len(self.shown):], content
        return rest


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (0: none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0

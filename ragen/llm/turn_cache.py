"""The KV cache an episode's last call left, kept for its next turn.

A multi-turn episode asks again with its whole conversation: the previous
prompt, the answer, the new observation. ``TurnCache`` keeps, per episode (the
request's env seed and env id), the tokens a call computed for it and where
their keys and values lie in that call's cache, so that the next call computes
only the tokens after the longest start the new prompt shares with them. The
match is on tokens, not on turns: whatever the chat template re-renders
differently (an answer cut at a stop string, a window that drops old turns)
is simply computed again.

Entries point into the cache tensors of the call that made them (a *block*:
one key and one value tensor per layer, ``[rows, heads, length, head_dim]``);
storing copies nothing. The memory counted is that of every block an entry
still points into. Past ``max_bytes`` the least recently used entries go, and
a block is freed with its last entry; a block larger than the bound on its own
is not kept. Keys computed by one set of weights are wrong for the next: the
engine calls ``clear()`` whenever its policy version changes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from ragen.utils import common_prefix_length

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) per layer: [rows, heads, length, head_dim]


@dataclass
class _Block:
    layers: Layers
    nbytes: int
    live: int = 0  # entries pointing into it


@dataclass
class _Entry:
    tokens: list[int]
    block: _Block
    row: int
    columns: torch.Tensor  # where tokens[i]'s keys and values lie in the block's length dimension


@dataclass
class Hit:
    """``length`` leading tokens of a prompt whose keys and values are at ``layers[l][*][row, :, columns]``."""

    length: int
    layers: Layers
    row: int
    columns: torch.Tensor


class TurnCache:
    """Per-episode KV cache across calls, bounded by ``max_bytes``; see the module docstring."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"TurnCache max_bytes={max_bytes} must be >= 0")
        self.max_bytes = int(max_bytes)
        self.bytes = 0  # of the blocks entries point into
        self.evicted = 0  # entries dropped to stay under max_bytes
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, prompt: Sequence[int]) -> Hit | None:
        """The cached start of ``prompt`` for episode ``key`` (at most all but its last token), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        length = min(common_prefix_length([entry.tokens, prompt]), len(prompt) - 1)
        if length <= 0:
            return None
        return Hit(length, entry.block.layers, entry.row, entry.columns[:length])

    def put(self, layers: Layers, rows: Sequence[tuple[Hashable, int, list[int], torch.Tensor]]) -> bool:
        """Keep ``layers`` (one call's cache) for ``rows``: (episode key, row in the block, its
        tokens, their columns). Replaces the keys' older entries and evicts the least recently
        used past ``max_bytes``. False when the block alone is over the bound (nothing kept)."""
        latest = {key: (row, tokens, columns) for key, row, tokens, columns in rows}  # a key twice: the last wins
        for key in latest:
            self._drop(key)
        for key, (_, tokens, columns) in latest.items():
            if len(columns) != len(tokens):
                raise ValueError(f"TurnCache.put: {key!r} has {len(tokens)} tokens but {len(columns)} columns")
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self.max_bytes or not latest:
            return False
        block = _Block(layers, nbytes)
        self.bytes += nbytes
        for key, (row, tokens, columns) in latest.items():
            self._entries[key] = _Entry(list(tokens), block, row, columns)
            block.live += 1
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.evicted += 1
        return True

    def discard(self, key: Hashable) -> None:
        """Forget episode ``key`` (it has no next turn); its block goes with its last entry."""
        self._drop(key)

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        entry.block.live -= 1
        if entry.block.live == 0:
            self.bytes -= entry.block.nbytes

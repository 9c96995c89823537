"""TurnCache: the per-episode KV cache kept between calls (bounded, least recently used out)."""

from __future__ import annotations

import pytest
import torch

from ragen.llm.turn_cache import TurnCache


def block(rows: int, length: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A cache of ``rows`` x ``length`` positions whose key at [row, 0, col, 0] is row * 1000 + col."""
    keys = (torch.arange(rows)[:, None] * 1000 + torch.arange(length)[None, :]).float()
    keys = keys[:, None, :, None].expand(rows, 1, length, 2).contiguous()
    return [(keys.clone(), -keys.clone()) for _ in range(layers)]


def nbytes(layers) -> int:
    return sum(k.nbytes + v.nbytes for k, v in layers)


def test_get_returns_the_common_start_and_where_it_lies():
    cache = TurnCache(10**6)
    layers = block(2, 8)
    # row 1 has 2 columns of padding: its tokens lie at columns 2..7
    assert cache.put(layers, [("a", 0, [1, 2, 3, 4], torch.arange(4)),
                              ("b", 1, [5, 6, 7, 8, 9, 10], torch.arange(2, 8))])
    hit = cache.get("b", [5, 6, 7, 99, 100])
    assert hit.length == 3 and hit.row == 1 and hit.columns.tolist() == [2, 3, 4]
    assert hit.layers[0][0][hit.row, 0, hit.columns, 0].tolist() == [1002.0, 1003.0, 1004.0]
    # never the whole prompt: its last token is computed, for the logits
    assert cache.get("a", [1, 2, 3]).length == 2
    assert cache.get("a", [9, 9]) is None and cache.get("unknown", [1, 2]) is None


def test_a_block_is_counted_once_and_freed_with_its_last_entry():
    layers = block(2, 4)
    cache = TurnCache(10**6)
    cache.put(layers, [("a", 0, [1], torch.arange(1)), ("b", 1, [2], torch.arange(1))])
    assert cache.bytes == nbytes(layers) and len(cache) == 2
    cache.put(block(1, 4), [("a", 0, [3], torch.arange(1))])  # a's newer turn replaces its entry
    assert cache.bytes == nbytes(layers) + nbytes(block(1, 4))
    cache.put(block(1, 4), [("b", 0, [4], torch.arange(1))])  # the first block's last entry goes: freed
    assert cache.bytes == 2 * nbytes(block(1, 4))
    cache.clear()
    assert cache.bytes == 0 and len(cache) == 0


def test_past_the_bound_the_least_recently_used_go():
    one = nbytes(block(1, 16))
    cache = TurnCache(3 * one)
    for key in "abc":
        cache.put(block(1, 16), [(key, 0, [1, 2], torch.arange(2))])
    assert cache.get("a", [1, 2, 3]) is not None  # a used again: b is now the least recent
    cache.put(block(1, 16), [("d", 0, [1, 2], torch.arange(2))])
    assert cache.bytes <= cache.max_bytes and cache.evicted == 1
    assert cache.get("b", [1, 2, 3]) is None
    assert all(cache.get(k, [1, 2, 3]) is not None for k in "acd")


def test_a_block_over_the_bound_is_not_kept_and_its_keys_old_entries_go():
    small = block(1, 4)
    cache = TurnCache(nbytes(small))
    assert cache.put(small, [("a", 0, [1, 2], torch.arange(2))])
    assert not cache.put(block(4, 64), [("a", 0, [1, 2, 3], torch.arange(3))])
    assert cache.bytes == 0 and len(cache) == 0  # a's older turn is stale, not kept either


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="max_bytes"):
        TurnCache(-1)
    with pytest.raises(ValueError, match="3 tokens but 2 columns"):
        TurnCache(10**6).put(block(1, 4), [("a", 0, [1, 2, 3], torch.arange(2))])

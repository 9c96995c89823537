"""ragen.llm.types: the one check that ids are token ids."""

import pytest

from ragen.llm.types import TOKEN_ID_LIMIT, token_id_error


def test_token_ids_in_range_pass():
    assert token_id_error([]) is None
    assert token_id_error([0, 1, TOKEN_ID_LIMIT - 1]) is None
    assert token_id_error([0, 4], vocab_size=5) is None


@pytest.mark.parametrize("ids, vocab, words", [
    ([3, -1], None, "-1 is negative"),
    ([TOKEN_ID_LIMIT], None, f"{TOKEN_ID_LIMIT} is outside 32 bits"),
    ([1, 5], 5, "5 is outside the vocabulary's 5 ids (0..4)"),
    ([True], None, "True is not an integer"),
    ([1.0], None, "1.0 is not an integer"),
    (["7"], None, "'7' is not an integer"),
])
def test_bad_token_ids_are_named(ids, vocab, words):
    assert words in token_id_error(ids, vocab)

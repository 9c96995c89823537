"""``ragen.utils.all_seed``: seeds the global generators and restores them."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ragen.utils import all_seed


def test_all_seed_seeds_and_restores():
    random.seed(123)
    np.random.seed(123)
    expected_py, expected_np = random.random(), np.random.random()
    random.seed(123)
    np.random.seed(123)

    with all_seed(7):
        inside = (random.random(), np.random.random())
    with all_seed(7):
        assert (random.random(), np.random.random()) == inside

    # outside, the generators continue exactly where they were before the blocks
    assert random.random() == expected_py
    assert np.random.random() == expected_np


def test_all_seed_restores_after_an_exception():
    random.seed(5)
    state_py, state_np = random.getstate(), np.random.get_state()
    with pytest.raises(RuntimeError):
        with all_seed(9):
            random.random()
            raise RuntimeError("boom")
    assert random.getstate() == state_py
    assert np.array_equal(np.random.get_state()[1], state_np[1])


def test_all_seed_accepts_none_and_big_seeds():
    with all_seed(None):
        random.random()
    with all_seed(2**40 + 3):
        a = np.random.random()
    with all_seed(2**40 + 3):
        assert np.random.random() == a

"""``own_rng``: an env's private states of Python's and numpy's global generators."""

from __future__ import annotations

import random

import numpy as np

from ragen.env.global_rng import GlobalRngState, own_rng


def test_the_callers_generators_are_restored_and_the_envs_states_kept():
    random.seed(1)
    np.random.seed(1)
    outer = random.random(), np.random.random()
    random.seed(1)
    np.random.seed(1)
    a, b = GlobalRngState(), GlobalRngState()
    with own_rng(a, seed=7):
        first_a = random.random(), np.random.random()
    with own_rng(b, seed=7):
        first_b = random.random(), np.random.random()
    with own_rng(a):  # a goes on where it stopped, whatever b did
        second_a = random.random(), np.random.random()
    assert first_a == first_b and second_a != first_a
    assert (random.random(), np.random.random()) == outer  # the caller's draws as if nothing ran
    random.seed(7)
    np.random.seed(7)
    random.random(), np.random.random()
    assert (random.random(), np.random.random()) == second_a

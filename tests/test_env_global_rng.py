"""``own_rng``: an env's private states of Python's and numpy's global generators."""

from __future__ import annotations

import random
import time

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


def test_all_seed_blocks_draw_what_they_draw_alone_while_own_rng_blocks_run_on_another_thread():
    """One lock for both: an env library's ``own_rng`` on one thread never moves a RAGEN env's
    ``all_seed`` draws on another (with two locks, 1 block in 30 drew its numbers alone)."""
    import threading

    from ragen.utils import all_seed

    def drawn(seed):
        with all_seed(seed):
            first = random.random(), float(np.random.random())
            time.sleep(0.001)
            return first + (random.random(), float(np.random.random()))

    alone = [drawn(s) for s in range(30)]
    stop = threading.Event()

    def library():
        state = GlobalRngState()
        while not stop.is_set():
            with own_rng(state, seed=1):
                random.random(), np.random.random()

    other = threading.Thread(target=library)
    other.start()
    try:
        beside = [drawn(s) for s in range(30)]
    finally:
        stop.set()
        other.join()
    assert beside == alone

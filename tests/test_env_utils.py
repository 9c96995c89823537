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


def _draws(seed: int) -> list[float]:
    """Global-RNG draws under all_seed with a pause between them, as a generator
    that does work between draws: without the lock another thread reseeds or
    draws in that pause."""
    import time

    with all_seed(seed):
        out = [np.random.random()]
        time.sleep(0.002)
        out.append(random.random())
        time.sleep(0.002)
        out.append(np.random.random())
    return out


@pytest.mark.timeout(60)
def test_all_seed_blocks_do_not_interleave_across_threads():
    from concurrent.futures import ThreadPoolExecutor

    seeds = list(range(16))
    alone = [_draws(s) for s in seeds]
    with ThreadPoolExecutor(8) as pool:
        threaded = list(pool.map(_draws, seeds))
    assert threaded == alone


@pytest.mark.timeout(60)
def test_all_seed_waits_are_bounded(monkeypatch):
    import threading

    import ragen.utils

    monkeypatch.setattr(ragen.utils, "GLOBAL_RNG_WAIT_S", 0.2)
    entered, release = threading.Event(), threading.Event()

    def stuck() -> None:
        with all_seed(1):
            entered.set()
            release.wait(30)

    t = threading.Thread(target=stuck)
    t.start()
    try:
        assert entered.wait(10)
        with pytest.raises(TimeoutError, match="stuck inside"):
            with all_seed(2):
                pass
    finally:
        release.set()
        t.join(10)
    with all_seed(3):  # free again once the stuck block ends
        pass


def test_all_seed_nests_in_one_thread():
    with all_seed(1):
        with all_seed(2):
            inner = np.random.random()
        with all_seed(2):
            assert np.random.random() == inner


def test_common_prefix_length_is_the_first_place_any_sequence_differs():
    from ragen.utils import common_prefix_length

    rng = random.Random(0)
    for _ in range(2000):
        seqs = [[rng.randrange(3) for _ in range(rng.randrange(8))] for _ in range(rng.randrange(1, 4))]
        n = min(len(s) for s in seqs)
        want = next((i for i in range(n) if any(s[i] != seqs[0][i] for s in seqs)), n)
        assert common_prefix_length(seqs) == want
        assert common_prefix_length([tuple(seqs[0]), *seqs[1:]]) == want  # a tuple beside lists
    assert common_prefix_length([]) == 0
    assert common_prefix_length(["abcd", "abxd"]) == 2


def test_closed_on_failure_closes_on_any_failure_and_reraises_it():
    from ragen.utils import closed_on_failure

    closed = []
    with closed_on_failure(lambda: closed.append("a"), None, lambda: closed.append("b")):
        pass
    assert closed == []  # success: what was opened stays open for the caller
    for exc in (ValueError("bad"), KeyboardInterrupt()):  # an interrupt too
        with pytest.raises(type(exc)) as info:
            with closed_on_failure(lambda: closed.append("a"), None, lambda: closed.append("b")):
                raise exc
        assert info.value is exc
        assert closed == ["a", "b"]  # in order, None skipped
        closed.clear()


def test_closed_on_failure_raises_a_failing_close_after_the_failure():
    from ragen.utils import closed_on_failure

    def close():
        raise OSError("close failed")

    with pytest.raises(OSError, match="close failed") as info:
        with closed_on_failure(close):
            raise ValueError("bad")
    assert isinstance(info.value.__context__, ValueError)  # as an except block that closes and re-raises

"""FrozenLake: solvable maps per seed, gymnasium's moves and slips, RAGEN's text."""

from __future__ import annotations

from collections import Counter

import pytest

from ragen.env import make_env_config
from ragen.env.frozen_lake import FrozenLakeEnv, FrozenLakeEnvConfig, generate_map


def env_for(**values) -> FrozenLakeEnv:
    return FrozenLakeEnv(FrozenLakeEnvConfig(**values))


def reaches_goal(desc: tuple[str, ...]) -> bool:
    """S to G over non-hole cells by 4-neighbour moves: a search of the test's own,
    so that a broken check in the generator cannot vouch for its own maps."""
    cells = {(r, c): tile for r, row in enumerate(desc) for c, tile in enumerate(row)}
    start = next(pos for pos, tile in cells.items() if tile == "S")
    reached, frontier = {start}, [start]
    while frontier:
        r, c = frontier.pop()
        for step in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
            if cells.get(step, "H") != "H" and step not in reached:
                reached.add(step)
                frontier.append(step)
    return any(cells[pos] == "G" for pos in reached)


def test_the_tests_own_search_tells_open_maps_from_blocked_ones():
    assert reaches_goal(("SFH", "HFH", "HFG"))
    assert not reaches_goal(("SFH", "HHF", "FFG"))  # only a diagonal step would pass
    assert not reaches_goal(("SH", "HG"))


@pytest.mark.parametrize("size,p", [(4, 0.8), (6, 0.6), (8, 0.3), (12, 0.1)])
def test_maps_always_have_a_path(size, p):
    for seed in range(60):
        desc = generate_map(size, p, seed)
        assert len(desc) == size and all(len(row) == size for row in desc)
        assert desc[0][0] == "S" and desc[-1][-1] == "G"
        assert set("".join(desc)) <= set("SFHG")
        assert reaches_goal(desc), f"no path from S to G for seed {seed}: {desc}"


def test_maps_differ_by_seed_and_map_seed_pins_one():
    assert len({generate_map(5, 0.8, s) for s in range(30)}) > 20
    env = env_for(size=5, map_seed=9)
    assert len({env.reset(seed=s) for s in range(10)}) == 1
    assert env.desc == generate_map(5, 0.8, 9)


def test_not_slippery_moves_exactly():
    env = env_for(size=4, is_slippery=False)
    env.reset(seed=0)
    env.desc = ("SFFF", "FFFF", "FFFF", "FFFG")
    assert env.step(1)[3]["action_is_effective"] is False  # Left off the map: stays
    assert env.step(4)[3]["action_is_effective"] is False  # Up off the map
    env.step(3)
    assert env.player_pos == (0, 1)
    env.step(2)
    assert env.player_pos == (1, 1)
    assert env.render().splitlines()[1] == "_P__"
    for action in (3, 3, 2):
        obs, reward, done, info = env.step(action)
        assert not done
    obs, reward, done, info = env.step(2)
    assert (reward, done, info["success"]) == (1.0, True, True)
    assert obs.splitlines()[-1] == "___√"


def test_hole_ends_the_episode_without_reward():
    env = env_for(size=4, is_slippery=False)
    env.reset(seed=0)
    env.desc = ("SHFF", "FFFF", "FFFF", "FFFG")
    obs, reward, done, info = env.step(3)
    assert (reward, done, info["success"]) == (0.0, True, False)
    assert obs.splitlines()[0] == "_X__"


def test_slippery_moves_go_three_ways_evenly():
    env = env_for(size=4, is_slippery=True)
    outcomes = Counter()
    for seed in range(600):
        env.reset(seed=seed)
        env.desc = ("SFFF", "FFFF", "FFFF", "FFFG")
        env.player_pos = (1, 1)
        env.step(2)  # Down: slides Left or Right with probability 1/3 each
        outcomes[env.player_pos] += 1
    assert set(outcomes) == {(2, 1), (1, 0), (1, 2)}
    assert all(150 < n < 250 for n in outcomes.values())


def test_done_after_max_steps():
    env = env_for(size=4, is_slippery=False, max_steps=2)
    env.reset(seed=0)
    env.desc = ("SFFF", "FFFF", "FFFF", "FFFG")
    assert env.step(1)[2] is False
    assert env.step(1)[2] is True


def test_action_lookup_and_render_symbols():
    env = env_for()
    assert env.ACTION_LOOKUP == {1: "Left", 2: "Down", 3: "Right", 4: "Up"}
    obs = env.reset(seed=1)
    assert obs.startswith("P") and obs.endswith("G")
    assert set(obs) <= set("P_OG\n")


@pytest.mark.parametrize(
    "values,field",
    [
        ({"size": 1}, "size"),
        ({"size": -4}, "size"),
        ({"p": 0}, "p"),
        ({"p": 1.5}, "p"),
        ({"p": "high"}, "p"),
        ({"is_slippery": "yes"}, "is_slippery"),
        ({"max_steps": 0}, "max_steps"),
        ({"map_seed": 1.5}, "map_seed"),
    ],
)
def test_config_errors_name_the_field(values, field):
    with pytest.raises(ValueError, match=rf"^custom_envs\.FrozenLake\.env_config\.{field}: "):
        make_env_config("frozen_lake", values, tag="FrozenLake")

"""FrozenLake: RAGEN's solvable maps per seed, gymnasium's moves and slips, RAGEN's text."""

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
        flat = "".join(desc)
        assert flat.count("S") == 1 and flat.count("G") == 1  # start and goal anywhere, apart
        assert set(flat) <= set("SFHG")
        assert reaches_goal(desc), f"no path from S to G for seed {seed}: {desc}"


def test_ragens_map_for_seed_0():
    assert generate_map(4, 0.9, 0) == ("FFGS", "FHFF", "FHFF", "FFFF")
    assert env_for().reset(seed=0) == "__GP\n_O__\n_O__\n____"


def test_maps_differ_by_seed_and_the_reset_seed_picks_the_map():
    assert len({generate_map(5, 0.8, s) for s in range(30)}) > 20
    env = env_for(size=5, map_seed=9)  # RAGEN replaces map_seed with the reset seed
    assert len({env.reset(seed=s) for s in range(10)}) > 5
    env.reset(seed=3)
    assert env.desc == generate_map(5, 0.9, 3)


def test_negative_and_absent_seeds_give_maps():
    assert env_for().reset(seed=-5) != ""
    env = env_for()
    env.reset()
    assert isinstance(env.seed, int) and env.desc == generate_map(4, 0.9, env.seed)


def test_not_slippery_moves_exactly():
    env = env_for(size=4, is_slippery=False)
    env.reset(seed=0)
    env.desc = ("SFFF", "FFFF", "FFFF", "FFFG")
    env.player_pos = (0, 0)
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
    env.player_pos = (0, 0)
    obs, reward, done, info = env.step(3)
    assert (reward, done, info["success"]) == (0.0, True, False)
    assert obs.splitlines()[0] == "_X__"


def test_slippery_moves_go_three_ways_evenly():
    env = env_for(size=4, is_slippery=True, success_rate=1 / 3)
    outcomes = Counter()
    for seed in range(600):
        env.reset(seed=seed)
        env.desc = ("SFFF", "FFFF", "FFFF", "FFFG")
        env.player_pos = (1, 1)
        env.step(2)  # Down: slides Left or Right with probability 1/3 each
        outcomes[env.player_pos] += 1
    assert set(outcomes) == {(2, 1), (1, 0), (1, 2)}
    assert all(150 < n < 250 for n in outcomes.values())


def test_slippery_moves_follow_success_rate():
    env = env_for(size=4, is_slippery=True, success_rate=0.8)
    outcomes = Counter()
    for seed in range(600):
        env.reset(seed=seed)
        env.desc = ("SFFF", "FFFF", "FFFF", "FFFG")
        env.player_pos = (1, 1)
        env.step(2)  # Down 80%, Left or Right 10% each
        outcomes[env.player_pos] += 1
    assert 430 < outcomes[(2, 1)] < 530 and all(30 < outcomes[pos] < 95 for pos in ((1, 0), (1, 2)))


def test_steps_on_the_goal_or_in_a_hole_change_nothing():
    env = env_for(size=4, is_slippery=False)
    env.reset(seed=0)
    env.desc = ("SFFF", "FFFF", "FFFF", "FFFG")
    env.player_pos = (3, 2)
    assert env.step(3)[1:3] == (1.0, True)
    obs, reward, done, info = env.step(1)
    assert (reward, done, info["success"], info["action_is_effective"]) == (0.0, True, True, False)


def test_render_formats():
    env = env_for(observation_format="coord")
    obs = env.reset(seed=0)
    assert obs == "Board size: 4 rows x 4 cols (zero-indexed).\nStart: (0, 3)\nGoal: (0, 2)\nPlayer: (0, 3)\nHoles: (1, 1), (2, 1)"
    assert env.render("grid") == "__GP\n_O__\n_O__\n____"
    assert env.render("grid_coord") == f"Coordinates: \n{obs}\nGrid Map: \n{env.render('grid')}"
    with pytest.raises(ValueError, match="render mode"):
        env.render("rgb")


def test_custom_lookups():
    env = env_for(map_lookup={"P": 0, "F": 3, "H": 2, "G": 1}, action_map={1: 2, 2: 1, 3: 0, 4: 3}, is_slippery=False)
    assert env.reset(seed=0) == "GG_P\nGOGG\nGOGG\nGGGG"
    env.step(4)  # gymnasium's Up, off the map
    assert env.player_pos == (0, 3)
    env.step(3)  # mapped to gymnasium's Left
    assert env.player_pos == (0, 2)


def test_action_lookup_and_render_symbols():
    env = env_for()
    assert env.ACTION_LOOKUP == {1: "Left", 2: "Down", 3: "Right", 4: "Up"}
    obs = env.reset(seed=1)
    assert obs.count("P") == 1 and obs.count("G") == 1
    assert set(obs) <= set("P_OG\n")


@pytest.mark.parametrize(
    "values,field",
    [
        ({"size": 1}, "size"),
        ({"size": -4}, "size"),
        ({"size": 2**40}, "size"),
        ({"p": -0.1}, "p"),
        ({"p": 1.5}, "p"),
        ({"success_rate": 2}, "success_rate"),
        ({"observation_format": "image"}, "observation_format"),
        ({"render_mode": "rgb_array"}, "render_mode"),
        ({"action_map": {1: 0, 2: 1, 3: 2, 4: 7}}, "action_map.4"),
        ({"action_map": {1: 0, 2: 1}}, "action_map"),
        ({"map_lookup": {"P": 0, "F": 1, "H": 2}}, "map_lookup"),
        ({"max_steps": 10}, "max_steps"),
        ({"p": "high"}, "p"),
        ({"is_slippery": "yes"}, "is_slippery"),
        ({"map_seed": 1.5}, "map_seed"),
    ],
)
def test_config_errors_name_the_field(values, field):
    with pytest.raises(ValueError, match=rf"^custom_envs\.FrozenLake\.env_config\.{field}: "):
        make_env_config("frozen_lake", values, tag="FrozenLake")


def test_the_map_size_is_bounded_naming_the_bound():
    with pytest.raises(ValueError, match=r"^custom_envs\.FrozenLake\.env_config\.size: must be <= 64, got 65$"):
        make_env_config("frozen_lake", {"size": 65}, tag="FrozenLake")
    assert make_env_config("frozen_lake", {"size": 64}).size == 64

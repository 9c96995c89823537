"""Sokoban: generated rooms (RAGEN's and our fast ones) are valid and solvable, rules and
rewards are gym-sokoban's. RAGEN's exact rooms are pinned by test_ragen_parity_sokoban."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen.env import make_env_config
from ragen.env.config_checks import EnvConfigError
from ragen.env.sokoban import SokobanEnv, SokobanEnvConfig, generate_room, solve
from ragen.env.sokoban.generator import BOX, BOX_ON_TARGET, FLOOR, PLAYER, TARGET, WALL
from ragen.env.sokoban.ragen_rooms import generate_ragen_room

SETTINGS = [(6, 6, 1, 300), (8, 8, 2, 300)]


def env_for(rows=6, cols=6, boxes=1, depth=300, **extra) -> SokobanEnv:
    return SokobanEnv(SokobanEnvConfig(dim_x=rows, dim_y=cols, num_boxes=boxes, search_depth=depth, **extra))


def box_cells(state: np.ndarray) -> set[tuple[int, int]]:
    return {tuple(p) for p in np.argwhere((state == BOX) | (state == BOX_ON_TARGET))}


def check_room(fixed: np.ndarray, state: np.ndarray, boxes: int) -> None:
    rows, cols = fixed.shape
    assert state.shape == fixed.shape
    # border is wall; fixed has walls/floor/targets only; state adds boxes and one player
    assert (fixed[0] == WALL).all() and (fixed[-1] == WALL).all()
    assert (fixed[:, 0] == WALL).all() and (fixed[:, -1] == WALL).all()
    assert set(np.unique(fixed)) <= {WALL, FLOOR, TARGET}
    assert np.count_nonzero(fixed == TARGET) == boxes
    assert np.count_nonzero((state == BOX) | (state == BOX_ON_TARGET)) == boxes
    assert np.count_nonzero(state == PLAYER) == 1
    assert ((state == WALL) == (fixed == WALL)).all()
    assert (fixed[state == BOX_ON_TARGET] == TARGET).all()
    assert (fixed[state == BOX] != TARGET).all()
    assert np.count_nonzero(state == BOX) >= 1  # never starts solved


@pytest.mark.parametrize("rows,cols,boxes,depth", SETTINGS + [(8, 8, 2, 10), (6, 9, 2, 300)])
def test_every_ragen_room_is_valid_and_solvable(rows, cols, boxes, depth):
    for seed in range(100 if boxes == 1 else 40):
        room = generate_ragen_room(rows, cols, boxes, depth, seed)
        fixed, state = np.array(room.room_fixed), np.array(room.room_state)
        check_room(fixed, state, boxes)
        solution = solve(fixed, state)
        assert solution, f"seed {seed} unsolvable"
        env = env_for(rows, cols, boxes, depth, max_steps=500)
        env.reset(seed=seed)
        for action in solution:
            _, _, done, info = env.step(action)
        assert info["success"] and done


@pytest.mark.parametrize("rows,cols,boxes,depth", SETTINGS)
def test_every_fast_room_is_solvable_within_the_bound(rows, cols, boxes, depth):
    seeds = range(150) if boxes == 1 else range(60)
    for seed in seeds:
        room = generate_room(rows, cols, boxes, depth, seed)
        fixed, state = np.array(room.room_fixed), np.array(room.room_state)
        check_room(fixed, state, boxes)
        solution = solve(fixed, state)
        assert solution is not None, f"seed {seed} unsolvable"
        assert len(solution) >= room.min_pushes >= 1
        # replaying the solution in the env solves it, and the pushes stay within search_depth
        env = env_for(rows, cols, boxes, depth, max_steps=500, generator="fast")
        env.reset(seed=seed)
        pushes = 0
        for action in solution:
            before = box_cells(env.room_state)
            _, _, done, info = env.step(action)
            pushes += box_cells(env.room_state) != before
        assert info["success"] and done
        assert pushes <= depth


def test_fast_generation_respects_a_small_search_depth():
    # with a depth of 1 pull, the room is one push from solved
    for seed in range(30):
        room = generate_room(7, 7, 1, 1, seed)
        assert room.min_pushes == 1
        solution = solve(room.room_fixed, room.room_state)
        env = env_for(7, 7, 1, 1, generator="fast")
        env.reset(seed=seed)
        rewards = [env.step(a)[1] for a in solution]
        assert sum(r > 0 for r in rewards) == 1  # exactly one push lands the box


def test_rooms_are_memoised_and_copied():
    a, b = env_for(), env_for()
    a.reset(seed=42)
    b.reset(seed=42)
    assert a.room_state is not b.room_state
    a.room_state[:] = 0  # one env scribbling over its room leaves the other and the memo alone
    assert b.room_state.any()
    c = env_for()
    c.reset(seed=42)
    assert np.array_equal(c.room_state, b.room_state)
    assert generate_room(6, 6, 1, 300, 42) is generate_room(6, 6, 1, 300, 42)
    assert generate_ragen_room(6, 6, 1, 300, 42) is generate_ragen_room(6, 6, 1, 300, 42)


def test_fast_derived_seed_retry_is_deterministic(monkeypatch):
    from ragen.env.sokoban import generator

    real = generator._try_generate

    def failing_first_seed(*args):
        calls.append(1)
        return None if len(calls) <= generator._TRIES_PER_SEED else real(*args)

    rooms = []
    for _ in range(2):
        calls: list[int] = []
        generate_room.cache_clear()
        monkeypatch.setattr(generator, "_try_generate", failing_first_seed)
        rooms.append(generate_room(6, 6, 1, 300, 17))
        monkeypatch.setattr(generator, "_try_generate", real)
    generate_room.cache_clear()
    assert rooms[0] == rooms[1]
    assert rooms[0].seed == "17/1"
    assert rooms[0] != generate_room(6, 6, 1, 300, 17)


def test_impossible_room_raises_clearly():
    with pytest.raises(RuntimeError, match="could not generate"):
        generate_room(4, 4, 1, 300, 0)  # 2x2 inside: no box can ever be pulled off a target
    with pytest.raises(RuntimeError, match="failed after 32 retries"):
        generate_ragen_room(4, 4, 1, 300, 0)  # RAGEN's reset gives up after 32 seeds


def test_rewards_follow_gym_sokoban():
    env = env_for(max_steps=100)
    env.reset(seed=5)
    # hand-made room: player, box, target in a row
    env.room_fixed = np.array(
        [[0, 0, 0, 0, 0, 0], [0, 1, 1, 2, 1, 0], [0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]], dtype=np.uint8
    )
    env.room_state = env.room_fixed.copy()
    env.room_state[1, 1], env.room_state[1, 2] = PLAYER, BOX
    env.player_position = np.array([1, 1])
    env.boxes_on_target = 0
    obs, reward, done, info = env.step(4)  # push the box onto the target
    assert reward == pytest.approx(-0.1 + 1 + 10)
    assert done and info["success"] and info["action_is_effective"]
    assert obs.splitlines()[1] == "#_P√_#"


def test_push_off_target_and_walls():
    env = env_for(max_steps=100)
    env.reset(seed=5)
    env.room_fixed = np.array(
        [[0, 0, 0, 0, 0, 0], [0, 1, 2, 1, 1, 0], [0, 1, 1, 2, 1, 0], [0, 0, 0, 0, 0, 0]], dtype=np.uint8
    )
    env.room_state = env.room_fixed.copy()
    env.room_state[1, 1], env.room_state[1, 2], env.room_state[2, 1] = PLAYER, BOX_ON_TARGET, BOX
    env.player_position = np.array([1, 1])
    env.num_boxes = 2
    env.boxes_on_target = 1
    _, reward, done, info = env.step(4)  # push the box off its target
    assert reward == pytest.approx(-0.1 - 1)
    assert not done and not info["success"]
    _, reward, _, info = env.step(1)  # into the wall: no move, still a step
    assert reward == pytest.approx(-0.1)
    assert not info["action_is_effective"] and info["action_is_valid"]


def test_player_on_target_renders_with_its_own_symbol():
    env = env_for()
    env.reset(seed=1)
    fixed = env.room_fixed
    target = tuple(np.argwhere(fixed == TARGET)[0])
    env.room_state = fixed.copy()
    env.room_state[target] = PLAYER
    assert env.GRID_LOOKUP[6] in env.render()


def test_done_after_max_steps():
    env = env_for(max_steps=3)
    env.reset(seed=0)
    dones = [env.step(1)[2] for _ in range(3)]
    assert dones == [False, False, True] or (dones[-1] and env.boxes_on_target == env.num_boxes)
    obs, reward, done, info = env.step(2)  # after the end: nothing happens
    assert done and reward == 0.0 and not info["action_is_effective"]


def test_custom_grid_lookup_renders():
    lookup = {0: "W", 1: ".", 2: "G", 3: "C", 4: "B", 5: "A", 6: "@"}
    env = env_for(grid_lookup=lookup)
    obs = env.reset(seed=3)
    assert set(obs) <= set(lookup.values()) | {"\n"}
    assert obs.count("A") + obs.count("@") == 1
    assert env_for().reset(seed=3).translate(str.maketrans("#_O√XPS", "W.GCBA@")) == obs


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), actions=st.lists(st.integers(-1, 6), max_size=40))
def test_random_play_keeps_the_room_consistent(seed, actions):
    env = env_for(8, 8, 2, max_steps=1000)
    env.reset(seed=seed)
    walls = env.room_fixed == WALL
    for action in actions:
        env.step(action)
        assert np.count_nonzero((env.room_state == BOX) | (env.room_state == BOX_ON_TARGET)) == 2
        assert np.count_nonzero(env.room_state == PLAYER) == 1
        assert ((env.room_state == WALL) == walls).all()
        assert tuple(env.player_position) == tuple(np.argwhere(env.room_state == PLAYER)[0])


@pytest.mark.parametrize(
    "values,field",
    [
        ({"dim_x": 2, "dim_y": 6}, "dim_x"),
        ({"dim_room": (6, 2)}, "dim_room"),
        ({"dim_x": 6, "dim_y": 6, "num_boxes": 40}, "num_boxes"),
        ({"num_boxes": 0}, "num_boxes"),
        ({"max_steps": -1}, "max_steps"),
        ({"search_depth": 0}, "search_depth"),
        ({"num_boxes": "2"}, "num_boxes"),
        ({"num_boxes": True}, "num_boxes"),
        ({"grid_lookup": {0: "#"}}, "grid_lookup"),
        ({"action_lookup": {1: "Up", 2: "Down", 3: "Left", 5: "Right"}}, "action_lookup"),
        ({"render_mode": "rgb_array"}, "render_mode"),
        ({"invalid_act_score": "x"}, "invalid_act_score"),
    ],
)
def test_config_errors_name_the_field(values, field):
    with pytest.raises(EnvConfigError) as err:
        SokobanEnvConfig(**values)
    assert err.value.field == field
    with pytest.raises(ValueError, match=rf"^custom_envs\.Tag\.env_config\.{field}: "):
        make_env_config("sokoban", values, tag="Tag")


@pytest.mark.parametrize(
    "values,field,bound",
    [
        ({"dim_room": (2**40, 2**40)}, "dim_room", "the room is at most 64x64"),
        ({"dim_room": (20000, 6)}, "dim_room", "the room is at most 64x64"),
        ({"dim_x": 6, "dim_y": 65}, "dim_y", "the room is at most 64x64"),
        ({"search_depth": 2**40}, "search_depth", "must be <= 300000"),
        ({"generator": "fast", "search_depth": 10**5}, "search_depth", "must be <= 10000"),
    ],
)
def test_every_size_is_bounded_naming_the_key_and_the_bound(values, field, bound):
    with pytest.raises(ValueError, match=rf"^custom_envs\.Tag\.env_config\.{field}: .*{bound}"):
        make_env_config("sokoban", values, tag="Tag")


def test_the_largest_room_is_accepted_and_plays():
    full = SokobanEnvConfig(dim_room=(64, 64), num_boxes=62 * 62 - 2, search_depth=300000)
    assert full.dim_room == (64, 64)
    env = env_for(64, 64, 3, 10_000, generator="fast")
    assert len(env.reset(seed=1).splitlines()) == 64


def test_config_spellings():
    assert SokobanEnvConfig(dim_x=7, dim_y=9).dim_room == (7, 9)
    assert SokobanEnvConfig(dim_room=[5, 6]).dim_room == (5, 6)
    assert SokobanEnvConfig(grid_lookup={str(k): v for k, v in SokobanEnvConfig().grid_lookup.items()}).grid_lookup[0] == "#"
    assert str(EnvConfigError("num_boxes", "x")) == "num_boxes: x"


def test_non_square_rooms():
    env = env_for(6, 9, 2)
    obs = env.reset(seed=4)
    assert [len(line) for line in obs.splitlines()] == [9] * 6
    assert solve(env.room_fixed, env.room_state) is not None


def test_ragen_search_deeper_than_the_recursion_limit():
    import sys

    limit = sys.getrecursionlimit()
    room = generate_ragen_room(7, 7, 2, limit + 500, 3)
    check_room(np.array(room.room_fixed), np.array(room.room_state), 2)
    assert sys.getrecursionlimit() == limit

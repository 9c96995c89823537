"""reasoning-gym's datasets as an env (``env_type: reasoning_gym``)."""

from __future__ import annotations

import hashlib
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="needs reasoning-gym (pip install -e '.[envs]')")

from ragen.env import make_env, make_env_config  # noqa: E402
from ragen.env.check.checker import check_env  # noqa: E402
from ragen.llm.scripted import ScriptedEngine  # noqa: E402
from ragen.rollout.types import rollout_digest  # noqa: E402
from tests.rollout_helpers import ROOT, custom_envs, loop_config, sequential, specs_for  # noqa: E402

RG_TAGS = ["RGChainSum", "RGLetterCounting", "RGKnightsKnaves", "RGWordSorting"]


def test_the_seed_picks_the_question_in_any_instance():
    a, b = make_env("reasoning_gym", {"dataset": "letter_counting"}), make_env("reasoning_gym",
                                                                                {"dataset": "letter_counting"})
    assert a.reset(seed=11) == b.reset(seed=11)
    assert a.item["answer"] == b.item["answer"]
    assert len({a.reset(seed=s) for s in range(8)}) == 8


def test_the_datasets_own_scorer_gives_the_reward():
    env = make_env("reasoning_gym", {"dataset": "chain_sum", "min_terms": 2, "max_terms": 3})
    env.reset(seed=3)
    obs, reward, done, info = env.step(env.item["answer"])
    assert (reward, done, info["success"]) == (1.0, True, True)
    assert reward == env.dataset.score_answer(env.item["answer"], env.item)
    env.reset(seed=3)
    obs, reward, done, info = env.step("not a number")
    assert (reward, done, info["success"]) == (0.0, True, False)
    assert obs == "Your answer scored 0."
    # answered: a second action changes nothing
    assert env.step(env.item["answer"])[1:3] == (0.0, True)


def test_attempts_show_the_score_and_the_question_again():
    env = make_env("reasoning_gym", {"dataset": "chain_sum", "attempts": 3})
    question = env.reset(seed=4)
    obs, reward, done, _ = env.step("0")
    assert (reward, done) == (0.0, False) and obs == f"Your answer scored 0. 2 attempts left.\n{question}"
    obs, reward, done, _ = env.step("1")
    assert obs.startswith("Your answer scored 0. 1 attempt left.")
    obs, reward, done, info = env.step(env.item["answer"])
    assert (reward, done, info["success"]) == (1.0, True, True)
    env.reset(seed=4)
    for _ in range(3):
        obs, reward, done, info = env.step("0")
    assert done and not info["success"] and reward == 0.0


@pytest.mark.parametrize("env_config,match", [
    ({"dataset": "chain_sun"}, r"env_config.dataset: unknown reasoning-gym dataset 'chain_sun'; close matches: "
                               r"\['chain_sum'"),
    ({"dataset": "chain_sum", "bogus": 1}, r"env_config.bogus: not an option of reasoning-gym's ChainSumConfig"),
    ({"dataset": "chain_sum", "min_terms": 0}, r"env_config.min_terms: ChainSumConfig refuses"),
    ({"dataset": "chain_sum", "seed": 3}, r"env_config.seed: set by the env"),
    ({"dataset": "chain_sum", "attempts": 0}, r"env_config.attempts"),
    ({"dataset": "chain_sum", "max_observation_chars": 10**9}, r"env_config.max_observation_chars: must be <= "),
    ({"dataset": "chain_sum", "item_wall_s": 0}, r"env_config.item_wall_s: must be >= 0.1"),
])
def test_bad_configs_name_the_key(env_config, match):
    with pytest.raises(ValueError, match=match):
        make_env_config("reasoning_gym", env_config, tag="RG")


def test_a_question_longer_than_the_bound_fails_the_reset_naming_the_options():
    env = make_env("reasoning_gym", {"dataset": "chain_sum", "min_terms": 400, "max_terms": 400,
                                     "max_observation_chars": 1000})
    with pytest.raises(ValueError, match=r"max_observation_chars: reasoning-gym's chain_sum with options "
                                         r"\{'min_terms': 400, 'max_terms': 400\} \(seed 5\) gave an observation of "
                                         r"[\d,]+ characters, more than max_observation_chars=1,000"):
        env.reset(seed=5)
    assert env.item is None  # refused by the scorer's count, before this process made it
    env = make_env("reasoning_gym", {"dataset": "chain_sum", "min_terms": 400, "max_terms": 400})
    assert len(env.reset(seed=5)) > 1000  # the default bound holds it


@pytest.mark.timeout(120)
def test_a_question_that_computes_for_hours_fails_the_reset_within_its_bound():
    """chain_sum draws 10**max_digits: a big-integer power that holds this interpreter's GIL,
    so no thread here could time it out; it is made in a scorer first, and killed there."""
    env = make_env("reasoning_gym", {"dataset": "chain_sum", "max_digits": 10**9, "item_wall_s": 1.0})
    with pytest.raises(RuntimeError, match=r"reasoning-gym's chain_sum with options \{'max_digits': 1000000000\} "
                                           r"\(seed 0\) gave no question: the scorer ran past its 1 s \(a question's "
                                           r"bounds: item_wall_s=1, scorer_memory_mb=1024\)"):
        env.reset(seed=0)


@pytest.mark.timeout(120)
def test_env_timeout_s_ends_a_reset_that_computes_for_hours():
    from ragen.rollout.types import StopReason

    envs = custom_envs(RGHuge={"env_type": "reasoning_gym", "max_actions_per_traj": 1, "env_instruction": "sum",
                               "env_config": {"dataset": "chain_sum", "max_digits": 10**9, "item_wall_s": 20.0}})
    # 10 s: the other env's reset may start a scorer (about 1 s on an idle core)
    try:
        trajectories = sequential(specs_for(["RGHuge", "RGChainSum"], [1, 1], 1, envs),
                                  loop_config(max_turn=1, env_timeout_s=10.0, env_retries=0))
    finally:
        _kill(_scorer_processes())  # the abandoned reset's scorer computes until item_wall_s: not past this test
    assert [t.stop_reason for t in trajectories] == [StopReason.TIMEOUT, StopReason.DONE]
    assert trajectories[0].error == "EnvTimeout: env call reset took longer than 10.0 s"


@pytest.mark.parametrize("tag", RG_TAGS)
def test_the_shipped_tags_pass_the_env_checker(tag):
    entry = custom_envs()[tag]
    report = check_env(entry["env_type"], entry["env_config"], seeds=4)
    assert report.ok and not report.warnings(), report.format()


def test_a_group_shares_its_question_and_parallel_equals_sequential():
    from ragen.llm_agent import ParallelRolloutManager, ParallelSettings, SharedLLMInferenceManager

    specs = specs_for(RG_TAGS, [1, 1, 1, 1], 2, custom_envs())
    config = loop_config(max_turn=3)
    ref = sequential(specs, config, ScriptedEngine(malformed_rate=0.1))
    for first, second in zip(ref[::2], ref[1::2]):
        assert first.turns[0].observation == second.turns[0].observation
    with SharedLLMInferenceManager(ScriptedEngine(malformed_rate=0.1)) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2)) as prm:
        result = prm.rollout(specs, config)
    assert rollout_digest(result.trajectories) == rollout_digest(ref)
    assert result.metrics["parallel/fallbacks"] == 0
    assert all(t.error is None for t in result.trajectories)


def test_the_checker_takes_a_dataset_by_name(capsys):
    from ragen.tools.check import main

    assert main(["reasoning_gym:chain_sum", "--seeds", "2"]) == 0
    assert "OK: 0 failed" in capsys.readouterr().out
    assert main(["reasoning_gym:chain_sun", "--seeds", "2"]) == 1
    assert "close matches: ['chain_sum'" in capsys.readouterr().out


@pytest.mark.parametrize("dataset", ["arc_1d", "pool_matrix", "prime_factorization", "tsumego"])
def test_datasets_that_pickle_badly_use_the_global_generators_or_raise_in_scoring_pass_the_checker(dataset):
    """arc_1d holds lambdas (not pickled: built again from the seed), pool_matrix draws from
    np.random (seeded privately), prime_factorization's scorer raises on text (score 0), tsumego's
    config has no validate."""
    report = check_env("reasoning_gym", {"dataset": dataset}, seeds=3)
    assert report.ok and not report.warnings(), report.format()


# ----- answers that a scorer evaluates: never in this process, never as code, never for long ------------------

EVALUATING = ["binary_matrix", "countdown", "intermediate_integration", "n_queens", "polynomial_multiplication",
              "puzzle24", "simple_integration", "spiral_matrix", "string_insertion"]
# a file the hostile answers touch, one per checkout; its path has the same length wherever the
# checkout is, so the answers (cut at their tag's max_tokens) are the same everywhere
RAN = Path(tempfile.gettempdir()) / f"rg-ran-{hashlib.sha1(str(ROOT).encode()).hexdigest()[:8]}"
TOUCH = f"__import__('os').system('touch {RAN}')"
TOWER = "9**9**9**9"  # holds an interpreter (and its GIL) for hours


def hostile_answer(prompt: str, rng) -> tuple[str, float]:
    """The scripted policy's answers (``engine.answers``): code, or a number that takes hours to compute."""
    return (TOUCH if rng.random() < 0.5 else TOWER), 0.0


def _scorer_processes() -> list[int]:
    """The processes under this one that run reasoning-gym's scorer."""
    found, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"reasoning_gym/scorer.py" in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def _kill(pids: list[int]) -> None:
    """SIGKILL each, and wait until each has ended (a zombie, or reaped)."""
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        break
            except OSError:
                break
            time.sleep(0.01)


def test_the_evaluating_datasets_are_the_ones_whose_scorer_evaluates():
    """Every dataset whose score_answer (or a method it calls) has eval or parse_expr is on the list."""
    import inspect
    import re

    from reasoning_gym.factory import DATASETS

    from ragen.env.reasoning_gym.answers import EVALUATING as LISTED

    found = set()
    for name, (cls, _) in DATASETS.items():
        source = inspect.getsource(cls.score_answer)
        called = set(re.findall(r"self\.(\w+)\(", source))
        source += "".join(inspect.getsource(getattr(cls, m)) for m in called if callable(getattr(cls, m, None)))
        if re.search(r"\beval\(|parse_expr|sympify|\bexec\(", source):
            found.add(name)
    assert found - {"number_sorting"} == set(EVALUATING) == set(LISTED)  # number_sorting evals its own answer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dataset", EVALUATING)
def test_code_in_an_answer_never_runs_and_scores_0(dataset):
    RAN.parent.mkdir(exist_ok=True)
    RAN.unlink(missing_ok=True)
    env = make_env("reasoning_gym", {"dataset": dataset})
    env.reset(seed=5)
    obs, reward, done, info = env.step(TOUCH)
    assert not RAN.exists()
    assert (reward, done, info["success"]) == (0.0, True, False)
    assert info["score_error"].startswith("not evaluated:")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dataset", EVALUATING + ["chain_sum", "letter_counting"])
def test_right_answers_still_score_1_and_list_forms_are_still_evaluated(dataset):
    env = make_env("reasoning_gym", {"dataset": dataset})
    for seed in range(4):
        env.reset(seed=seed)
        obs, reward, done, info = env.step(env.item["answer"])
        assert (reward, info["success"], "score_error" in info) == (1.0, True, False), (seed, env.item["answer"])
    lists = {"binary_matrix": (lambda a: str([[int(v) for v in row.split()] for row in a.splitlines()]), 0.1),
             "spiral_matrix": (lambda a: str([int(v) for v in a.split()]), 0.1),
             "string_insertion": (lambda a: str(list(a)), 0.1),
             "n_queens": (lambda a: str([row.split() for row in a.splitlines()]), 0.5)}
    if dataset in lists:  # the scorers' own partial credit for the answer written as a Python list
        as_list, partial = lists[dataset]
        env.reset(seed=1)
        assert env.step(as_list(env.item["answer"]))[1] == partial


@pytest.mark.parametrize("answer,allowed", [
    ("-x**3/3 + sin(2*x)*exp(x) + C", True), ("Integral(x**3*cos(2*x), x) + C", True), ("(4 + 4) * (9 - 6)", True),
    ("x < 2", True), (TOWER, True),
    (TOUCH, False), ("x.__class__", False), ("x[0]", False), ("(lambda: 1)()", False), ("[i for i in x]", False),
    ("f'{x}'", False), ("sin('x')", False), ("eval(x)", False), ("print(1)", False), ("sin(x=1)", False),
    ("_x + 1", False), ("x if x else 1", False), ("x # comment", False), ("x; y", False), ("(" * 500, False),
    ("1" * 200_000, False),
])
def test_the_allow_list_of_a_sympy_scorer(answer, allowed):
    from ragen.env.reasoning_gym.answers import refusal

    assert (refusal("simple_integration", answer, {"answer": ""}) is None) == allowed


@pytest.mark.parametrize("answer,allowed", [
    ("[[0, 1], [1, -2]]", True), ("((0, 1),)", True), ("['a', 'b']", False), ("[x]", False), ("[1 + 1]", False),
    ("[print(1)]", False), ("[].__class__", False),
])
def test_the_allow_list_of_an_eval_scorer(answer, allowed):
    from ragen.env.reasoning_gym.answers import refusal

    assert (refusal("binary_matrix", answer, {"answer": "0 1"}) is None) == allowed
    assert refusal("binary_matrix", "0 1", {"answer": "0 1"}) is None  # the expected text is not evaluated
    assert refusal("string_insertion", "['a', 'b']", {"answer": "ab"}) is None  # a list of letters: strings
    assert refusal("chain_sum", "__import__('os')", {"answer": "1"}) is None  # its scorer does not evaluate


@pytest.mark.timeout(120)
def test_an_answer_that_computes_for_hours_scores_0_within_the_wall_bound_and_the_episode_goes_on():
    env = make_env("reasoning_gym", {"dataset": "puzzle24", "attempts": 2, "scorer_wall_s": 1.0})
    env.reset(seed=2)
    start = time.monotonic()
    obs, reward, done, info = env.step(TOWER)
    assert time.monotonic() - start < 6.0
    assert (reward, done) == (0.0, False) and "ran past its 1 s" in info["score_error"]
    assert env.step(env.item["answer"])[1:3] == (1.0, True)  # a fresh scorer
    other = make_env("reasoning_gym", {"dataset": "countdown"})
    other.reset(seed=3)
    assert other.step(other.item["answer"])[1] == 1.0


@pytest.mark.timeout(120)
def test_the_scorers_sandbox_holds_an_answer_the_allow_list_missed(tmp_path):
    """Past the allow-list (as a scorer's own bug would be), code runs in the sandbox, not here."""
    from ragen.env.reasoning_gym.scoring import scorer_pool

    config = make_env_config("reasoning_gym", {"dataset": "binary_matrix"}, tag="RG")
    env = make_env("reasoning_gym", {"dataset": "binary_matrix"})
    env.reset(seed=1)
    marker = tmp_path / "ran"
    score = scorer_pool(config.scorer_limits()).score(
        "binary_matrix", {}, 1, env.item, f"__import__('os').system('touch {marker}') or [[0]]", 5.0)
    assert score.value == 0.0 and not marker.exists()


@pytest.mark.timeout(120)
def test_the_pool_survives_a_killed_scorer():
    import threading

    from ragen.env.reasoning_gym.scoring import scorer_pool

    config = make_env_config("reasoning_gym", {"dataset": "puzzle24"}, tag="RG")
    pool = scorer_pool(config.scorer_limits())
    env = make_env("reasoning_gym", {"dataset": "puzzle24"})
    env.reset(seed=4)
    assert pool.score("puzzle24", {}, 4, env.item, env.item["answer"], 5.0).value == 1.0
    _kill(_scorer_processes())  # killed while idle: the next answer gets another
    assert pool.score("puzzle24", {}, 4, env.item, env.item["answer"], 30.0).value == 1.0
    result = []
    asked = threading.Thread(target=lambda: result.append(pool.score("puzzle24", {}, 4, env.item, TOWER, 60.0)))
    asked.start()
    time.sleep(1.0)
    _kill(_scorer_processes())  # killed while scoring: that answer scores 0, saying so
    asked.join(timeout=30)
    assert result[0].value == 0.0 and "the scorer died" in result[0].error
    assert pool.score("puzzle24", {}, 4, env.item, env.item["answer"], 30.0).value == 1.0


@pytest.mark.timeout(120)
def test_a_forked_child_scores_with_scorers_of_its_own():
    import multiprocessing

    env = make_env("reasoning_gym", {"dataset": "countdown"})
    env.reset(seed=6)
    assert env.step(env.item["answer"])[1] == 1.0  # this process's pool started
    parents = set(_scorer_processes())
    queue = multiprocessing.get_context("fork").Queue()

    def child():
        env.reset(seed=6)
        queue.put((env.step(env.item["answer"])[1], set(_scorer_processes())))

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    reward, childs = queue.get(timeout=60)
    process.join(timeout=60)
    assert reward == 1.0 and childs and not childs & parents
    env.reset(seed=6)
    assert env.step(env.item["answer"])[1] == 1.0


def test_the_sandbox_key_is_checked_at_config_read(monkeypatch):
    from ragen.env.reasoning_gym import config as rg_config
    from ragen.env.sandbox import SandboxUnavailable

    with pytest.raises(ValueError, match=r"env_config.sandbox: must be one of"):
        make_env_config("reasoning_gym", {"dataset": "chain_sum", "sandbox": "docker"}, tag="RG")

    def unavailable(name):
        raise SandboxUnavailable("no sandbox isolates untrusted code here (...); ... say so by name: sandbox: none")

    monkeypatch.setattr(rg_config, "backend", unavailable)
    with pytest.raises(ValueError, match=r"env_config.sandbox: no sandbox isolates"):
        make_env_config("reasoning_gym", {"dataset": "chain_sum"}, tag="RG")


def _hostile_specs():
    envs = custom_envs(RGPuzzle24={"env_type": "reasoning_gym", "max_actions_per_traj": 1, "env_instruction": "24",
                                   "env_config": {"dataset": "puzzle24", "scorer_wall_s": 1.0}})
    return specs_for(["RGPuzzle24", "RGChainSum"], [2, 1], 2, envs)


@pytest.mark.timeout(180)
def test_a_sequential_rollout_of_hostile_answers_finishes():
    RAN.parent.mkdir(exist_ok=True)
    RAN.unlink(missing_ok=True)
    trajectories = sequential(_hostile_specs(), loop_config(max_turn=1),
                              ScriptedEngine(answers="tests.test_env_reasoning_gym:hostile_answer"))
    assert len(trajectories) == 6 and all(t.error is None for t in trajectories)
    assert not RAN.exists()
    assert all(t.turns[-1].reward == 0.0 for t in trajectories)
    reasons = {t.turns[-1].info["score_error"].split(":")[0] for t in trajectories[:4] if t.turns[-1].executed_actions}
    assert reasons == {"not evaluated", "the scorer ran past its 1 s"}


@pytest.mark.timeout(180)
def test_a_loky_rollout_of_hostile_answers_finishes():
    from ragen.llm_agent import ParallelRolloutManager, ParallelSettings, SharedLLMInferenceManager

    RAN.parent.mkdir(exist_ok=True)
    RAN.unlink(missing_ok=True)
    config = loop_config(max_turn=1, env_timeout_s=30.0)
    engine = ScriptedEngine(answers="tests.test_env_reasoning_gym:hostile_answer")
    with SharedLLMInferenceManager(engine) as shared, ParallelRolloutManager(shared, ParallelSettings(n_jobs=2)) as prm:
        result = prm.rollout(_hostile_specs(), config)
    assert result.metrics["parallel/fallbacks"] == 0
    assert all(t.error is None and t.turns[-1].reward == 0.0 for t in result.trajectories)
    assert not RAN.exists()


def test_a_reason_in_the_info_does_not_break_ragens_metrics():
    from ragen.llm_agent.es_manager import EnvStateManager

    envs = custom_envs(RGBinary={"env_type": "reasoning_gym", "max_actions_per_traj": 1, "env_instruction": "m",
                                 "env_config": {"dataset": "binary_matrix"}})
    split = {"env_groups": 1, "group_size": 1, "env_configs": {"tags": ["RGBinary"], "n_groups": [1]}}
    es = EnvStateManager({"custom_envs": envs, "seed": {"train": 1, "val": 2},
                          "es_manager": {"format_penalty": -0.1, "train": split, "val": split}}, mode="train")
    try:
        es.reset()
        es.step([{"env_id": 0, "actions": [TOUCH], "llm_response": "", "llm_raw_response": ""}])
        assert es.get_rollout_states()[0]["metrics"]["RGBinary/success"] == 0.0
    finally:
        es.close()

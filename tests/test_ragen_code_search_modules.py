"""RAGEN's own ``deepcoder`` and ``search`` env modules, unchanged (``tests/fixtures/ragen/``), on our loop.

DeepCoder plays a local Parquet folder of the shipped problems in RAGEN's
prepared format; search plays a local Parquet of the shipped questions against
our retrieval server. Each runs with the scripted policy sequentially and on
loky workers, with identical trajectories, and some episodes succeed.
"""

from __future__ import annotations

import random

import pytest

from ragen.env.code.harness import extract_code
from ragen.env.code.pool import scripted_answer as code_answer
from ragen.env.code.problems import problem
from ragen.llm.scripted import ScriptedEngine
from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings
from ragen.rollout.types import StopReason
from ragen.serving import SharedLLMInferenceManager

from tests.rollout_helpers import loop_config, sequential, specs_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::DeprecationWarning")]
pytest.importorskip("datasets", reason="RAGEN's deepcoder and search modules load their data with datasets "
                                       "(pip install -e '.[dev]')")
pandas = pytest.importorskip("pandas")

FIXTURES = "tests.fixtures.ragen"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """datasets reads the local files only (the workers inherit it)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def ragen_code_answer(prompt: str, rng: random.Random):
    """The code pool's answer as RAGEN's deepcoder takes it: the program itself (its sandbox runs the
    action's text as it is, fences included)."""
    found = code_answer(prompt, rng)
    return None if found is None else (extract_code(found[0]), found[1])


def _deepcoder_rows(n: int) -> list[dict]:
    """The first ``n`` shipped problems as RAGEN's ``prepare_deepcoder_data`` writes its rows."""
    import json

    rows = []
    for seed in range(n):
        p = problem(seed)
        if p.kind == "call":
            tests = [{"input": "\n".join(repr(a) for a in t.input), "output": str(t.expected),
                      "testtype": "functional", "metadata": {"func_name": p.func_name}} for t in p.tests]
        else:
            tests = [{"input": t.input, "output": t.expected, "testtype": "stdin_stdout",
                      "metadata": {"func_name": None}} for t in p.tests]
        rows.append({"question": p.statement, "ground_truth": json.dumps(tests), "data_source": "livecodebench",
                     "uid": f"deepcoder_{seed}", "index": seed, "starter_code": p.starter_code,
                     "metadata": json.dumps({"func_name": p.func_name} if p.func_name else {})})
    return rows


def _parallel(specs, loop, engine_answers: str):
    with SharedLLMInferenceManager(ScriptedEngine(answers=engine_answers)) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="loky")) as prm:
        result = prm.rollout(specs, loop)
    assert result.metrics["parallel/fallbacks"] == 0
    return result.trajectories


def test_ragens_deepcoder_module_plays_local_problems_parallel_equal_to_sequential(tmp_path, capfd):
    folder = tmp_path / "deepcoder"
    folder.mkdir()
    pandas.DataFrame(_deepcoder_rows(24)).to_parquet(folder / "test.parquet")
    envs = {"DeepCoder": {  # RAGEN's config/envs.yaml entry, with local problems
        "env_type": f"{FIXTURES}.deepcoder:DeepCoderEnv", "config_type": f"{FIXTURES}.deepcoder:DeepCoderEnvConfig",
        "max_actions_per_traj": 1, "max_tokens": 4000,
        "env_instruction": "Solve the programming problem in Python. Give the complete code inside <answer></answer>.",
        "env_config": {"dataset_path": str(folder), "cache_dir": str(tmp_path / "cache"), "split": "test"}}}
    specs = specs_for(["DeepCoder"], [8], 1, envs)
    loop = loop_config(max_turn=1, max_tokens=4000)  # the tag's 4000 for a program
    answers = "tests.test_ragen_code_search_modules:ragen_code_answer"
    reference = sequential(specs, loop, engine=ScriptedEngine(answers=answers))
    assert all(t.stop_reason is StopReason.DONE for t in reference), [t.error for t in reference]
    statements = {problem(s).statement for s in range(24)}
    assert all(t.turns[0].observation in statements for t in reference)  # a local problem, not the fallback
    assert 0 < sum(t.success for t in reference) < len(reference)  # right and wrong programs, judged
    assert min(t.turns[0].info["total_tests"] for t in reference) > 0
    assert _parallel(specs, loop, answers) == reference
    assert "[DeepCoderSandbox] test=0" in capfd.readouterr().out  # RAGEN's own sandbox judged them


def test_ragens_search_module_plays_against_our_retrieval_server_parallel_equal_to_sequential(tmp_path,
                                                                                            monkeypatch):
    """RAGEN's module sends no key of its own: requests reads the server's from a netrc file."""
    pytest.importorskip("bm25s")
    pytest.importorskip("gymnasium")
    from ragen.env.search.corpus import questions, shipped_corpus
    from ragen.env.search.server import RetrievalServer
    from tests.test_env_search import netrc_with

    data = tmp_path / "train.parquet"
    pandas.DataFrame([{"question": q.question, "ground_truth": q.answer, "data_source": "towns"}
                      for q in questions()[:200]]).to_parquet(data)
    with RetrievalServer(shipped_corpus(filler=500)) as server:
        monkeypatch.setenv("NETRC", str(netrc_with(tmp_path, server.key)))  # the workers inherit it
        envs = {"SearchQA": {  # RAGEN's config/envs.yaml entry, with local questions and our server
            "env_type": f"{FIXTURES}.search:SearchEnv", "config_type": f"{FIXTURES}.search:SearchEnvConfig",
            "max_actions_per_traj": 5, "max_tokens": 400,
            "env_instruction": "Answer the question by searching: search[<query>], then finish[<answer>].",
            "env_config": {"train_path": str(data), "retrieval_server_url": server.url, "max_steps": 5,
                           "max_search_results": 3}}}
        specs = specs_for(["SearchQA"], [8], 1, envs)
        loop = loop_config(max_turn=5)
        answers = "ragen.env.search.pool:scripted_answer"
        reference = sequential(specs, loop, engine=ScriptedEngine(answers=answers))
        parallel = _parallel(specs, loop, answers)
    assert all(t.stop_reason is StopReason.DONE for t in reference), [t.error for t in reference]
    searched = [t.turns[0] for t in reference]
    assert all(x.info["action_type"] == "search" and "[Document 1]" in x.steps[0].observation for x in searched)
    assert sum(t.success for t in reference) >= 3
    assert parallel == reference

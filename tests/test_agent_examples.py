"""The agent examples (examples/agents/, config/agent_*.yaml): the calculator and its reward, and
each example's agent played through ``LLMAgentProxy`` on the scripted engine, as its shipped
config composes it: the right answer scores 1, a model that answers badly scores 0 without an
error, and every training sample is the ids, loss mask and log-probs the gateway recorded.

A framework's test skips, naming its package, where it is missing (the dev extra has them all).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from examples.agents.calc import TASKS, calculate, evaluate, last_number, make_tasks, score
from ragen.config_files import compose
from ragen.gateway.server import GatewayServer
from ragen.llm.scripted import ScriptedEngine
from ragen.llm.tool_calls import call_text
from ragen.llm_agent import AgentSetup, LLMAgentProxy
from ragen.rollout.context import ContextManager
from ragen.rollout.types import StopReason
from ragen.trainer.config import TrainerConfig
from ragen.trainer.samples import make_samples
from ragen.trainer.tracking import read_metrics
from tests.rollout_helpers import ROOT
from tests.test_agent_samples import assert_rows_are_the_records

# config name -> (its tag, the package its agent needs)
EXAMPLES = {
    "agent_openai": ("CalcOpenAI", "openai"),
    "agent_agents_sdk": ("CalcAgentsSDK", "agents"),
    "agent_langgraph": ("CalcLangGraph", "langgraph"),
    "agent_smolagents": ("CalcSmolagents", "smolagents"),
    "agent_command": ("CalcCommand", "openai"),
}
QUESTION = re.compile(r"What is ([0-9+\-*/ ()]+)\?")


# ---------------------------------------------------------------- scripted policies (engine.answers)


def _question(prompt: str) -> str | None:
    found = QUESTION.findall(prompt)
    return found[-1].strip() if found else None


def _answer(prompt: str, value: str) -> tuple[str, float]:
    if "final_answer" in prompt:  # smolagents answers through its final_answer tool
        return call_text("final_answer", {"answer": value}), -1.0
    return f"The answer is {value}.", -1.0


def solves(prompt: str, rng) -> tuple[str, float] | None:
    """Calls the calculator on the question, then answers with what it said."""
    expression = _question(prompt)
    if expression is None:
        return None
    result = re.search(re.escape(expression) + r" = (-?[\d.]+)", prompt)
    if result:
        return _answer(prompt, result.group(1))
    return call_text("calculator", {"expression": expression}), -0.5


def not_json(prompt: str, rng) -> tuple[str, float]:
    """A call whose arguments are not JSON: the gateway gives it back as text, as it does a call
    whose arguments do not match the tool's schema, or of a tool not listed."""
    return '<tool_call>\n{"name": "calculator", "arguments": {oops\n</tool_call>', -0.5


def never_answers(prompt: str, rng) -> tuple[str, float]:
    """A calculator call every time, of something the calculator refuses."""
    return call_text("calculator", {"expression": "__import__('os').getcwd()"}), -0.5


# ---------------------------------------------------------------- the task


@pytest.mark.parametrize("expression, says", [
    ("37 * 41 + 5", "37 * 41 + 5 = 1522"), (" (1 + 2) * -3 ", "(1 + 2) * -3 = -9"), ("7 / 2", "7 / 2 = 3.5"),
    ("84 / 4 - 1", "84 / 4 - 1 = 20"), ("1 / 0", "error: division by zero"),
    ("2 ** 8", "error: only numbers, + - * / and parentheses are allowed, not Pow"),
    ("__import__('os').getcwd()", "error: only numbers, + - * / and parentheses are allowed, not Call"),
    ("x + 1", "error: only numbers, + - * / and parentheses are allowed, not Name"),
    ("'1' + '2'", "error: only numbers, + - * / and parentheses are allowed, not Constant"),
    ("True + 1", "error: only numbers, + - * / and parentheses are allowed, not Constant"),
    ("1 +", "error: not an arithmetic expression: '1 +'"),
    ("1" * 201, "error: the expression must be text of at most 200 characters"),
])
def test_the_calculator_evaluates_arithmetic_and_refuses_anything_else(expression, says):
    assert calculate(expression) == says


def test_the_calculator_never_raises_on_what_a_model_wrote():
    for expression in ("(" * 100 + "1" + ")" * 100, "-" * 199 + "1", "9" * 99 + "*" + "9" * 99, "1e308 * 10", None, 5):
        assert isinstance(calculate(expression), str)


@pytest.mark.parametrize("final, reward, given", [
    ("<answer>The answer is 1522.</answer>", 1.0, "1522"), ("1,522", 1.0, "1522"), ("1522.0", 1.0, "1522.0"),
    ("37 * 41 + 5 = 1522", 1.0, "1522"), ("1522, or maybe 1523", 0.0, "1523"), ("15220", 0.0, "15220"),
    ("I cannot tell.", 0.0, None), ("", 0.0, None),
])
def test_the_reward_is_1_when_the_final_answers_last_number_is_right(final, reward, given):
    result = score({"answer": 1522}, final, tool_calls=2)
    assert (result["reward"], result["success"], result["given"]) == (reward, reward == 1.0, given)
    assert result["tool_calls"] == 2 and json.loads(json.dumps(result)) == result
    assert last_number("a -58 b") == "-58"


def test_the_tasks_file_holds_the_generated_tasks_each_answer_its_expressions_value():
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines()]
    assert tasks == make_tasks(64) and len({t["expression"] for t in tasks}) == 64
    for task in tasks:
        assert task["question"] == f"What is {task['expression']}?" and evaluate(task["expression"]) == task["answer"]


# ---------------------------------------------------------------- each agent, one rollout


def agent_setup(config_name: str, group_size: int = 2) -> AgentSetup:
    """The example's shipped config, played in this process (sequential: its gateway's sessions are
    seen here), one group; answers long enough for the scripted engine's bytes."""
    return AgentSetup.from_config(compose(config_name, [
        "agent_proxy.use_parallel_rollout=false", "es_manager.train.env_groups=1",
        f"es_manager.train.group_size={group_size}", "es_manager.train.env_configs.n_groups=[1]",
        "ctx_manager.generation.response_length=512"], where=ROOT / "config"))


def rollout(config_name: str, policy: str, monkeypatch, group_size: int = 2):
    """The rollout's result, and the sessions its gateway opened (by env id)."""
    tag, package = EXAMPLES[config_name]
    pytest.importorskip(package, reason=f"{package} (the dev extra has it: pip install -e '.[dev]')")
    monkeypatch.chdir(ROOT)  # the command's script path is the repository's
    sessions = {}
    open_session = GatewayServer.open_session

    def recorded(self, **kw):
        session = open_session(self, **kw)
        sessions[session.env_id] = session
        return session

    monkeypatch.setattr(GatewayServer, "open_session", recorded)
    engine = ScriptedEngine(answers=f"tests.test_agent_examples:{policy}")
    with LLMAgentProxy(agent_setup(config_name, group_size), engine) as proxy:
        result = proxy.rollout("train")
    assert {t.tag for t in result.trajectories} == {tag}
    return result, sessions, engine


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
@pytest.mark.parametrize("config_name", EXAMPLES)
def test_each_example_agent_scores_its_rollout_and_trains_the_gateways_records(config_name, monkeypatch):
    result, sessions, engine = rollout(config_name, "solves", monkeypatch)
    [answer] = {t.program["info"]["answer"] for t in result.trajectories}  # a group, one task
    for traj in result.trajectories:
        assert traj.stop_reason == StopReason.DONE and traj.error is None, traj.program
        info = traj.program["info"]
        assert traj.reward == 1.0 and info["success"] and info["tool_calls"] == 1, info
        assert float(info["given"]) == answer
        assert len(traj.turns) == len(sessions[traj.env_id].records) == 2  # a calculator call, then the answer
    context = agent_setup(config_name).loop.context
    ctx = ContextManager(context)
    rows = ctx.formulate_rollouts([(s, t.turns) for t, s in zip(result.trajectories, result.specs)], engine.chat)
    for traj, episode_rows in zip(result.trajectories, rows):
        assert_rows_are_the_records(episode_rows, sessions[traj.env_id].records)
    # smolagents rewrites its history as text: a sample per call; the others' chats grow: one sample
    assert [len(r) for r in rows] == [2 if config_name == "agent_smolagents" else 1] * 2
    samples, _ = make_samples(result, ctx, engine.chat, TrainerConfig(), context)
    flat = [row for episode_rows in rows for row in episode_rows]
    assert len(samples) == len(flat)
    for sample, row in zip(samples, flat):
        assert sample.input_ids == row["input_ids"] and sample.loss_mask == row["loss_mask"]
        trained = [lp for lp, m in zip(row["behaviour_logprobs"], row["loss_mask"]) if m]
        assert sample.behaviour_logp == trained and not any(math.isnan(lp) for lp in trained)


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
@pytest.mark.parametrize("config_name", EXAMPLES)
@pytest.mark.parametrize("policy", ["not_json", "never_answers"])
def test_a_model_that_answers_badly_scores_0_and_the_episode_still_trains(config_name, policy, monkeypatch):
    result, sessions, _ = rollout(config_name, policy, monkeypatch, group_size=1)
    [traj] = result.trajectories
    assert traj.stop_reason == StopReason.DONE and traj.error is None, traj.program
    assert traj.reward == 0.0 and not traj.success and traj.turns
    assert 1 <= len(sessions[traj.env_id].records) <= 3  # MAX_TURNS: a model that never answers stops there
    if policy == "never_answers":
        assert len(sessions[traj.env_id].records) == 3


# ---------------------------------------------------------------- train.py


@pytest.mark.timeout(300)
def test_train_py_trains_the_openai_example_as_docs_agents_md_shows(tiny_model_path, tmp_path):
    """``python train.py --config-name agent_openai`` (docs/agents.md, *Examples*), one step on the
    tiny model: its agents play in loky workers, and every trained token has its log-prob."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "train.py", "--config-name", "agent_openai", f"model_path={tiny_model_path}",
                           f"hydra.run.dir={tmp_path / 'hydra'}", f"trainer.default_local_dir={run}",
                           "trainer.total_training_steps=1", "trainer.test_freq=0",
                           "ctx_manager.generation.response_length=16"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    [row] = read_metrics(run / "metrics.jsonl")
    assert row["step"] == 1 and row["batch/n_episodes"] == 8, row
    assert row["off_policy/logprob_token_frac"] == 1.0
    assert (run / "learning_curve.png").stat().st_size > 0

"""The env checker (``ragen.env.check``): built-in envs pass; each broken env in
``tests.fault_envs`` gets the failure that names its defect, with a fix."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from ragen.env.base import BaseEnvConfig, BaseLanguageBasedEnv, make_rng, unchanged_step
from ragen.env.check import CheckReport, check_env
from ragen.tools.check import main, parse_config_args

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = {
    "sokoban": {"dim_x": 6, "dim_y": 6, "num_boxes": 1},
    "frozen_lake": {"size": 4, "is_slippery": True},
    "bandit": None,
    "countdown": {"num_count": 3},
}


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))


def statuses(report: CheckReport) -> dict[str, str]:
    return {r.name: r.status for r in report.results}


@pytest.mark.parametrize("env_type", list(BUILTIN))
def test_builtin_envs_pass(env_type):
    report = check_env(env_type, BUILTIN[env_type], seeds=4)
    assert report.ok, report.format()
    assert not report.warnings(), report.format()
    assert {"build", "action_lookup", "reset", "step", "info_keys", "invalid_action", "determinism", "global_rng",
            "seeds_differ", "isolation", "shared_state", "pickle_config", "pickle_env", "timing"} <= set(statuses(report))
    assert report.timings["reset_mean_ms"] > 0 and report.timings["step_p95_ms"] > 0


@pytest.mark.parametrize("env,failed,fix", [
    # (env class in tests.fault_envs, checks that must fail, words the fix must contain)
    ("GlobalRngEnv", {"global_rng", "isolation"}, "make_rng"),
    ("UnseededEnv", {"determinism"}, "default_rng(seed)"),
    ("SharedStateEnv", {"isolation", "shared_state"}, "instance"),
    ("WrongTypesEnv", {"reset", "step"}, "4-tuple"),
    ("LooseTypesEnv", {"step"}, "float"),
    ("MissingInfoEnv", {"info_keys"}, "action_is_valid"),
    ("LockEnv", {"pickle_env"}, "__getstate__"),
    ("LambdaEnv", {"pickle_env"}, "module-level functions"),
    ("EmptyLookupEnv", {"action_lookup"}, "ACTION_LOOKUP"),
])
def test_broken_env_gets_the_right_failure_and_fix(env, failed, fix):
    report = check_env(f"tests.fault_envs:{env}", seeds=4)
    assert not report.ok
    got = {r.name for r in report.failures()}
    assert got == failed, report.format()
    assert any(fix in report[name].fix for name in failed), report.format()
    for name in failed:
        assert report[name].message and report[name].fix


def test_a_discrete_env_raising_on_unknown_ids_is_a_warning():
    """RAGEN's own envs raise on an id outside ACTION_LOOKUP; the loop never
    passes one to a discrete env, so the checker warns instead of failing."""
    report = check_env("tests.fault_envs:RaisingOnInvalidEnv", seeds=4)
    assert report.ok and report["invalid_action"].status == "warn", report.format()
    assert "KeyError" in report["invalid_action"].message and "never passes" in report["invalid_action"].fix


def test_failure_messages_name_the_culprit():
    shared = check_env("tests.fault_envs:SharedStateEnv", seeds=3)
    assert "SharedStateEnv.history" in shared["shared_state"].message
    assert "SharedStateEnv.history" in shared["isolation"].fix
    lock = check_env("tests.fault_envs:LockEnv", seeds=2)
    assert "LockEnv.lock" in lock["pickle_env"].message and "_thread.lock" in lock["pickle_env"].message
    lam = check_env("tests.fault_envs:LambdaEnv", seeds=2)
    assert "reward_fn" in lam["pickle_env"].message and "lambda" in lam["pickle_env"].message
    gym = check_env("tests.fault_envs:WrongTypesEnv", seeds=2)
    assert "terminated and truncated" in gym["step"].fix
    loose = check_env("tests.fault_envs:LooseTypesEnv", seeds=2)
    assert "reward is str" in loose["step"].message and "done is int" in loose["step"].message
    unseeded = check_env("tests.fault_envs:UnseededEnv", seeds=2)
    assert "two fresh instances differ at reset" in unseeded["determinism"].message
    assert unseeded["isolation"].status == "skip"


def test_same_episode_for_every_seed_is_a_warning_only():
    report = check_env("tests.fault_envs:ConstantEnv", seeds=4)
    assert report.ok
    assert report["seeds_differ"].status == "warn" and "seed" in report["seeds_differ"].fix


def test_unpicklable_env_config_names_the_key():
    report = check_env("tests.custom_env_example:MyEnv", {"limit": 3, "hook": threading.Lock()}, seeds=2)
    # MyEnv keeps its config dict, so the env itself does not pickle either
    assert {r.name for r in report.failures()} == {"pickle_config", "pickle_env"}
    assert "env_config.hook" in report["pickle_config"].message
    assert "plain data" in report["pickle_config"].fix


def test_build_failure_stops_early_with_the_config_key():
    report = check_env("sokoban", {"dim_x": 6, "dim_y": 6, "no_such_key": 1})
    assert [r.name for r in report.results] == ["build", "timing"]
    assert not report.ok and "no_such_key" in report["build"].message


def test_parse_config_values_as_yaml():
    assert parse_config_args(["size=6", "p=0.8", "is_slippery=false", "names=[a, b]", "room.dim=4", "s=hello"]) == {
        "size": 6, "p": 0.8, "is_slippery": False, "names": ["a", "b"], "room": {"dim": 4}, "s": "hello"}
    with pytest.raises(ValueError, match="key=value"):
        parse_config_args(["oops"])


def test_cli_exit_status_and_report(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["frozen_lake", "--config", "size=5", "--config", "is_slippery=false", "--seeds", "3",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "PASS  determinism" in text and "OK: 0 failed" in text
    data = json.loads(out.read_text())
    assert data["ok"] and data["env_config"] == {"size": 5, "is_slippery": False}
    assert main(["tests.fault_envs:MissingInfoEnv", "--seeds", "2"]) == 1
    text = capsys.readouterr().out
    assert "FAIL  info_keys" in text and "fix:" in text and "FAILED: 1 failed" in text
    # a tag of config/envs.yaml, with an override
    assert main(["SimpleSokoban", "--config", "max_steps=30", "--seeds", "2"]) == 0


def test_cli_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "ragen.tools.check", "sokoban", "--config", "dim_x=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "FAIL  build" in proc.stdout and "dim_x" in proc.stdout



def test_a_nan_reward_fails_the_step_check():
    """The rollout ends an env with a NaN reward in error; the checker tells its author first."""
    report = check_env("tests.bad_output_envs:NanRewardEnv", seeds=2)
    assert not report.ok
    assert {r.name for r in report.failures()} == {"step"}, report.format()
    assert "reward is nan, not a finite number" in report["step"].message and "finite" in report["step"].fix


# ----- issue 59: failures the checker missed, and a false alarm --------------------------------------------

@dataclass
class HiddenCodeConfig(BaseEnvConfig):
    ignore_seed: bool = False


class HiddenCodeEnv(BaseLanguageBasedEnv):
    """A guessing game whose code comes from the seed and is never shown: every seed's first
    observation is the same, and a guess ("[50]") is told higher or lower. With ``ignore_seed``,
    the code is always 42: every env group would play the same game."""

    config_cls = HiddenCodeConfig

    def __init__(self, config: HiddenCodeConfig | None = None) -> None:
        super().__init__(config or HiddenCodeConfig())
        self.code, self.done = 0, False

    def reset(self, seed=None, **kwargs):
        _, rng = make_rng(seed)
        self.code, self.done = (42 if self.config.ignore_seed else int(rng.integers(1, 100))), False
        return "Guess the code, a number from 1 to 99. Answer in the form '[50]'."

    def step(self, action):
        match = re.fullmatch(r"\[(\d+)\]", action.strip()) if isinstance(action, str) else None
        if match is None or self.done:
            return unchanged_step("Answer in the form '[50]'.", match is not None, self.done, False, -0.1)
        guess = int(match.group(1))
        self.done = guess == self.code
        said = "right" if self.done else ("higher" if self.code > guess else "lower")
        return said, float(self.done), self.done, {"action_is_valid": True, "action_is_effective": True,
                                                   "success": self.done}


def test_a_hidden_state_from_the_seed_is_no_false_alarm_and_an_ignored_seed_still_is():
    """Issue 59: "all 5 seeds give the same episode" for TAMastermind, whose code differs by seed.
    The checker steps the examples the first observation shows, and compares what comes back."""
    hidden = check_env("tests.test_env_check:HiddenCodeEnv", seeds=5)
    assert hidden.ok and not hidden.warnings(), hidden.format()
    assert "differ after a step" in hidden["seeds_differ"].message
    ignored = check_env("tests.test_env_check:HiddenCodeEnv", {"ignore_seed": True}, seeds=5)
    assert ignored["seeds_differ"].status == "warn", ignored.format()
    assert "also after each of the examples the first observation shows ([50])" in ignored["seeds_differ"].message


def test_the_shipped_mastermind_passes_the_seed_check():
    pytest.importorskip("textarena", reason="textarena (the envs extra) plays TextArena's games")
    report = check_env("textarena", {"env_id": "Mastermind-v0"}, seeds=4)
    assert report.ok and report["seeds_differ"].status == "pass", report.format()


def test_search_without_its_retrieval_server_fails_naming_it(capsys):
    """Issue 59: `check SearchQA` with no retrieval server said "OK, 14 passed"."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["SearchQA", "--config", f"server_url={url}", "--seeds", "2"]) == 1
    text = capsys.readouterr().out
    assert f"FAIL  preflight        the retrieval server {url} is unreachable" in text, text
    assert "ragen.tools.retrieval_server" in text and "FAILED" in text


BAD_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"amount": {"type": "strng"}}}}}]


def test_a_tool_schema_train_refuses_fails_the_build(tmp_path, capsys):
    """Issue 59: a tool schema train.py refuses passed the checker: it reads the config as train.py does."""
    report = check_env("tests.test_tool_calls:CounterEnv", {"tools": BAD_TOOLS}, "tests.test_tool_calls:CounterConfig",
                       seeds=2)
    assert [r.name for r in report.failures()] == ["build"], report.format()
    assert "env_config: tools[0] (add).function.parameters is not valid JSON Schema at properties/amount/type" \
        in report["build"].message
    # a tag: train.py's whole read of it (here a format_example it refuses)
    envs_yaml = tmp_path / "envs.yaml"
    envs_yaml.write_text(yaml.safe_dump({"custom_envs": {"Counter": {
        "env_type": "tests.test_tool_calls:CounterEnv", "config_type": "tests.test_tool_calls:CounterConfig",
        "format_example": {"observation": "The counter is 1."}, "env_config": {}}}}))
    assert main(["Counter", "--envs-yaml", str(envs_yaml), "--seeds", "2"]) == 1
    text = capsys.readouterr().out
    assert "FAIL  build            train.py's config read refuses the tag: custom_envs.Counter.format_example" in text
    assert main(["Counter", "--envs-yaml", str(envs_yaml), "--seeds", "2",
                 "--config", "tools=" + json.dumps(BAD_TOOLS)]) == 1
    assert "custom_envs.Counter: tools[0] (add).function.parameters" in capsys.readouterr().out


def test_env_config_as_json_with_config_items_over_it(tmp_path):
    out = tmp_path / "report.json"
    assert main(["frozen_lake", "--env-config", '{"size": 5, "is_slippery": true}', "--config", "is_slippery=false",
                 "--seeds", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["env_config"] == {"size": 5, "is_slippery": False}
    with pytest.raises(SystemExit):
        main(["frozen_lake", "--env-config", "[5]"])

"""Our rollout shows the model RAGEN's prompts: every case of tests/fixtures/ragen/prompts.json.gz, turn by turn.

The fixture comes from RAGEN's own ``EnvStateManager`` and ``ContextManager``
playing scripted answers (``make_prompt_fixtures.py`` beside it says how).
Here our sequential rollout plays the same config (RAGEN's ``custom_envs``
entries and ``agent_proxy`` keys) and seed with an engine that gives each
request the fixture's answer for its env and turn, and per turn these must be
RAGEN's: the request's messages, its answer prefix, the prompt text (the
tokenizer's chat template plus the prefix; skipped, with the reason, where
transformers or the default model's tokenizer is missing), the parsed actions,
the reward and the format penalty; and the number of turns of each env.

RAGEN's Countdown reads a data set that is not in its repository; the
fixture's puzzles stand in for it (``countdown_puzzle`` of each env), and here
``ParityCountdownEnv`` gives our Countdown the same puzzle for the seed.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Sequence

import pytest

from ragen.env.countdown import CountdownEnv, CountdownPuzzle
from ragen.llm.types import Completion, Engine, GenerationRequest, SamplingParams
from ragen.rollout.scheduler import KeptEnvs, run_envs
from ragen.rollout.proxy import AgentSetup
from ragen.serving import DirectClient

FIXTURE = Path(__file__).parent / "fixtures" / "ragen" / "prompts.json.gz"
# agent_proxy keys that shape RAGEN's prompts and loop (its others are trainer keys)
PROMPT_KEYS = ("action_sep", "max_actions_per_turn", "enable_think", "context_window_mode", "max_context_window",
               "max_turn", "use_turn_scores")
# Countdown puzzles by seed, from the fixture: RAGEN's data set stand-in
PUZZLES: dict[int, CountdownPuzzle] = {}


def load() -> dict:
    with gzip.open(FIXTURE, "rt", encoding="utf-8") as f:
        return json.load(f)


DATA = load()


class ParityCountdownEnv(CountdownEnv):
    """Our Countdown, given for each seed the fixture's puzzle (RAGEN's data set stand-in)."""

    def reset(self, seed=None, **kwargs):
        return self.load_puzzle(PUZZLES[seed])


class FixtureEngine(Engine):
    """Answers each request with the fixture's answer for its env and turn, and keeps the requests."""

    name = "fixture"

    def __init__(self, answers: dict[tuple[int, int], str]) -> None:
        super().__init__()
        self.answers = answers
        self.requests: dict[tuple[int, int], GenerationRequest] = {}

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        out = []
        for r in requests:
            self.requests[(r.env_id, r.turn)] = r
            out.append(Completion.answering(r, self.answers.get((r.env_id, r.turn), ""), [], [], "stop",
                                            self.policy_version))
        return out


def first_difference(ours: str, ragen: str) -> str:
    """Where two texts first differ, with some context of each."""
    i = next((k for k, (a, b) in enumerate(zip(ours, ragen)) if a != b), min(len(ours), len(ragen)))
    lo = max(0, i - 60)
    return (f"first difference at char {i} (ours {len(ours)} chars, RAGEN's {len(ragen)}):\n"
            f"  ours:   {ours[lo:i + 60]!r}\n  RAGEN's: {ragen[lo:i + 60]!r}")


def messages_difference(ours: list[dict], ragen: list[dict]) -> str | None:
    """None if equal, else the first message that differs and where."""
    for k, (a, b) in enumerate(zip(ours, ragen)):
        if a.get("role") != b.get("role"):
            return f"message {k}: role {a.get('role')!r}, RAGEN's {b.get('role')!r}"
        if a.get("content") != b.get("content"):
            return f"message {k} ({b['role']}): " + first_difference(a.get("content", ""), b["content"])
    if len(ours) != len(ragen):
        n = min(len(ours), len(ragen))
        extra = ours[n] if len(ours) > n else ragen[n]
        whose = "ours" if len(ours) > n else "RAGEN's"
        return f"{len(ours)} messages, RAGEN's {len(ragen)}; the first one only {whose} has: {extra!r}"
    return None


def load_tokenizer():
    """The default model's tokenizer (the one the fixture's texts were made with), or None and
    why it is not here."""
    try:
        from transformers import AutoTokenizer

        from ragen.llm.default_model import resolve_model_path

        path = Path(resolve_model_path("default"))
        if path.name != DATA["tokenizer"]:
            return None, f"the default model is {path.name}, the fixture's texts are {DATA['tokenizer']}'s"
        return AutoTokenizer.from_pretrained(str(path)), ""
    except Exception as exc:  # noqa: BLE001 - no transformers, or no model folder: the text check is skipped
        return None, f"the default model's tokenizer could not load: {type(exc).__name__}: {exc}"


@pytest.fixture(scope="module")
def tokenizer():
    found, reason = load_tokenizer()
    if found is None:
        pytest.skip(f"prompt texts not checked: {reason}")
    return found


def setup_for(case: dict) -> AgentSetup:
    custom_envs = json.loads(json.dumps(case["custom_envs"]))
    for env in case["envs"]:
        if "countdown_puzzle" in env:
            p = env["countdown_puzzle"]
            PUZZLES[env["seed"]] = CountdownPuzzle(tuple(p["nums"]), p["target"], "")
    for spec in custom_envs.values():
        if spec["env_type"] == "countdown":
            spec["env_type"] = f"{__name__}:ParityCountdownEnv"
            spec["config_type"] = "ragen.env.countdown:CountdownEnvConfig"
    agent_proxy = {k: v for k, v in DATA["agent_proxy_defaults"].items() if k in PROMPT_KEYS}
    agent_proxy.update(case["agent_proxy"])
    agent_proxy.update(use_parallel_rollout=False)
    split = {"env_groups": len(case["tags"]), "group_size": 1,
             "env_configs": {"tags": case["tags"], "n_groups": [1] * len(case["tags"])}}
    return AgentSetup.from_config({
        "custom_envs": custom_envs,
        "seed": {"train": case["seed"], "val": case["seed"]},
        "agent_proxy": agent_proxy,
        "es_manager": {"format_penalty": DATA["format_penalty"], "train": split, "val": split},
        # RAGEN renders every prompt whole, earlier answers tidied
        "ctx_manager": {"token_history": "rerender"},
    })


def test_fixture_records_its_command_and_ragen_commit():
    assert DATA["command"].startswith("python tests/fixtures/ragen/make_prompt_fixtures.py --ragen-src ")
    assert "RAGEN" in DATA["ragen_commit"] and len(DATA["ragen_commit"].split()[-1]) == 40
    kinds = {t["answer_kind"] for c in DATA["cases"].values() for e in c["envs"] for t in e["turns"]}
    assert kinds == {"one", "several", "too_many", "unknown", "lower", "no_tags", "empty", "spaces", "special",
                     "nested", "mixed"}


def play(name: str) -> tuple[dict, AgentSetup, FixtureEngine, list]:
    """The case played by our sequential rollout on the fixture's answers."""
    case = DATA["cases"][name]
    setup = setup_for(case)
    answers = {(e["env_id"], t["turn"]): t["answer"] for e in case["envs"] for t in e["turns"]}
    engine = FixtureEngine(answers)
    specs = setup.es["train"].make_specs()
    assert [(s.env_id, s.tag, s.seed) for s in specs] == [(e["env_id"], e["tag"], e["seed"]) for e in case["envs"]]
    trajectories, _ = run_envs(specs, DirectClient(engine), setup.loop, kept_envs=KeptEnvs(), isolate_errors=False)
    return case, setup, engine, trajectories


def where(name: str, env: dict, t: dict) -> str:
    return f"case {name}, env {env['env_id']} ({env['tag']}), turn {t['turn']} (answer kind {t['answer_kind']})"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(DATA["cases"]))
def test_prompts_match_ragen(name):
    case, setup, engine, trajectories = play(name)
    prefix = "<think>" if setup.loop.context.enable_think else "<answer>"
    for env, traj in zip(case["envs"], trajectories):
        for t in env["turns"]:
            at = where(name, env, t)
            request = engine.requests.get((env["env_id"], t["turn"]))
            assert request is not None, f"{at}: our rollout asked for no answer"
            diff = messages_difference(request.messages, t["messages"])
            assert diff is None, f"{at}: prompt messages differ: {diff}"
            assert request.answer_prefix == prefix, at
            ours = traj.turns[t["turn"]]
            assert ours.actions == t["actions"], f"{at}: parsed actions"
            assert ours.reward == pytest.approx(t["reward"]), f"{at}: reward"
            assert ours.penalty == pytest.approx(t["penalty"]), f"{at}: format penalty"
        assert len(traj.turns) == len(env["turns"]), f"case {name}, env {env['env_id']}: number of turns"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(DATA["cases"]))
def test_prompt_texts_match_ragen(name, tokenizer):
    """The prompt text: the tokenizer's chat template of the request's messages, plus its answer prefix."""
    case, _, engine, _ = play(name)
    for env in case["envs"]:
        for t in env["turns"]:
            request = engine.requests[(env["env_id"], t["turn"])]
            text = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True,
                                                 tokenize=False) + request.answer_prefix
            assert text == t["text"], f"{where(name, env, t)}: prompt text differs: {first_difference(text, t['text'])}"

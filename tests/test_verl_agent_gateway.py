"""Agent episodes for verl's samples (``ragen.verl.agent_gateway``, ``ragen.verl.server_link``) without
verl: a server manager that answers token ids from an engine keyed by the prompt alone, as a
deterministic verl server does. The same episodes give the same tokens as our own rollout
(``play_agents``); the sample (``agent_record``) is the first segment, bounded by verl's lengths.
verl's own ``AgentLoopWorker`` plays them in tests/test_verl_agent_loop.py (verl's venv)."""

from __future__ import annotations

import asyncio
import math
import threading
import zlib
from types import SimpleNamespace

import pytest

from ragen.llm.scripted import byte_chat
from ragen.llm.types import Completion, Engine, SamplingParams
from ragen.rollout.agent_play import AgentModel, EngineLinkClient, play_agents
from ragen.rollout.agent_samples import agent_rows
from ragen.rollout.types import EnvSpec, StopReason
from ragen.verl.agent_gateway import AgentGateway
from ragen.verl.episode_tokens import METRIC_KEYS, agent_record
from ragen.verl.server_link import VerlEpisode

pytest.importorskip("openai", reason="the openai client (pip install openai; the dev extra has it)")
pytestmark = pytest.mark.timeout(120)

SAMPLING = SamplingParams(temperature=0.0, max_tokens=40)
VERL_SAMPLING = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


class PromptEngine(Engine):
    """A deterministic policy of the prompt ids alone (utf-8 bytes): what greedy decoding is."""

    name = "prompt-keyed"
    returns_logprobs = True

    def __init__(self) -> None:
        super().__init__()
        self.chat = byte_chat()

    @staticmethod
    def answer(prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        key = zlib.crc32(bytes(prompt_ids))
        ids = list(f"I count {key % 97}, then {key % 89}.".encode())[:max_tokens]
        return ids, [-(key % 7 + i) / 10 for i in range(len(ids))]

    def generate(self, requests, sampling):
        out = []
        for r in requests:
            ids, logprobs = self.answer(r.prompt_token_ids, r.token_limit(sampling))
            finish = "length" if len(ids) >= r.token_limit(sampling) else "stop"
            out.append(Completion.answering(r, bytes(ids).decode(), list(r.prompt_token_ids), ids, finish, 0, logprobs))
        return out


class ServerManager:
    """verl's server manager interface (``generate(request_id, *, prompt_ids, sampling_params)``) over
    ``PromptEngine.answer``, with a fault where asked."""

    def __init__(self, fault: str | None = None) -> None:
        self.fault = fault
        self.calls: list[tuple[str, list[int], dict]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        await asyncio.sleep(0)
        self.calls.append((request_id, list(prompt_ids), dict(sampling_params)))
        if self.fault == "raises":
            raise RuntimeError("the server is gone")
        ids, logprobs = PromptEngine.answer(list(prompt_ids), sampling_params["max_tokens"])
        if self.fault == "bad_ids":
            ids = [1 << 40]
        return SimpleNamespace(token_ids=ids, log_probs=logprobs if sampling_params.get("logprobs") else None,
                               stop_reason="aborted" if self.fault == "aborted" else "completed",
                               extra_fields={"global_steps": 7})


def agent_spec(entry: str, seed: int, env_id: int = 0) -> EnvSpec:
    return EnvSpec(env_id=env_id, group_id=env_id, tag="Counts", seed=seed, env_type="agent",
                   env_config={"entry": f"tests.agent_programs:{entry}", "tasks": "tests.agent_programs:task_of",
                               "timeout_s": 60})


@pytest.fixture(scope="module")
def gateway():
    gw = AgentGateway(byte_chat(), None, "prompt-keyed", SAMPLING, max_concurrent=4)
    yield gw
    gw.close()


def play_verl(gateway, specs, manager=None, prompt_length=4096, response_length=4096):
    """The specs' episodes played as verl's samples are, at once on one event loop."""
    async def main():
        loop = asyncio.get_running_loop()
        episodes = [VerlEpisode(loop, manager or ServerManager(), dict(VERL_SAMPLING), prompt_length, response_length)
                    for _ in specs]
        trajectories = await asyncio.gather(*(gateway.play(s, 100.0, e) for s, e in zip(specs, episodes)))
        return [agent_record(t, prompt_length, response_length, e.truncated) for t, e in zip(trajectories, episodes)]

    return asyncio.run(main())


def test_agent_episodes_for_verl_are_our_rollouts_token_for_token(gateway):
    specs = [agent_spec("counts", seed, env_id=i) for i, seed in enumerate((3, 3, 4))]
    engine = PromptEngine()
    ours = play_agents(specs, EngineLinkClient(engine, threading.Lock()), AgentModel.of(engine), SAMPLING, 100.0, 2)
    manager = ServerManager()
    records = play_verl(gateway, specs, manager)
    for traj, record in zip(ours, records):
        assert traj.stop_reason == StopReason.DONE and len(traj.turns) == 2, traj.error
        assert record.trajectory.stop_reason == StopReason.DONE, record.trajectory.error
        (row,) = agent_rows(traj.turns, "segment")  # one segment: the second call grows the first
        assert record.prompt_ids + record.response_ids == row["input_ids"]
        assert [0] * len(record.prompt_ids) + record.response_mask == row["loss_mask"]
        want = [0.0 if math.isnan(x) else x for x in row["behaviour_logprobs"][len(record.prompt_ids):]]
        assert record.response_logprobs == pytest.approx(want)
        assert record.reward == traj.reward == record.trajectory.reward
        assert record.trajectory.program["info"] == traj.program["info"]
        assert [t.policy_version for t in record.trajectory.turns] == [7, 7]  # verl's global step
        assert record.metrics()["ragen/untrained_calls"] == 0 and sorted(record.metrics()) == sorted(METRIC_KEYS)
    assert records[0].prompt_ids == records[1].prompt_ids != records[2].prompt_ids  # a group shares its task
    # an episode's calls share one sticky request id; episodes do not
    ids = {}
    for request_id, prompt, params in manager.calls:
        ids.setdefault(request_id, []).append(prompt)
        assert params["max_tokens"] == SAMPLING.max_tokens and params["temperature"] == 0
    assert len(ids) == 3 and all(len(prompts) == 2 for prompts in ids.values())


def test_the_sample_is_the_first_segment_and_later_calls_are_counted(gateway):
    (record,) = play_verl(gateway, [agent_spec("restarts", 5)])
    traj = record.trajectory
    assert traj.stop_reason == StopReason.DONE and [t.info["segment"] for t in traj.turns] == [0, 1, 1]
    first = traj.turns[0]
    assert record.prompt_ids == list(first.prompt_ids) and record.response_ids == list(first.response_ids)
    assert record.response_mask == [1] * len(first.response_ids)
    assert record.metrics()["ragen/untrained_calls"] == 2.0 and record.reward == 1.0


def test_calls_are_bounded_by_verls_lengths(gateway):
    # room for 5 ids of the second answer: it is capped to them
    (whole,) = play_verl(gateway, [agent_spec("counts", 3)])
    first, second = whole.trajectory.turns
    first_answer = len(first.response_ids)
    room = first_answer + len(second.prompt_ids) + 5
    assert len(second.response_ids) > 5
    (capped,) = play_verl(gateway, [agent_spec("counts", 3)], response_length=room)
    assert capped.trajectory.stop_reason == StopReason.DONE
    assert len(capped.response_ids) == room and capped.truncated and capped.metrics()["ragen/truncated"] == 1.0
    assert capped.response_ids == whole.response_ids[:room]
    # no room left for the second call: refused (400), the program fails, its episode is in error
    (refused,) = play_verl(gateway, [agent_spec("counts", 3)], response_length=first_answer + 2)
    assert refused.trajectory.stop_reason == StopReason.ERROR
    assert "Error code: 400 - the prompt has" in refused.trajectory.error and "leaving no room" in refused.trajectory.error
    assert refused.truncated and refused.reward == 0.0
    # a first prompt past data.max_prompt_length: nothing sampled, nothing to train
    (long,) = play_verl(gateway, [agent_spec("counts", 3)], prompt_length=5)
    assert long.trajectory.stop_reason == StopReason.ERROR and "data.max_prompt_length=5" in long.trajectory.error
    assert long.prompt_ids == [] and long.response_ids == [] and long.reward == 0.0


@pytest.mark.parametrize("fault, says", [("raises", "the server is gone"), ("aborted", "aborted"),
                                         ("bad_ids", "not answer ids")])
def test_a_server_failure_ends_that_episode_in_error(gateway, fault, says):
    (bad,) = play_verl(gateway, [agent_spec("counts", 3)], ServerManager(fault))
    assert bad.trajectory.stop_reason == StopReason.ERROR and says in bad.trajectory.error
    assert bad.reward == 0.0 and bad.metrics()["ragen/error"] == 1.0


def test_a_session_outliving_its_sample_is_refused(gateway):
    """A call whose verl sample ended (its coroutine cancelled) is answered 502, not sent."""
    from ragen.gateway.api_error import ApiError
    from ragen.llm.types import GenerationRequest

    with pytest.raises(ApiError, match="episode ended"):
        gateway.client.submit([GenerationRequest(messages=[], env_id=10 ** 6, prompt_token_ids=[1, 2])], SAMPLING)

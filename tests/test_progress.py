"""RolloutProgress: the counts of a sequential and of a parallel rollout end
at every env finished and every request answered; what is shown (a bar on a
terminal, log lines elsewhere, nothing for a short rollout); and progress
never changes a result."""

from __future__ import annotations

import io
import logging
import time
from dataclasses import replace
from functools import partial

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm_agent import AgentSetup, LLMAgentProxy
from ragen.serving import SharedLLMInferenceManager, messages, wire
from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings
from ragen.rollout.progress import RolloutProgress
from ragen.rollout.workers.dispatch import FINISHED, announced, report_finished
from ragen.rollout.batching import Lockstep, stream_count
from ragen.rollout.scheduler import KeptEnvs, run_envs
from ragen.rollout.types import rollout_digest

from tests.fault_envs import exiting_group
from tests.rollout_helpers import custom_envs, loop_config, specs_for
from tests.test_agent_loop import config


class RecordingProgress(RolloutProgress):
    """Counts, shown nowhere, and the envs reported before ``complete()``."""

    def __init__(self, total: int) -> None:
        super().__init__(total, "test", disable=True)
        self.reported = 0

    def envs_finished(self, n: int) -> None:
        self.reported += n
        super().envs_finished(n)


@pytest.fixture(scope="module")
def mixed_specs():
    return specs_for(["SimpleSokoban", "FrozenLake", "Bandit", "Countdown"], [2, 2, 2, 1], 2, custom_envs())


def turns_of(trajectories) -> int:
    return sum(len(t.turns) for t in trajectories)


@pytest.mark.timeout(120)
def test_a_sequential_rollout_ends_with_every_env_and_turn_counted():
    cfg = config("engine=scripted", "es_manager.train.env_groups=4", "es_manager.train.group_size=2",
                 "es_manager.train.env_configs.tags=[SimpleSokoban,Bandit]",
                 "es_manager.train.env_configs.n_groups=[2,2]")
    with LLMAgentProxy(AgentSetup.from_config(cfg), ScriptedEngine(malformed_rate=0.1)) as proxy:
        progress = RecordingProgress(8)
        result = proxy.rollout("train", rollout_index=0, progress=progress)
        plain = proxy.rollout("train", rollout_index=0)  # its own progress: nothing shown in a test
    assert progress.finished == progress.reported == 8  # each env told once, as it ended
    assert progress.turns == result.metrics["engine/requests"] == turns_of(result.trajectories)
    assert 0 < progress.batch_size <= 8
    assert progress._closed
    assert rollout_digest(plain.trajectories) == rollout_digest(result.trajectories)


@pytest.mark.timeout(240)
def test_a_parallel_rollout_ends_with_every_env_and_turn_counted(mixed_specs):
    total = len(mixed_specs)
    with SharedLLMInferenceManager(ScriptedEngine(malformed_rate=0.1), coalesce_wait_s=0.005) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="loky")) as prm:
        plain = prm.rollout(mixed_specs, loop_config())
        progress = RecordingProgress(total)
        result = prm.rollout(mixed_specs, loop_config(), progress=progress)
        assert not shared.hooked  # the rollout's progress is told nothing more
    assert rollout_digest(result.trajectories) == rollout_digest(plain.trajectories)
    assert progress.finished == total
    assert progress.reported > 0  # the workers' counts came through the manager
    assert progress.turns == result.metrics["engine/requests"] == turns_of(result.trajectories)
    assert 0 < progress.batch_size <= total


@pytest.mark.timeout(240)
def test_a_shard_rerun_after_a_dead_worker_still_ends_at_the_total(mixed_specs, tmp_path):
    total = len(mixed_specs)
    exiting = exiting_group(mixed_specs, 0, at_step=2, marker=str(tmp_path / "exited"))
    with SharedLLMInferenceManager(ScriptedEngine(malformed_rate=0.1)) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2)) as prm:
        progress = RecordingProgress(total)
        result = prm.rollout(exiting, loop_config(), progress=progress)
    assert result.metrics["parallel/retried_tasks"] >= 1
    assert progress.finished == total
    assert progress.turns >= turns_of(result.trajectories)  # the dead worker's answered turns count too


@pytest.mark.timeout(60)
def test_the_workers_finished_counts_ride_on_their_messages(mixed_specs):
    """Without ``complete()``: every env's end reaches the watched rollout
    through the requests and stream closes the worker sends anyway."""
    total = len(mixed_specs)
    config = loop_config()
    with SharedLLMInferenceManager(ScriptedEngine(), coalesce_wait_s=0.005) as shared:
        progress = RecordingProgress(total)
        with announced(shared, stream_count(mixed_specs, 2), progress=progress) as tag:
            client = replace(shared.client(timeout_s=30), tag=tag)
            try:
                trajectories, stats = run_envs(mixed_specs, client, config, kept_envs=KeptEnvs(),
                                               on_finished=partial(report_finished, client), batching=Lockstep(depth=2))
                deadline = time.monotonic() + 5  # the last close is read by the manager's connection thread
                while progress.finished < total and time.monotonic() < deadline:
                    time.sleep(0.01)
            finally:
                client.reset()
    assert progress.finished == progress.reported == total
    assert progress.turns == stats.requests == turns_of(trajectories)


def test_finished_on_the_wire_is_optional_and_checked():
    gen = {"op": "gen", "ticket": 1, "requests": [], "sampling": {}}
    assert messages.parse_message(wire.frame(gen)[4:]).notes == {}
    assert messages.parse_message(wire.frame({**gen, "notes": {FINISHED: 3}})[4:]).notes == {FINISHED: 3}
    assert messages.parse_message(wire.frame({"op": "close", "n": 1, "notes": {FINISHED: 2}})[4:]).notes == {FINISHED: 2}
    for bad in (-1, "2", True, 1.5):
        with pytest.raises(messages.BadMessage, match="notes"):
            messages.parse_message(wire.frame({**gen, "notes": {FINISHED: bad}})[4:])


def test_not_on_a_terminal_it_logs_after_the_delay_and_then_at_most_every_interval(caplog):
    now = [100.0]
    progress = RolloutProgress(4, "train", delay_s=2, log_every_s=10, file=io.StringIO(), clock=lambda: now[0],
                               tick_s=None)
    caplog.set_level(logging.INFO, logger="ragen.rollout.progress")
    for t, event in [(100.5, "batch"), (101.5, "env"), (102.5, "turns"), (105, "turns"), (112, "env"),
                     (113, "turns")]:
        now[0] = t
        {"batch": lambda: progress.engine_batch(4), "env": lambda: progress.envs_finished(1),
         "turns": lambda: progress.answered(4)}[event]()
    progress.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "ragen.rollout.progress"]
    assert lines == ["[Progress] train: 1/4 envs finished | 4 turns | engine batch 4 | 2 s",
                     # 112: 9.5 s after the last line, so not yet
                     "[Progress] train: 2/4 envs finished | 12 turns | engine batch 4 | 13 s"]
    assert progress.lines_logged == 2


def test_one_long_engine_call_still_shows_its_batch_and_time(caplog):
    """No event comes while the engine runs one long call (a whole Bandit
    rollout is one): the ticker shows the batch running, as lines or a bar."""
    caplog.set_level(logging.INFO, logger="ragen.rollout.progress")
    out = io.StringIO()
    with RolloutProgress(8, "train", delay_s=0.05, log_every_s=0.1, tick_s=0.02, file=io.StringIO(),
                         terminal=False) as lines, \
            RolloutProgress(8, "train", delay_s=0.05, tick_s=0.02, file=out, terminal=True) as bar:
        lines.engine_batch(8)
        bar.engine_batch(8)
        time.sleep(0.5)  # the "engine call": no event
        logged = [r.getMessage() for r in caplog.records if r.name == "ragen.rollout.progress"]
        drawn = out.getvalue()
    assert len(logged) >= 2 and all("0/8 envs finished | 0 turns | engine batch 8" in m for m in logged)
    assert "rollout train" in drawn and "0/8" in drawn and "batch=8" in drawn


def test_a_rollout_shorter_than_the_delay_shows_nothing(caplog):
    caplog.set_level(logging.INFO, logger="ragen.rollout.progress")
    out = io.StringIO()
    with RolloutProgress(3, "train", file=out, terminal=True) as bar, \
            RolloutProgress(3, "train", file=io.StringIO(), terminal=False) as lines:
        for p in (bar, lines):
            p.engine_batch(3)
            p.answered(3)
            p.envs_finished(3)
    assert out.getvalue() == ""
    assert not [r for r in caplog.records if r.name == "ragen.rollout.progress"]
    assert (bar.finished, bar.turns, lines.finished, lines.turns) == (3, 3, 3, 3)


def test_on_a_terminal_a_bar_shows_envs_turns_and_batch_and_is_removed_at_the_end():
    out = io.StringIO()
    with RolloutProgress(4, "val", delay_s=0.05, file=out, terminal=True) as progress:
        progress.answered(4)
        progress.envs_finished(2)
        time.sleep(0.6)  # past the delay and tqdm's mininterval (0.5 s) between redraws
        progress.engine_batch(4)  # draws
    text = out.getvalue()
    assert "rollout val" in text and "2/4" in text and "turns=4" in text and "batch=4" in text
    assert text.endswith("\r")  # cleared: the summary line follows on a clean line
    assert progress._bar is None


def test_the_count_never_passes_the_total():
    progress = RolloutProgress(2, disable=True)
    progress.envs_finished(2)
    progress.envs_finished(1)  # a re-run shard reports its envs again
    assert progress.finished == 2
    progress.close()
    progress.close()  # closing twice is harmless


@pytest.mark.timeout(120)
def test_rollouts_at_once_keep_their_counts_apart(mixed_specs):
    """max_concurrent_rollouts: 2 share one manager: each rollout's progress
    counts its own turns (by the rollout its workers' streams were opened under)."""
    import threading

    total = len(mixed_specs)
    progresses = [RecordingProgress(total), RecordingProgress(total)]
    results: list = [None, None]
    with SharedLLMInferenceManager(ScriptedEngine(malformed_rate=0.1), coalesce_wait_s=0.005) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="threading")) as prm:
        start = threading.Barrier(2)

        def run(i: int) -> None:
            start.wait(30)
            results[i] = prm.rollout(mixed_specs, loop_config(), progress=progresses[i])

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    for progress, result in zip(progresses, results):
        assert result is not None
        assert progress.finished == total
        assert progress.turns == turns_of(result.trajectories)


def test_a_long_engine_call_shows_the_tokens_sampled_so_far(caplog):
    """Between events, each line reads the engine's count of tokens sampled (``watch_tokens``), so
    one long call (a whole single-turn rollout) shows its answers growing; 0 is not shown."""
    caplog.set_level(logging.INFO, logger="ragen.rollout.progress")
    now, sampled = [0.0], [0]
    with RolloutProgress(128, "train", delay_s=2, log_every_s=10, file=io.StringIO(), clock=lambda: now[0],
                         tick_s=None) as progress:
        progress.watch_tokens(lambda: sampled[0])
        now[0] = 3
        progress.engine_batch(128)
        sampled[0], now[0] = 640, 14
        progress._show(0)  # what the ticker does between events
    lines = [r.getMessage() for r in caplog.records if r.name == "ragen.rollout.progress"]
    assert lines == ["[Progress] train: 0/128 envs finished | 0 turns | engine batch 128 | 3 s",
                     "[Progress] train: 0/128 envs finished | 0 turns | engine batch 128 | 640 tokens sampled | 14 s"]
    out = io.StringIO()
    with RolloutProgress(8, "train", delay_s=0.05, tick_s=0.02, file=out, terminal=True) as bar:
        bar.watch_tokens(lambda: 77)
        bar.engine_batch(8)
        time.sleep(0.6)  # the ticker redraws the bar with what it reads
    assert "tokens=77" in out.getvalue()


@pytest.mark.timeout(120)
def test_inside_one_engine_call_the_rollout_reads_the_tokens_as_the_hf_engine_samples_them(
        tiny_model_and_tokenizer):
    """A single-turn rollout is one HFEngine call: its progress reads the tokens sampled growing
    at each decoding step of that call, and at its end every answer token of the rollout."""
    from ragen.llm.hf import HFEngine

    model, tokenizer = tiny_model_and_tokenizer
    engine = HFEngine(model=model, tokenizer=tokenizer)
    cfg = config("es_manager.train.env_groups=2", "es_manager.train.group_size=4",
                 "es_manager.train.env_configs.tags=[BanditHinted]", "es_manager.train.env_configs.n_groups=[2]")
    progress = RecordingProgress(8)
    seen: list[int] = []  # what the progress reads at each forward pass of the model
    hook = model.register_forward_hook(lambda *_: seen.append(progress.tokens))
    try:
        with LLMAgentProxy(AgentSetup.from_config(cfg), engine) as proxy:
            result = proxy.rollout("train", rollout_index=0, progress=progress)
    finally:
        hook.remove()
    sampled = sum(len(turn.response_ids) for t in result.trajectories for turn in t.turns)
    assert result.metrics["engine/calls"] == 1 and sampled > 8
    assert seen == sorted(seen) and len(set(seen)) > 2 and seen[-1] < sampled  # grew inside the one call
    assert progress.tokens == sampled

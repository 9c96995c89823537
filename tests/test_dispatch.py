"""The parallel rollout's messages on the shared manager: chunks of a
rollout's groups taken over the connection (one stream each), the finished
envs noted on the workers' messages, and nothing handed out once the rollout
is withdrawn."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.rollout.progress import RolloutProgress
from ragen.rollout.workers.dispatch import TAKE, announced, report_finished, take_chunk
from ragen.rollout.workers.schedule import GroupQueue
from ragen.serving import Hooks, Reply, SharedLLMInferenceManager, wire


@pytest.mark.timeout(60)
def test_each_chunk_taken_opens_one_stream_until_the_queue_is_empty():
    queue = GroupQueue(5, n_workers=1, depth=2)  # chunks of 3, 1 and 1 groups
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        with announced(shared, len(queue), queue) as tag:
            client = replace(shared.client(timeout_s=30), tag=tag)
            assert shared.announced == {tag: 3}
            chunks = [take_chunk(client) for _ in range(4)]
            assert chunks == [[0, 1, 2], [3], [4], []]
            assert shared.open_streams == 3 and shared.announced == {tag: 0}
        assert shared.open_streams == 0 and shared.announced == {} and shared.hooked == ()
        assert take_chunk(client) == []  # withdrawn: nothing more
        client.reset()


@pytest.mark.timeout(60)
def test_a_withdrawn_rollout_hands_out_nothing_more():
    queue = GroupQueue(4, n_workers=2)
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        with announced(shared, len(queue), queue) as tag:
            client = replace(shared.client(timeout_s=30), tag=tag)
            assert take_chunk(client) == [0, 1]
        assert queue.take() == []  # closed with the rollout
        assert take_chunk(client) == []
        client.reset()


@pytest.mark.timeout(60)
def test_finished_envs_reach_the_progress_on_the_next_message():
    progress = RolloutProgress(4, "test", disable=True)
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        with announced(shared, 1, GroupQueue(2, n_workers=1), progress) as tag:
            client = replace(shared.client(timeout_s=30), tag=tag)
            take_chunk(client)  # opens the stream under the tag
            report_finished(client, 3)
            assert progress.finished == 0  # no message of its own
            report_finished(client, 1)
            client.close_stream()
            take_chunk(client)  # read after the close, on the same connection
            assert progress.finished == 4
        client.reset()


@pytest.mark.timeout(60)
def test_a_chunk_that_is_not_a_list_of_indices_is_refused():
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        tag = shared.announce(0, Hooks(calls={TAKE: lambda payload: Reply(["a"])}))
        client = replace(shared.client(timeout_s=30), tag=tag)
        with pytest.raises(wire.ProtocolError, match="list of integers"):
            take_chunk(client)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("streams", [True, False], ids=["continuous-batching", "batch-engine"])
def test_at_enough_groups_the_rollouts_requests_are_answered_aborted(streams):
    """Workers note the groups they ended whole; at ``enough`` the queue closes and the manager
    answers the rollout's requests in flight (an engine that batches continuously: still decoding;
    a batch engine: still queued) and those it sends later ``aborted``."""
    from ragen.llm import make_engine
    from ragen.llm.types import ABORTED, GenerationRequest, SamplingParams
    from ragen.rollout.workers.dispatch import report_groups_done

    # answers that take minutes: only the abort answers them within the test's time
    engine = make_engine({"name": "scripted", "continuous_batching": {"step_s": 1.0, "tokens_median": 1000}}) \
        if streams else ScriptedEngine(base_s=120.0)
    request = GenerationRequest(messages=[{"role": "user", "content": "go"}], env_id=0, turn=0, seed=0)
    queue = GroupQueue(4, n_workers=1)
    with SharedLLMInferenceManager(engine, max_coalesce_wait_s=30.0) as shared:
        with announced(shared, len(queue), queue, enough=2) as tag:
            client = replace(shared.client(timeout_s=30), tag=tag)
            take_chunk(client)
            if not streams:
                client.open_streams(2)  # streams that send nothing: the coalescer waits for them
            ticket = client.submit([request], SamplingParams())
            report_groups_done(client, 1)
            client.submit([request], SamplingParams())  # carries the note: one group, not enough
            report_groups_done(client, 1)
            later = client.submit([request], SamplingParams())  # carries the second: enough
            answers = dict(client.wait_any(timeout=20) for _ in range(3))
            assert sorted(answers) == sorted([ticket, ticket + 1, later])
            assert all(c.finish_reason == ABORTED and c.text == "" for cs in answers.values() for c in cs)
            assert queue.take() == []  # closed at enough
            assert client.wait_any(timeout=0) is None
        client.reset()
    engine.close()

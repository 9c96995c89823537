"""The coalescer with a real transformers engine: a CPU engine's call time is
far from one line over every batch size, and the training rollouts that follow
a larger validation rollout are still one engine call per turn."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ragen.serving import SharedLLMInferenceManager
from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings

from tests.rollout_helpers import custom_envs, loop_config, specs_for


@pytest.mark.timeout(300)
def test_hf_rollouts_after_a_validation_are_one_engine_call_per_turn(tiny_model_path):
    """The default job's shape: single-turn BanditHinted, a validation of 128 envs,
    training rollouts of 4 groups x 8 on 2 workers of 2 micro-batches each.
    Every rollout is one engine call (a cost model fitted through the calls of
    128 and 32 said a call costs nothing fixed, and split the training rollouts
    after the first in two)."""
    from ragen.llm.hf import HFEngine

    engine = HFEngine(tiny_model_path, device="cpu")
    envs = custom_envs()
    val = specs_for(["BanditHinted"], [128], 1, envs, seed=123)
    train = specs_for(["BanditHinted"], [4], 8, envs, seed=10000)
    config = loop_config(max_turn=1)
    config = replace(config, sampling=replace(config.sampling, max_tokens=10))
    calls = []
    with SharedLLMInferenceManager(engine) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="loky")) as prm:
        for name, specs in (("val", val), ("train", train), ("train", train), ("val", val), ("train", train)):
            result = prm.rollout(specs, config)
            assert len(result.trajectories) == len(specs)
            calls.append((name, result.metrics["engine/calls"], result.metrics["engine/mean_batch_size"]))
    assert calls == [(name, 1, len(val) if name == "val" else len(train)) for name, _, _ in calls]

"""``EngineStats`` (``ragen.llm.stats``): an engine's counts, one record, summed over replicas."""

from __future__ import annotations

from ragen.llm import make_engine
from ragen.llm.scripted import ScriptedEngine
from ragen.llm.stats import EngineStats
from ragen.llm.types import GenerationRequest, SamplingParams


def test_the_counts_go_under_the_rollout_metric_names():
    stats = EngineStats(tokens_prefilled=5, tokens_reused=3, turn_cache_evicted=1, history_divergences=2,
                        token_prompt_fallbacks=4, replicas={"engine/replica_failovers": 1.0})
    assert stats.counts() == {"engine/prefill_tokens": 5.0, "engine/reused_tokens": 3.0,
                              "engine/turn_cache_evicted": 1.0, "engine/history_divergences": 2.0,
                              "engine/token_prompt_fallbacks": 4.0, "engine/replica_failovers": 1.0}


def test_summed_adds_each_count_and_a_turn_cache_only_where_one_is_kept():
    parts = [EngineStats(tokens_prefilled=1, turn_cache_bytes=10, turn_cache_evicted=2),
             EngineStats(tokens_prefilled=2, token_prompt_fallbacks=1)]
    total = EngineStats.summed(parts, {"engine/replica_failovers": 0.0})
    assert (total.tokens_prefilled, total.turn_cache_bytes, total.turn_cache_evicted) == (3, 10, 2)
    assert total.token_prompt_fallbacks == 1 and total.replicas == {"engine/replica_failovers": 0.0}
    assert EngineStats.summed([EngineStats()], {}).turn_cache_bytes is None


def test_stats_is_a_copy_and_replicas_sum_their_members():
    engine = make_engine({"name": "scripted", "replicas": 2})
    try:
        before = engine.stats()
        request = GenerationRequest([{"role": "user", "content": "hi"}], history_token_ids=[104, 105],
                                    history_messages=1)
        engine.generate([request], SamplingParams())
        after = engine.stats()
        assert before.history_divergences == 0 and before.replicas["engine/replica0_requests"] == 0.0
        assert after.replicas["engine/replica0_requests"] + after.replicas["engine/replica1_requests"] == 1.0
        assert after.history_divergences == sum(r.stats().history_divergences for r in engine.replicas)
    finally:
        engine.close()
    assert ScriptedEngine().stats() == EngineStats()

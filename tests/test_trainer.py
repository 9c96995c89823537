"""The trainer (ragen.trainer): losses, advantages, the update, weight sync, checkpoints, config checks.

Every test runs on CPU with the tiny random model from ``build_tiny_model``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from ragen.llm.types import GenerationRequest, SamplingParams
from ragen.llm.chat_tokens import ChatTokens
from ragen.rollout.context import ContextConfig
from ragen.trainer import AgentTrainer, PPOActor, Sample, TrainerConfig, compute_advantages, filter_groups
from ragen.trainer import checkpoint as ckpt
from ragen.trainer.config import ActorSection, OptimSection
from ragen.trainer.core import kl_penalty, normalize_rewards, policy_loss
from ragen.trainer.logprobs import sequence_logprobs
from ragen.trainer.tracking import read_metrics
from tests.rollout_helpers import ROOT

CONFIG_DIR = str(ROOT / "config")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tiny model gains nothing from threads, and on a busy 2-core machine two threads that wait
    for each other make every forward pass ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_overrides(model_path: str, run_dir, *extra: str) -> list[str]:
    """A run on the tiny model with few, short episodes (seconds per step)."""
    out = [
        f"model_path={model_path}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=0",
        "trainer.save_freq=1",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        "es_manager.train.env_groups=2",
        "es_manager.train.group_size=4",
        "es_manager.train.env_configs.n_groups=[2]",
        "es_manager.val.env_groups=2",
        "es_manager.val.env_configs.tags=[BanditHintedTest]",
        "es_manager.val.env_configs.n_groups=[2]",
        "agent_proxy.max_turn=2",
        "agent_proxy.enable_think=false",
        "ctx_manager.generation.response_length=12",
        "custom_envs.BanditHinted.max_tokens=12",
        "custom_envs.BanditHintedTest.max_tokens=12",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        # The tiny model's answers are all malformed (reward -0.1 each): plain REINFORCE still moves
        # the weights, where a group-normalized advantage would be 0.
        "algorithm.adv_estimator=reinforce",
        *extra,
    ]
    # full fine-tuning unless a test asks for LoRA (Hydra refuses a key given twice)
    if not any(e.startswith("actor_rollout_ref.model.lora_rank=") for e in extra):
        out.append("actor_rollout_ref.model.lora_rank=0")
    return out


def compose_cfg(overrides: list[str], name: str = "base"):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(name, overrides=overrides)


# ---------------------------------------------------------------- pieces


def test_filter_groups_keeps_the_most_varied_groups():
    scores = [1, 1, 1, 0, 1, 0, 0, 0]  # group 0: std 0; group 1: 0.5; group 2: 0.5; group 3: 0
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    assert filter_groups(scores, groups, 1.0) == list(range(8))
    assert filter_groups(scores, groups, 0.5) == [2, 3, 4, 5]
    assert filter_groups(scores, groups, 0.25) == [2, 3]  # ties: the earlier group
    assert filter_groups(scores, groups, 0.01) == [2, 3]  # at least one group
    with pytest.raises(ValueError, match="rollout_filter_ratio"):
        filter_groups(scores, groups, 0.0)


def test_reward_normalization():
    scores = [1.0, 3.0, 0.0, 0.0]
    groups = [0, 0, 1, 1]
    tags = ["a", "a", "a", "b"]
    norm = lambda **kw: normalize_rewards(scores, groups, tags, **kw)  # noqa: E731
    assert list(norm(method="identity")) == scores
    assert list(norm(method="mean")) == [-1.0, 1.0, 0.0, 0.0]
    z = norm(method="mean_std")
    assert z[0] == pytest.approx(-1.0, abs=1e-5) and z[2] == 0.0
    assert list(norm(method="mean", grouping="batch")) == [0.0, 2.0, -1.0, -1.0]
    assert norm(method="asym_clip", grouping="inductive").min() >= -1.0


def test_advantage_estimators():
    ctx = ContextConfig()
    scores, groups, tags = [1.0, 0.0, 0.5, 0.5], [0, 0, 1, 1], ["A"] * 4
    grpo = compute_advantages(scores, groups, tags, ctx, "grpo")
    np.testing.assert_allclose(grpo, [1.0, -1.0, 0.0, 0.0], atol=1e-5)
    drgrpo = compute_advantages(scores, groups, tags, ctx, "grpo", norm_adv_by_std=False)
    np.testing.assert_allclose(drgrpo, [0.5, -0.5, 0.0, 0.0])
    np.testing.assert_allclose(compute_advantages(scores, groups, tags, ctx, "reinforce"), scores)  # identity
    mean_ctx = ContextConfig(reward_grouping="batch", reward_method="mean")
    np.testing.assert_allclose(compute_advantages(scores, groups, tags, mean_ctx, "reinforce"),
                               [0.5, -0.5, 0.0, 0.0])
    with pytest.raises(ValueError, match="algorithm.adv_estimator"):
        compute_advantages(scores, groups, tags, ctx, "ppo_gae")


def test_policy_loss_clips_only_where_it_should():
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 1.5]))
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, clipped = policy_loss(logp, old, adv, 0.2, 0.2)
    # ratio 1.5 with A>0: clipped at 1.2; 0.5 with A<0: clipped at 0.8; 1.1: inside; 1.5 with A<0: unclipped
    np.testing.assert_allclose(loss.numpy(), [-1.2, 0.8, -1.1, 1.5], rtol=1e-6)
    assert clipped.tolist() == [1.0, 1.0, 0.0, 0.0]
    for kind in ("low_var_kl", "kl", "mse"):
        assert torch.all(kl_penalty(logp, logp, kind) == 0)
    assert torch.all(kl_penalty(logp, old) >= 0)  # k3 is never negative


def _episode_samples(tokenizer, answers, advantages, prompt="Choose dragon or phoenix.", group=0):
    chat = ChatTokens.of(tokenizer)
    system = {"role": "system", "content": "You're a helpful assistant. Pick one arm."}
    ids = chat.full([system, {"role": "user", "content": prompt}])
    samples = []
    for a, adv in zip(answers, advantages):
        answer = chat.encode(a) + [tokenizer.eos_token_id]
        samples.append(Sample(ids + answer, [0] * len(ids) + [1] * len(answer), float(adv), group_key=group))
    return samples


def test_shared_prefix_log_probs_and_gradients_match_plain_passes(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    samples = _episode_samples(tok, ["<answer> dragon </answer>", "<answer> phoenix </answer>",
                                     "I pick <answer> dragon </answer> now", "no"], [1, -1, 1, -1])
    samples += _episode_samples(tok, ["<answer> Up </answer>"], [1], prompt="Another, longer question here?", group=1)
    shared = sequence_logprobs(model, samples, tok.pad_token_id, share_prefix=True)
    plain = sequence_logprobs(model, samples, tok.pad_token_id, share_prefix=False)
    assert shared.counts == plain.counts == [s.num_loss_tokens for s in samples]
    torch.testing.assert_close(shared.logp, plain.logp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(shared.entropy, plain.entropy, atol=1e-4, rtol=1e-4)
    # a single sequence, scored alone with full logits, agrees too
    ids = torch.tensor([samples[0].input_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    pos = [t for t, m in enumerate(samples[0].loss_mask) if m]
    expected = torch.stack([lp[t - 1, samples[0].input_ids[t]] for t in pos])
    torch.testing.assert_close(shared.logp[: len(pos)], expected, atol=1e-4, rtol=1e-4)

    grads = []
    for share in (True, False):
        model.zero_grad()
        sequence_logprobs(model, samples, tok.pad_token_id, share_prefix=share).logp.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float((grads[0] - grads[1]).norm() / grads[1].norm()) < 1e-4


def _trainer_config(lr: float, weight_decay: float = OptimSection.weight_decay, **actor) -> TrainerConfig:
    """A TrainerConfig whose ``actor_rollout_ref.actor`` keys are ``actor`` (``optim.lr`` / ``weight_decay``
    given apart); every other section at its defaults."""
    return TrainerConfig(actor=ActorSection(**actor, optim=OptimSection(lr=lr, weight_decay=weight_decay)))


def _actor(model, **overrides) -> PPOActor:
    options = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 8, "shuffle": False, **overrides}
    cfg = _trainer_config(lr=3e-3, weight_decay=0.0, **options)
    return PPOActor(model, cfg, pad_token_id=0)


def _answer_logp(model, samples) -> list[float]:
    with torch.no_grad():
        stats = sequence_logprobs(model, samples, 0)
    return [float(x.sum()) for x in torch.split(stats.logp, stats.counts)]


def test_updates_raise_the_rewarded_answer_and_lower_the_other(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    good, bad = "<answer> dragon </answer>", "<answer> phoenix </answer>"
    samples = _episode_samples(tok, [good, bad] * 4, [1.0, -1.0] * 4)
    before = _answer_logp(model, samples[:2])
    actor = _actor(model)
    for step in range(4):
        metrics = actor.update(samples, step)
        assert metrics["actor/n_optimizer_steps"] == 1.0
        assert np.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0
    after = _answer_logp(model, samples[:2])
    assert after[0] > before[0] + 0.5, (before, after)
    assert after[1] < before[1] - 0.5, (before, after)


def test_update_is_deterministic_and_independent_of_the_micro_batch_split(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    weights, losses = [], []
    for micro in (8, 3, 1):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
        samples = _episode_samples(tok, ["<answer> dragon </answer>", "<answer> phoenix </answer>", "x y z",
                                         "<answer> dragon </answer> ok"] * 2, [1.0, -1.0, -0.5, 0.5] * 2)
        actor = _actor(model, ppo_micro_batch_size_per_gpu=micro, entropy_coeff=0.01)
        m = actor.update(samples, 0)
        losses.append(m["actor/pg_loss"])
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    for w in weights[1:]:
        # Adam divides by sqrt(v): near-zero gradients turn float noise into up to ~1% of a step (lr 3e-3)
        torch.testing.assert_close(w, weights[0], atol=5e-5, rtol=1e-4)
    assert max(losses) - min(losses) < 1e-6


def test_update_with_a_prompt_root_equals_the_update_without_prompt_sharing(tiny_model_path):
    """Two groups behind one system prompt, micro-batches that split them: the prompt root (run
    once a mini-batch, its gradient summed over micro-batches) gives the gradient of plain passes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    samples = _episode_samples(tok, ["<answer> dragon </answer>", "no", "<answer> phoenix </answer> ok"],
                               [1.0, -1.0, 0.5])
    samples += _episode_samples(tok, ["<answer> Up </answer>", "<answer> Left </answer>", "x"], [1.0, -0.5, -0.5],
                                prompt="Another, longer question here?", group=1)
    grads, metrics = [], []
    for share in (True, False):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
        cfg = _trainer_config(lr=3e-3, weight_decay=0.0, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2,
                              shuffle=False)
        actor = PPOActor(model, dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, share_prefix=share)))
        seen = []
        step = actor._optimizer_step

        def record(step_no, step=step, seen=seen):
            seen.append(torch.cat([p.grad.flatten() for p in actor.params]))
            return step(step_no)

        actor._optimizer_step = record
        metrics.append(actor.update(samples, 0))
        grads.append(seen[0])
    assert float((grads[0] - grads[1]).norm() / grads[1].norm()) < 1e-4
    assert abs(metrics[0]["actor/pg_loss"] - metrics[1]["actor/pg_loss"]) < 1e-6


@pytest.mark.parametrize("setting, threshold, expected", [
    ("auto", 10**6, False),  # micro-batches shorter than AUTO_CHECKPOINT_TOKENS: plain layers
    ("auto", 1, True),  # longer: checkpointed
    (True, 10**6, True),
    (False, 1, False),
])
def test_layers_are_checkpointed_as_set_and_by_tokens_under_auto(tiny_model_and_tokenizer, monkeypatch, setting,
                                                                  threshold, expected):
    import ragen.trainer.actor as actor_module

    model, tok = tiny_model_and_tokenizer
    monkeypatch.setattr(actor_module, "AUTO_CHECKPOINT_TOKENS", threshold)
    samples = _episode_samples(tok, ["<answer> dragon </answer>", "<answer> phoenix </answer>"] * 2, [1.0, -1.0] * 2)
    cfg = _trainer_config(lr=1e-3, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2)
    actor = PPOActor(model, dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, enable_gradient_checkpointing=setting)))
    layer = model.get_decoder().layers[0]
    seen = set()
    hook = layer.register_forward_pre_hook(
        lambda module, args: seen.add(bool(torch.is_grad_enabled() and module.__dict__.get("gradient_checkpointing"))))
    try:
        metrics = actor.update(samples, 0)
    finally:
        hook.remove()
    assert seen == {expected}
    assert metrics["actor/checkpointed_steps"] == float(expected)


def test_auto_checkpointing_leaves_a_model_without_checkpointable_layers_alone(tiny_model_and_tokenizer, monkeypatch):
    import ragen.trainer.logprobs as logprobs

    def missing():
        raise ValueError("no GradientCheckpointingLayer in this transformers")

    monkeypatch.setattr(logprobs, "checkpointable_layer", missing)
    model, tok = tiny_model_and_tokenizer
    samples = _episode_samples(tok, ["<answer> dragon </answer>", "<answer> phoenix </answer>"], [1.0, -1.0])
    actor = PPOActor(model, _trainer_config(lr=1e-3, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2))
    assert actor.config.model.enable_gradient_checkpointing == "auto"
    long = samples * 1000  # a micro-batch far past AUTO_CHECKPOINT_TOKENS
    assert actor._checkpoint_layers(long, [list(range(len(long)))]) is False
    assert actor.update(samples, 0)["actor/n_optimizer_steps"] == 1.0


def test_checkpointing_needs_a_transformers_that_keeps_the_cache_in_checkpointed_layers(tiny_model_and_tokenizer,
                                                                                       monkeypatch):
    """Older transformers drop past_key_values in a checkpointed layer, which would make the prefix
    passes' log-probs wrong without a word: true is refused naming the key, auto stays off."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from ragen.trainer.config import ModelSection
    from ragen.trainer.logprobs import can_checkpoint_layers

    model, _ = tiny_model_and_tokenizer
    assert can_checkpoint_layers(model.get_decoder())
    monkeypatch.delattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")
    assert not can_checkpoint_layers(model.get_decoder())
    with pytest.raises(ValueError, match="enable_gradient_checkpointing.*keep the key/value cache"):
        ModelSection(enable_gradient_checkpointing=True)
    assert ModelSection().enable_gradient_checkpointing == "auto"


def test_several_minibatches_and_epochs_use_precomputed_old_log_probs(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    samples = _episode_samples(tok, ["<answer> dragon </answer>", "<answer> phoenix </answer>"] * 4, [1.0, -1.0] * 4)
    cfg = _trainer_config(lr=1e-2, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, ppo_epochs=2,
                          clip_ratio_low=0.1, clip_ratio_high=0.1)
    assert cfg.actor.clip_range == (0.1, 0.1)
    actor = PPOActor(model, cfg, pad_token_id=0)
    m = actor.update(samples, 0)
    assert m["actor/n_optimizer_steps"] == 4.0
    # after the first optimizer step the policy moved away from pi_old: the ratio is no longer 1
    assert m["actor/ppo_kl"] != 0.0
    assert m["actor/clip_frac"] > 0.0


# ---------------------------------------------------------------- the trainer


def test_engine_samples_from_the_trained_weights(tiny_model_path, tmp_path):
    cfg = compose_cfg(small_overrides(tiny_model_path, tmp_path / "run", "trainer.total_training_steps=1",
                                      "actor_rollout_ref.actor.optim.lr=5e-2"))
    with AgentTrainer(cfg) as trainer:
        engine = trainer.engine
        assert trainer.policy is engine.model  # one model: the engine's
        request = [GenerationRequest(messages=[{"role": "user", "content": "Choose dragon or phoenix."}])]
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        before = engine.generate(request, greedy)[0]
        first = trainer.proxy.rollout("train")
        assert {t.policy_version for tr in first.trajectories for t in tr.turns} == {0}
        # a group's 4 members share their first prompt (computed once: engine.prefix_cache), and every
        # prompt its start; without sharing the share would be 0
        m = first.metrics
        assert m["engine/prefix_reuse"] > 0.5 and m["engine/reused_tokens"] > m["engine/prefill_tokens"]
        # each episode's cache is kept for a next turn, within the bound, and freed when the
        # rollout (every episode in it) has ended
        assert 0 < m["engine/turn_cache_mb"] <= 2048 and m["engine/turn_cache_evicted"] == 0
        assert len(engine.turn_cache) == 0 and engine.turn_cache.bytes == 0
        samples, _ = trainer.make_samples(first)
        # make sure this step moves the weights whatever the random rewards were
        for i, s in enumerate(samples):
            s.advantage = 1.0 if i % 2 == 0 else -1.0
        w0 = [p.detach().clone() for p in engine.model.parameters()]
        trainer.actor.update(samples, 1)
        assert trainer.sync_weights() == 1
        assert any(not torch.equal(a, b) for a, b in zip(w0, engine.model.parameters()))
        after = engine.generate(request, greedy)[0]
        assert before.policy_version == 0 and after.policy_version == 1
        assert after.response_token_ids != before.response_token_ids  # greedy answers follow the new weights
        second = trainer.proxy.rollout("train")
        assert {t.policy_version for tr in second.trajectories for t in tr.turns} == {1}


def test_lora_trains_the_engine_model_in_place(tiny_model_path, tmp_path):
    cfg = compose_cfg(small_overrides(tiny_model_path, tmp_path / "run", "trainer.total_training_steps=1",
                                      "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                                      "actor_rollout_ref.actor.use_kl_loss=true"))
    with AgentTrainer(cfg) as trainer:
        engine = trainer.engine
        assert trainer.peft_model is not None
        assert trainer.peft_model.get_base_model() is engine.model
        base = {n: p.detach().clone() for n, p in engine.model.named_parameters() if "lora_" not in n}
        metrics = trainer.fit()
        assert metrics["policy_version"] == 1 and engine.policy_version == 1
        assert "actor/kl" in metrics
        for n, p in engine.model.named_parameters():
            if "lora_" not in n:
                assert torch.equal(p, base[n]), n  # the base weights stay frozen
        assert any(n.startswith("base_model.") and "lora_B" in n and p.abs().sum() > 0
                   for n, p in trainer.peft_model.named_parameters())
        assert (trainer.run_dir / "checkpoints" / "global_step_1" / "lora_adapter").is_dir()


@pytest.mark.timeout(600)
def test_a_step_with_two_hf_replicas_leaves_both_with_the_trained_weights(tiny_model_path, tmp_path):
    cfg = compose_cfg(small_overrides(tiny_model_path, tmp_path / "run", "trainer.total_training_steps=1",
                                      "trainer.save_freq=0", "engine.device=cpu", "engine.replicas=2"))
    with AgentTrainer(cfg) as trainer:
        primary, other = trainer.engine.replicas
        assert trainer.policy is primary.model  # the primary is trained in place
        w0 = [p.detach().clone() for p in primary.model.parameters()]
        metrics = trainer.fit()
        assert metrics["policy_version"] == 1
        assert [r.policy_version for r in trainer.engine.replicas] == [1, 1]
        assert any(not torch.equal(a, b) for a, b in zip(w0, primary.model.parameters()))  # the step moved them
        assert all(torch.equal(a, b) for a, b in zip(primary.model.parameters(), other.model.parameters()))
        assert metrics["engine/replica0_requests"] > 0 and metrics["engine/replica1_requests"] > 0


@pytest.mark.timeout(600)
def test_a_lora_step_with_two_hf_replicas_gives_the_other_the_merged_weights(tiny_model_path, tmp_path):
    cfg = compose_cfg(small_overrides(tiny_model_path, tmp_path / "run", "trainer.total_training_steps=1",
                                      "trainer.save_freq=0", "engine.device=cpu", "engine.replicas=2",
                                      "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"))
    with AgentTrainer(cfg) as trainer:
        primary, other = trainer.engine.replicas
        w0 = {n: p.detach().clone() for n, p in other.model.named_parameters()}
        trainer.fit()
        assert [r.policy_version for r in trainer.engine.replicas] == [1, 1]
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        request = [GenerationRequest(messages=[{"role": "user", "content": "Choose dragon or phoenix."}])]
        # the primary answers with its adapter, the other with the adapter merged into its weights
        trainer.peft_model.merge_adapter()
        try:
            merged = {n.replace(".base_layer.", "."): p.detach().clone()
                      for n, p in primary.model.named_parameters() if "lora_" not in n}
        finally:
            trainer.peft_model.unmerge_adapter()
        moved = [n for n, p in other.model.named_parameters() if not torch.equal(p, w0[n])]
        assert moved  # the adapter's step reached the other replica
        for n, p in other.model.named_parameters():
            assert torch.allclose(p, merged[n], atol=1e-6), n
        assert primary.generate(request, greedy)[0].text == other.generate(request, greedy)[0].text


def _step_metrics(run_dir, step):
    return next(r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] == step)


COMPARED = ("train/reward", "train/success", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
            "response_length/mean", "policy_version")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_reproduces_the_next_step(tiny_model_path, tmp_path, lora):
    extra = ["trainer.test_freq=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    if lora:
        extra += ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.actor.optim.lr=1e-2"]
    run = tmp_path / "run"
    with AgentTrainer(compose_cfg(small_overrides(tiny_model_path, run, *extra))) as trainer:
        trainer.fit()
        final = trainer.trainable_state()
    uninterrupted = _step_metrics(run, 2)

    # "crash" after step 1: step 2's checkpoint never got written
    shutil.rmtree(run / "checkpoints" / "global_step_2")
    (run / "checkpoints" / ckpt.LATEST_FILE).write_text("1")
    with AgentTrainer(compose_cfg(small_overrides(tiny_model_path, run, "trainer.resume=true", *extra))) as trainer:
        assert trainer.global_step == 1 and trainer.engine.policy_version == 1
        assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]  # step 2's row dropped
        trainer.fit()
        resumed_state = trainer.trainable_state()
    resumed = _step_metrics(run, 2)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    for key in COMPARED:
        assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-5, abs=1e-7), key
    assert resumed["val/reward"] == pytest.approx(uninterrupted["val/reward"])
    assert set(final) == set(resumed_state)
    for name, tensor in final.items():
        torch.testing.assert_close(resumed_state[name], tensor, atol=1e-6, rtol=1e-5)


def test_resume_keeps_the_groups_an_over_sampled_rollout_carried(tiny_model_path, tmp_path):
    """over_sample 1.5 on a batch engine: every group of a turn ends in one call, so the third
    group of a step is held over to the next; a checkpoint keeps it (and the refill seeds'
    place), so a resumed step 2 trains what the uninterrupted one did."""
    extra = ["agent_proxy.over_sample=1.5"]
    run = tmp_path / "run"
    with AgentTrainer(compose_cfg(small_overrides(tiny_model_path, run, *extra))) as trainer:
        trainer.fit()
    uninterrupted = _step_metrics(run, 2)
    assert uninterrupted["oversample/groups_resumed"] == 1  # step 2 played what step 1 held over

    shutil.rmtree(run / "checkpoints" / "global_step_2")
    (run / "checkpoints" / ckpt.LATEST_FILE).write_text("1")
    with AgentTrainer(compose_cfg(small_overrides(tiny_model_path, run, "trainer.resume=true", *extra))) as trainer:
        assert len(trainer.proxy.over_sample.carried) == 1
        trainer.fit()
    resumed = _step_metrics(run, 2)
    for key in (*COMPARED, "oversample/groups_resumed", "oversample/groups_started"):
        assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-5, abs=1e-7), key


@pytest.mark.timeout(600)
def test_resuming_with_two_hf_replicas_gives_both_the_checkpoint_weights(tiny_model_path, tmp_path):
    extra = ("trainer.total_training_steps=1", "engine.device=cpu", "engine.replicas=2")
    run = tmp_path / "run"
    with AgentTrainer(compose_cfg(small_overrides(tiny_model_path, run, *extra))) as trainer:
        trainer.fit()
        trained = trainer.trainable_state()
    with AgentTrainer(compose_cfg(small_overrides(tiny_model_path, run, "trainer.resume=true", *extra))) as trainer:
        primary, other = trainer.engine.replicas
        assert trainer.global_step == 1
        assert [r.policy_version for r in trainer.engine.replicas] == [1, 1]
        for replica in (primary, other):
            state = replica.model.state_dict()
            for name, tensor in trained.items():
                assert torch.equal(state[name], tensor), name


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    for step in (1, 2, 3):
        ckpt.save_checkpoint(run, step, {"step": step}, max_to_keep=2)
    assert ckpt.list_checkpoints(run) == [2, 3]
    assert ckpt.latest_checkpoint(run) == 3
    # a half-written folder (no state.pt) and a stale pointer are never taken for a checkpoint
    (run / "checkpoints" / "global_step_9").mkdir()
    (run / "checkpoints" / ckpt.LATEST_FILE).write_text("9")
    assert ckpt.latest_checkpoint(run) == 3
    assert ckpt.load_checkpoint(run, 3)["step"] == 3

    # A process that dies while writing step 4 (state.pt written, the adapter
    # not yet; no cleanup runs) leaves no global_step_4, and step 3 is the one resumed.
    code = (
        "import os, sys\n"
        "from ragen.trainer import checkpoint as ckpt\n"
        "class DiesWhileSaving:\n"
        "    def save_pretrained(self, path):\n"
        "        os._exit(17)\n"
        "ckpt.save_checkpoint(sys.argv[1], 4, {'step': 4}, peft_model=DiesWhileSaving(), max_to_keep=2)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    died = subprocess.run([sys.executable, "-c", code, str(run)], cwd=ROOT, env=env, timeout=120)
    assert died.returncode == 17
    assert not ckpt.step_dir(run, 4).exists()
    assert ckpt.list_checkpoints(run) == [2, 3]
    assert ckpt.latest_checkpoint(run) == 3
    assert ckpt.load_checkpoint(run, 3)["step"] == 3

    # The same failure as an exception: no folder is left behind for step 4 at all
    class FailsWhileSaving:
        def save_pretrained(self, path):
            raise OSError("disk full")

    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(run, 4, {"step": 4}, peft_model=FailsWhileSaving(), max_to_keep=2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert ckpt.latest_checkpoint(run) == 3
    # and the next save of step 4 completes and is taken
    ckpt.save_checkpoint(run, 4, {"step": 4}, max_to_keep=2)
    assert ckpt.list_checkpoints(run) == [3, 4] and ckpt.latest_checkpoint(run) == 4


def _saved_steps(model_path: str, run, steps, *extra: str) -> None:
    """Checkpoints of ``steps`` of a run that trained nothing: what resume reads, without the training."""
    with AgentTrainer(compose_cfg(small_overrides(model_path, run, *extra))) as trainer:
        for step in steps:
            trainer.global_step = step
            trainer.save()


def test_resume_in_a_fresh_run_folder_continues_the_newest_run(tiny_model_path, tmp_path):
    """trainer.resume=true with the default run folder (a fresh one, not yet made): the run
    ``latest`` links is continued in its own folder, not a new run from step 0."""
    older, newest = tmp_path / "exp" / "2026-01-01_00-00-00", tmp_path / "exp" / "2026-01-01_00-00-09"
    _saved_steps(tiny_model_path, older, [1])
    _saved_steps(tiny_model_path, newest, [1, 2])
    assert (tmp_path / "exp" / ckpt.LATEST_RUN).resolve() == newest
    fresh = tmp_path / "exp" / "2026-01-02_00-00-00"
    with AgentTrainer(compose_cfg(small_overrides(tiny_model_path, fresh, "trainer.resume=true"))) as trainer:
        assert trainer.global_step == 2 and trainer.run_dir == newest
    assert not fresh.exists()
    with AgentTrainer(compose_cfg(small_overrides(tiny_model_path, fresh))) as trainer:  # no resume: a new run
        assert trainer.global_step == 0 and trainer.run_dir == fresh


def test_a_truncated_checkpoint_names_the_file_and_offers_the_previous_one(tiny_model_path, tmp_path):
    run = tmp_path / "run"
    _saved_steps(tiny_model_path, run, [1, 2])
    state = run / "checkpoints" / "global_step_2" / ckpt.STATE_FILE
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a copy or a full disk cut it short
    resume = compose_cfg(small_overrides(tiny_model_path, run, "trainer.resume=true"))
    with pytest.raises(ValueError) as err:
        AgentTrainer(resume)
    message = str(err.value)
    assert f"checkpoint {state} is truncated or corrupt" in message and "\n" not in message
    assert f"resume from the previous checkpoint, {run / 'checkpoints' / 'global_step_1'}" in message
    assert "trainer.resume=true" in message
    shutil.rmtree(state.parent)  # as the message says: the run resumes from step 1
    with AgentTrainer(resume) as trainer:
        assert trainer.global_step == 1
    # with no earlier checkpoint, and for a meta.json that is not JSON, the message says so too
    only = tmp_path / "only"
    ckpt.save_checkpoint(only, 3, {"step": 3, "w": torch.zeros(4096)})
    cut = only / "checkpoints" / "global_step_3" / ckpt.STATE_FILE
    cut.write_bytes(cut.read_bytes()[:100])
    with pytest.raises(ckpt.CheckpointError, match=rf"{re.escape(str(cut))} is truncated or corrupt .*no earlier"):
        ckpt.load_checkpoint(only, 3)
    (only / "checkpoints" / "global_step_3" / "meta.json").write_text('{"step": 3, "lora')
    with pytest.raises(ckpt.CheckpointError, match=r"meta\.json is truncated or corrupt"):
        ckpt.load_meta(only, 3)


class _RunsACommand:
    """What a crafted checkpoint holds: unpickling it would run ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_naming_the_file(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "ran"
    ckpt.save_checkpoint(run, 1, {"step": 1, "model": {"w": torch.zeros(3)}, "x": _RunsACommand(marker)})
    path = run / "checkpoints" / "global_step_1" / ckpt.STATE_FILE
    with pytest.raises(ckpt.CheckpointError, match=rf"^checkpoint {re.escape(str(path))} is refused: it names "
                                                   r"(posix|os)\.system, .* could run code") as err:
        ckpt.load_checkpoint(run, 1)
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_a_checkpoint_in_the_earlier_format_still_loads(tmp_path):
    """Checkpoints written before the numpy RNG state was stored as a list hold it as a numpy
    array; they hold carried trajectories as dataclasses. Both load, and the states set."""
    from ragen.rollout.types import Step, StopReason, Trajectory, Turn

    np.random.seed(3)
    earlier = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": __import__("random").getstate(),
               "cuda": None}
    want = np.random.rand(3)
    turn = Turn(observation="o", actions_left=3, response="r", actions=["Up"], executed_actions=["Up"], reward=1.0,
                penalty=0.0, info={"success": True}, policy_version=1, steps=(Step("Up", "o2", 1.0, True),),
                response_ids=(1, 2), logprobs=(-0.5, -0.25))
    traj = Trajectory(env_id=0, group_id=0, tag="S", seed=7, turns=[turn], stop_reason=StopReason.ABORTED)
    carried = {"carried": [[{"tag": "S", "seed": 7, "env_id": 0, "group_id": 0, "replaces_seed": None,
                             "trajectory": traj}]]}
    ckpt.save_checkpoint(tmp_path, 2, {"step": 2, "rng": earlier, "over_sample": carried,
                                       "optimizer": {"state": {}, "param_groups": [{"betas": (0.9, 0.99)}]}})
    state = ckpt.load_checkpoint(tmp_path, 2)
    got = state["over_sample"]["carried"][0][0]["trajectory"]
    assert got == traj and got.turns[0].logprobs == (-0.5, -0.25) and got.stop_reason is StopReason.ABORTED
    np.random.seed(99)
    ckpt.set_rng_state(state["rng"])
    assert np.array_equal(np.random.rand(3), want)
    # the present format: numpy's state as plain Python
    np.random.seed(3)
    ckpt.save_checkpoint(tmp_path, 3, {"step": 3, "rng": ckpt.rng_state()})
    np.random.seed(99)
    ckpt.set_rng_state(ckpt.load_checkpoint(tmp_path, 3)["rng"])
    assert np.array_equal(np.random.rand(3), want)


def test_resuming_with_another_lora_rank_names_the_key(tiny_model_path, tmp_path):
    run = tmp_path / "run"
    _saved_steps(tiny_model_path, run, [1], "actor_rollout_ref.model.lora_rank=4")
    other = compose_cfg(small_overrides(tiny_model_path, run, "trainer.resume=true",
                                        "actor_rollout_ref.model.lora_rank=8"))
    with pytest.raises(ValueError, match=r"written with actor_rollout_ref\.model\.lora_rank=4, this run has "
                                         r"actor_rollout_ref\.model\.lora_rank=8"):
        AgentTrainer(other)
    # a checkpoint without meta.json: the tensors' shapes tell
    (run / "checkpoints" / "global_step_1" / "meta.json").unlink()
    with pytest.raises(ValueError, match=r"has shape .* actor_rollout_ref\.model\.lora_rank must be the "):
        AgentTrainer(other)



def test_resume_drops_carried_groups_of_another_group_size_and_names_a_damaged_entry(tiny_model_path, tmp_path,
                                                                                    caplog):
    """A checkpoint's carried groups of group_size 4: a run resumed with group_size 2 leaves them out
    with a warning naming the key; a damaged entry is refused naming the checkpoint and the entry."""
    from ragen.rollout.types import Trajectory

    over = ("agent_proxy.over_sample=1.5",)
    run = tmp_path / "run"
    _saved_steps(tiny_model_path, run, [1], *over)
    path = ckpt.step_dir(run, 1) / ckpt.STATE_FILE
    state = ckpt.load_checkpoint(run, 1)
    state["over_sample"] = {"carried": [[{"tag": "BanditHinted", "seed": 50, "env_id": 8 + k, "group_id": 2,
                                          "replaces_seed": None,
                                          "trajectory": Trajectory(env_id=8 + k, group_id=2, tag="BanditHinted",
                                                                   seed=50)} for k in range(4)]]}
    torch.save(state, path)
    resized = small_overrides(tiny_model_path, run, "trainer.resume=true", *over)
    resized[resized.index("es_manager.train.group_size=4")] = "es_manager.train.group_size=2"
    with AgentTrainer(compose_cfg(resized)) as trainer:
        assert trainer.proxy.over_sample.carried == []
    assert "1 carried groups (of 4 envs) are left out: es_manager.train.group_size is 2" in caplog.text

    del state["over_sample"]["carried"][0][3]["env_id"]
    torch.save(state, path)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(f"checkpoint {path} ") + r".*over_sample\.carried"
                                                   r"\[0\]\[3\]: no 'env_id'"):
        AgentTrainer(compose_cfg(small_overrides(tiny_model_path, run, "trainer.resume=true", *over)))


# ---------------------------------------------------------------- bad configs


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fails the test if a model would be loaded."""
    import ragen.llm

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(ragen.llm, "make_engine", refuse)


@pytest.mark.parametrize(
    "override, key",
    [
        ("algorithm.adv_estimator=ppo_gae", "algorithm.adv_estimator"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "ppo_micro_batch_size_per_gpu"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=64", "ppo_mini_batch_size"),
        ("actor_rollout_ref.rollout.rollout_filter_ratio=0", "actor_rollout_ref.rollout.rollout_filter_ratio"),
        ("actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.actor.optim.lr"),
        ("actor_rollout_ref.actor.kl_loss_type=bogus", "actor_rollout_ref.actor.kl_loss_type"),
        ("actor_rollout_ref.actor.logprob_chunk_size=0", "actor_rollout_ref.actor.logprob_chunk_size"),
        ("actor_rollout_ref.actor.logprob_chunk_size=-8", "actor_rollout_ref.actor.logprob_chunk_size"),
        ("actor_rollout_ref.actor.autocast=fp16", "actor_rollout_ref.actor.autocast"),
        ("actor_rollout_ref.model.enable_gradient_checkpointing=sometimes",
         "actor_rollout_ref.model.enable_gradient_checkpointing"),
        ("trainer.logger=[console,mlflow]", "trainer.logger"),
        ("trainer.total_training_steps=0", "trainer.total_training_steps"),
        ("actor_rollout_ref.model.lora_rank=-1", "actor_rollout_ref.model.lora_rank"),
        ("model_path=/nonexistent/model/folder", "model_path"),
        ("engine=scripted", "engine.name"),
        ("es_manager.train.group_size=0", "es_manager.train.group_size"),
        # a misspelt key is refused with the right one suggested, in every section the reader owns
        ("+trainer.total_training_step=3",
         "trainer.total_training_step is not a known key (did you mean 'total_training_steps'?)"),
        ("+actor_rollout_ref.actor.ppo_epoch=2",
         "actor_rollout_ref.actor.ppo_epoch is not a known key (did you mean 'ppo_epochs'?)"),
        ("+algorithm.adv_estimater=grpo", "algorithm.adv_estimater is not a known key (did you mean 'adv_estimator'?)"),
        ("+agent_proxy.parallel_njobs=4", "agent_proxy.parallel_njobs is not a known key (did you mean 'parallel_n_jobs'?)"),
        ("+agent_prox.max_turn=2", "agent_prox is not a known key (did you mean 'agent_proxy'?)"),
        ("+engine.max_batch_sise=8", "engine.max_batch_sise is not a known key (did you mean 'max_batch_size'?)"),
        ("trainer.resume=yes", "trainer.resume must be true or false, got 'yes'"),
    ],
)
def test_bad_config_fails_at_start_up_naming_the_key(tiny_model_path, tmp_path, no_model_loading, override, key):
    cfg = compose_cfg(small_overrides(tiny_model_path, tmp_path / "run", override))
    with pytest.raises(ValueError, match=re.escape(key)):
        AgentTrainer(cfg)


def test_lora_matching_no_module_fails_naming_the_key(tiny_model_path, tmp_path):
    cfg = compose_cfg(small_overrides(tiny_model_path, tmp_path / "run", "actor_rollout_ref.model.lora_rank=4",
                                      "actor_rollout_ref.model.target_modules=[no_such_proj]"))
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.target_modules"):
        AgentTrainer(cfg)


def test_no_trainable_parameters_is_an_error(tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        PPOActor(model, TrainerConfig())


def test_existing_run_needs_resume(tiny_model_path, tmp_path, no_model_loading):
    run = tmp_path / "run"
    ckpt.save_checkpoint(run, 1, {"step": 1})
    with pytest.raises(ValueError, match=r"trainer\.resume"):
        AgentTrainer(compose_cfg(small_overrides(tiny_model_path, run)))


def test_the_default_run_folder_is_a_fresh_one_per_run():
    """Two runs of one command must not meet each other's checkpoints: the default folder is the run's own."""
    folder = TrainerConfig.from_config(compose_cfg([])).run.default_local_dir
    assert re.fullmatch(r"runs/ragen/bandit_grpo/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", folder), folder
    parallel = TrainerConfig.from_config(compose_cfg([], "base-parallel")).run.default_local_dir
    assert re.fullmatch(r"runs/ragen/bandit_grpo/[\d_-]+", parallel), parallel


def test_the_run_folder_is_named_after_what_the_run_trains():
    """Sokoban runs do not land in bandit_grpo: the experiment is named after the train tags' env
    types and the advantage estimator, unless trainer.experiment_name names it."""
    def folder(tags: str, n_groups: str, *extra: str) -> str:
        return TrainerConfig.from_config(compose_cfg([f"es_manager.train.env_configs.tags={tags}",
                                                      f"es_manager.train.env_configs.n_groups={n_groups}",
                                                      *extra])).run.default_local_dir

    assert re.fullmatch(r"runs/ragen/sokoban_grpo/[\d_-]+", folder("[SimpleSokoban]", "[4]"))
    assert re.fullmatch(r"runs/ragen/sokoban-frozen_lake_reinforce/[\d_-]+",
                        folder("[SimpleSokoban,FrozenLake,LargerSokoban]", "[2,1,1]", "algorithm.adv_estimator=reinforce"))
    assert re.fullmatch(r"runs/ragen/mine/[\d_-]+", folder("[SimpleSokoban]", "[4]", "trainer.experiment_name=mine"))


def test_latest_moves_only_to_a_run_that_wrote_a_step(tiny_model_path, tmp_path):
    """A run killed before its first step leaves ``latest`` at the newest run that has one, so the
    docs' ``latest/rollouts/...`` paths hold."""
    trained, killed = tmp_path / "exp" / "2026-01-01_00-00-00", tmp_path / "exp" / "2026-01-01_00-00-09"
    latest = tmp_path / "exp" / ckpt.LATEST_RUN
    with AgentTrainer(compose_cfg(small_overrides(tiny_model_path, trained, "trainer.total_training_steps=1",
                                                  "trainer.save_freq=0"))) as trainer:
        assert not latest.exists()  # started, nothing written yet
        trainer.fit()
    assert latest.resolve() == trained
    with AgentTrainer(compose_cfg(small_overrides(tiny_model_path, killed))):
        pass  # built, then stopped before its first step
    assert killed.is_dir() and latest.resolve() == trained


def test_latest_links_the_newest_run_folder_and_leaves_anything_else_alone(tmp_path):
    first, second = tmp_path / "exp" / "2026-01-01_00-00-00", tmp_path / "exp" / "2026-01-01_00-00-07"
    for run in (first, second):
        run.mkdir(parents=True)
    assert ckpt.mark_latest_run(first) == tmp_path / "exp" / "latest"
    assert (tmp_path / "exp" / "latest").resolve() == first
    ckpt.mark_latest_run(second)
    link = tmp_path / "exp" / "latest"
    assert link.resolve() == second and link.readlink() == Path(second.name)  # relative: the tree can move
    assert sorted(p.name for p in link.parent.iterdir()) == [first.name, second.name, "latest"]  # no temp left
    (tmp_path / "other" / "latest").mkdir(parents=True)  # a folder of the user's, not a link
    (tmp_path / "other" / "run").mkdir()
    assert ckpt.mark_latest_run(tmp_path / "other" / "run") is None
    assert (tmp_path / "other" / "latest").is_dir() and not (tmp_path / "other" / "latest").is_symlink()


def test_metrics_log_has_the_stable_names(tiny_model_path, tmp_path):
    run = tmp_path / "run"
    cfg = compose_cfg(small_overrides(tiny_model_path, run, "trainer.total_training_steps=1",
                                      "trainer.val_before_train=true", "trainer.test_freq=1"))
    with AgentTrainer(cfg) as trainer:
        trainer.fit()
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert {"val/success", "val/reward", "val/BanditHintedTest/success", "policy_version"} <= set(rows[0])
    names = {"step", "policy_version", "train/reward", "train/success", "train/BanditHinted/success", "val/success",
             "val/reward", "val/BanditHintedTest/success", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
             "actor/clip_frac", "timing/rollout_s", "timing/update_s", "timing/step_s", "response_length/mean",
             "timing/samples_s", "timing/actor_s", "timing/sync_weights_s",
             "off_policy/mismatch_kl", "off_policy/is_weight_mean", "off_policy/is_weight_max",
             "off_policy/over_cap_frac", "off_policy/version_lag_mean", "off_policy/version_lag_max",
             "memory/peak_rss_gb", "memory/peak_rss_since_start"}
    assert names <= set(rows[1]), names - set(rows[1])
    parts = rows[1]["timing/samples_s"] + rows[1]["timing/actor_s"] + rows[1]["timing/sync_weights_s"]
    assert parts == pytest.approx(rows[1]["timing/update_s"], abs=1e-6)  # the update's time, in its parts
    # the step's own peak (Linux resets it at the step's start): the model is resident, and far from a GiB
    assert rows[1]["memory/peak_rss_since_start"] == 0.0 and 0.05 < rows[1]["memory/peak_rss_gb"] < 8
    assert (run / "learning_curve.png").stat().st_size > 0
    assert json.loads((run / "checkpoints" / "global_step_1" / "meta.json").read_text())["policy_version"] == 1


def test_the_learning_curve_says_what_reward_and_success_measure(tiny_model_path, tmp_path, monkeypatch):
    """Bandit's training reward and success part ways (one is a random draw, the other the arm's
    choice): learning_curve.png says so under the curves, for the envs the run trains."""
    import matplotlib.pyplot as plt

    from ragen.viewer.curve import REWARD_AND_SUCCESS

    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)  # the figure, as it was saved
    with AgentTrainer(compose_cfg(small_overrides(tiny_model_path, tmp_path / "run"))) as trainer:
        trainer.tracking.log({"train/reward": 0.1, "train/success": 0.5}, step=1)
        assert trainer.plot() == tmp_path / "run" / "learning_curve.png"
    text = " ".join(t.get_text() for t in drawn[0].texts).replace("\n", " ")
    assert REWARD_AND_SUCCESS in text
    assert "Bandit: success is pulling the high-risk arm (worth 0.25 in expectation, the low-risk arm 0.1)" in text


def test_rollout_data_dir_dumps_every_rollout_for_the_viewer_and_replay(tiny_model_path, tmp_path):
    from ragen.rollout.dump import read_dump
    from ragen.tools.replay import replay

    run, dumps = tmp_path / "run", tmp_path / "run" / "rollouts"
    cfg = compose_cfg(small_overrides(tiny_model_path, run, "trainer.total_training_steps=2",
                                      "trainer.val_before_train=true", "trainer.test_freq=2",
                                      f"trainer.rollout_data_dir={dumps}"))
    with AgentTrainer(cfg) as trainer:
        trainer.fit()
    assert sorted(p.name for p in dumps.iterdir()) == [
        "step_000001.jsonl", "step_000002.jsonl", "val_step_000000.jsonl", "val_step_000002.jsonl"]
    train = read_dump(dumps / "step_000002.jsonl")
    assert len(train) == 8 and {r.split for r in train} == {"train"} and {r.step for r in train} == {2}
    # the second step's rollout was answered by the weights after the first update
    assert {t.policy_version for r in train for t in r.trajectory.turns} == {1}
    assert len(read_dump(dumps / "val_step_000000.jsonl")) == 2
    assert all(replay(r).identical for r in train)
    rows = read_metrics(run / "metrics.jsonl")
    assert "timing/dump_train_s" in rows[1] and "timing/dump_val_s" in rows[2]


# ---------------------------------------------------------------- off-policy correction


def _behaviour_and_recomputed(trainer, samples):
    """(engine log-prob, trainer log-prob) of every answer token the engine's log-prob is known for."""
    pairs = []
    for s, recomputed in zip(samples, trainer.actor.compute_log_probs(samples)):
        if s.behaviour_logp is not None:
            pairs += [(b, float(r)) for b, r in zip(s.behaviour_logp, recomputed) if not np.isnan(b)]
    return pairs


@pytest.mark.parametrize("model, temperature", [
    ("default", 0.0), ("default", 1.0), ("default", 0.7), ("tiny", 0.0), ("tiny", 1.3),
])
def test_engine_log_probs_are_the_trainers_recomputed_ones(tiny_model_path, tmp_path, model, temperature):
    """The trainer trains the tokens the engine sampled, in the context it sampled them in: every
    answer token of two-turn episodes carries the log-prob the hf engine (float32) sampled it with,
    equal to the trainer's recomputation within 1e-4, greedy and sampled, for the default model and
    the tiny one (whose random answers hold bytes that are not UTF-8 and would encode back as other
    tokens)."""
    path = tiny_model_path if model == "tiny" else "default"
    cfg = compose_cfg(small_overrides(path, tmp_path / "run", f"ctx_manager.generation.temperature={temperature}"))
    with AgentTrainer(cfg) as trainer:
        assert trainer.correction == "tis"  # the default with an engine that returns log-probs
        assert trainer.actor.temperature == (temperature or 1.0)
        result = trainer.proxy.rollout("train")
        assert all(t.logprobs is not None and len(t.logprobs) == len(t.response_ids)
                   for tr in result.trajectories for t in tr.turns)
        samples, _ = trainer.make_samples(result)
        pairs = _behaviour_and_recomputed(trainer, samples)
        n_answer_tokens = sum(s.num_loss_tokens for s in samples)
        print(f"{model} T={temperature}: {len(pairs)} of {n_answer_tokens} answer tokens have the engine's "
              f"log-prob; largest difference {max(abs(b - r) for b, r in pairs):.2e}")
        assert len(pairs) == n_answer_tokens
        assert max(abs(b - r) for b, r in pairs) < 1e-4


def test_importance_weights_are_one_on_policy_and_not_after_an_update(tiny_model_path, tmp_path):
    cfg = compose_cfg(small_overrides(tiny_model_path, tmp_path / "run", "actor_rollout_ref.actor.optim.lr=5e-2"))
    with AgentTrainer(cfg) as trainer:
        samples, _ = trainer.make_samples(trainer.proxy.rollout("train"))
        for i, s in enumerate(samples):  # move the weights whatever the rewards were
            s.advantage = 1.0 if i % 2 == 0 else -1.0
        on_policy = trainer.actor.update(samples, 1)
        assert on_policy["off_policy/logprob_token_frac"] == 1.0
        assert on_policy["off_policy/mismatch_kl"] < 1e-6
        assert on_policy["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert on_policy["off_policy/over_cap_frac"] == 0.0
        trainer.sync_weights()
        # the same samples, now one version behind the trainer
        stale = trainer.actor.update(samples, 2)
        assert stale["off_policy/mismatch_kl"] > 1e-3
        assert abs(stale["off_policy/is_weight_mean"] - 1.0) > 1e-3
        assert stale["off_policy/is_weight_max"] > 1.0 + 1e-3


def test_the_correction_weights_the_policy_gradient_as_configured():
    from ragen.trainer.core import importance_weights

    proximal = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    behaviour = torch.log(torch.tensor([0.5, 0.1, 0.4, float("nan")]))  # w = 1, 5, 1.25, unknown
    tis, stats = importance_weights(proximal, behaviour, "tis", cap=2.0)
    assert tis.tolist() == pytest.approx([1.0, 2.0, 1.25, 1.0])
    decoupled, _ = importance_weights(proximal, behaviour, "decoupled", cap=2.0)
    assert decoupled.tolist() == pytest.approx([1.0, 0.0, 1.25, 1.0])
    none, none_stats = importance_weights(proximal, behaviour, "none", cap=2.0)
    assert none.tolist() == [1.0] * 4
    assert stats == none_stats  # the statistics do not depend on the mode
    assert (stats.tokens, stats.over_cap) == (3, 1)
    assert stats.weight_sum == pytest.approx(7.25) and stats.weight_max == pytest.approx(5.0)
    k3 = [w - np.log(w) - 1 for w in (1.0, 5.0, 1.25)]
    assert stats.mismatch_kl == pytest.approx(sum(k3))
    with pytest.raises(ValueError, match="off_policy_correction"):
        importance_weights(proximal, behaviour, "is", cap=2.0)


@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.actor.off_policy_correction=importance", "actor_rollout_ref.actor.off_policy_correction"),
    ("actor_rollout_ref.actor.tis_cap=0.5", "actor_rollout_ref.actor.tis_cap must be >= 1"),
])
def test_bad_correction_keys_fail_at_start_up(tiny_model_path, tmp_path, no_model_loading, override, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        AgentTrainer(compose_cfg(small_overrides(tiny_model_path, tmp_path / "run", override)))


def test_decoupled_needs_an_engine_that_returns_log_probs(tiny_model_path, tmp_path):
    from ragen.llm.scripted import ScriptedEngine

    class NoLogprobs(ScriptedEngine):
        name = "hf"  # passes as trainable: the check under test comes next
        returns_logprobs = False

    cfg = compose_cfg(small_overrides(tiny_model_path, tmp_path / "run",
                                      "actor_rollout_ref.actor.off_policy_correction=decoupled"))
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.off_policy_correction=decoupled"):
        AgentTrainer(cfg, engine=NoLogprobs())


def test_no_behaviour_log_probs_fall_back_to_no_correction_with_one_warning(tiny_model_path, caplog):
    """An engine (or server) that returned no log-probs: tis trains as none would, and says so once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    answers, advantages = ["<answer> dragon </answer>", "<answer> phoenix </answer>"] * 2, [1.0, -1.0] * 2
    weights = []
    for correction in ("none", "tis"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
        actor = PPOActor(model, _trainer_config(lr=3e-3, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4,
                                                shuffle=False), pad_token_id=0, correction=correction)
        with caplog.at_level("WARNING", logger="ragen.trainer.actor"):
            for step in (1, 2):
                m = actor.update(_episode_samples(tok, answers, advantages), step)
        assert m["off_policy/logprob_token_frac"] == 0.0 and "off_policy/mismatch_kl" not in m
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])
    warned = [r for r in caplog.records if "returned no log-probs" in r.getMessage()]
    assert len(warned) == 1 and "falls back to none" in warned[0].getMessage()

"""``actor_rollout_ref.actor.autocast``: bf16 where the hardware has it natively, a warning naming
the CPU flag and float32 where not; under bf16 the decoder runs in bfloat16 and the log-probs are
still made in float32 from float32 logits."""

from __future__ import annotations

import logging

import pytest
import torch

from ragen.trainer import precision
from ragen.trainer.logprobs import prompt_root, sequence_logprobs

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _fresh_answers():
    precision.autocast_dtype.cache_clear()
    yield
    precision.autocast_dtype.cache_clear()


def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 amx_bf16 amx_tile\n\nprocessor\t: 1\nflags\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert {"avx2", "amx_bf16", "fpu"} <= precision.cpu_flags(str(x86))
    assert "bf16" in precision.cpu_flags(str(arm))
    assert precision.cpu_flags(str(tmp_path / "missing")) is None


def test_bf16_on_a_cpu_without_it_warns_naming_the_flags_and_runs_in_float32(monkeypatch, caplog):
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"fpu", "avx2", "avx512f"})
    with caplog.at_level(logging.WARNING, logger="ragen.trainer.precision"):
        assert precision.autocast_dtype("bf16", "cpu") is None
        assert precision.autocast_dtype("bf16", "cpu") is None  # once a process
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "actor_rollout_ref.actor.autocast=bf16" in warnings[0]
    assert "amx_bf16 / avx512_bf16" in warnings[0] and "float32" in warnings[0]


def test_bf16_where_the_cpu_has_it_and_none_by_default(monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert precision.autocast_dtype("bf16", "cpu") is torch.bfloat16
    assert precision.autocast_dtype("none", "cpu") is None
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.autocast"):
        precision.autocast_dtype("fp16", "cpu")


def _samples(tokenizer):
    from ragen.trainer.core import Sample

    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    system = enc("You are a careful agent. Answer in the format asked for, and think first.")
    out = []
    for group, prompt in enumerate(["Which way on the frozen lake?", "Push the box onto the target."]):
        for i, answer in enumerate(["<answer> Up </answer>", "I go <answer> Down </answer>"]):
            p, a = system + enc(prompt), enc(answer)
            out.append(Sample(p + a, [0] * len(p) + [1] * len(a), advantage=(-1.0) ** i, group_key=group))
    return out


def test_under_bf16_the_decoder_runs_in_bfloat16_and_log_probs_stay_float32(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    samples = _samples(tok)
    seen: dict[str, torch.dtype] = {}
    def record(name):
        def hook(module, inputs, output):
            seen.setdefault(name, output.dtype)
        return hook

    hooks = [module.register_forward_hook(record(name))
             for name, module in model.named_modules() if name.endswith(("q_proj", "lm_head"))]
    try:
        with torch.no_grad():
            plain = sequence_logprobs(model, samples, tok.pad_token_id or 0)
            seen.clear()
            root = prompt_root(model, samples, autocast=torch.bfloat16)
            half = sequence_logprobs(model, samples, tok.pad_token_id or 0, root=root, autocast=torch.bfloat16)
    finally:
        for hook in hooks:
            hook.remove()
    assert any(name.endswith("q_proj") and dtype == torch.bfloat16 for name, dtype in seen.items())
    assert seen["lm_head"] == torch.float32  # the output layer is not autocast
    assert half.logp.dtype == torch.float32 and half.counts == plain.counts
    # bfloat16 keeps about 3 significant digits: close to the float32 log-probs, not equal to them
    assert not torch.equal(half.logp, plain.logp)
    torch.testing.assert_close(half.logp, plain.logp, atol=0.1, rtol=0.05)


def test_an_update_under_bf16_trains_the_float32_weights(tiny_model_and_tokenizer, monkeypatch):
    from ragen.trainer.actor import PPOActor
    from ragen.trainer.config import ActorSection, OptimSection, TrainerConfig

    monkeypatch.setattr(precision, "cpu_flags", lambda: {"amx_bf16"})  # as on a CPU with AMX
    model, tok = tiny_model_and_tokenizer
    model.train()
    cfg = TrainerConfig(actor=ActorSection(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, shuffle=False,
                                           autocast="bf16", optim=OptimSection(lr=1e-3)))
    actor = PPOActor(model, cfg, pad_token_id=tok.pad_token_id or 0)
    before = [p.detach().clone() for p in actor.params]
    dtypes = set()
    q_proj = next(m for name, m in model.named_modules() if name.endswith("q_proj"))
    hook = q_proj.register_forward_hook(lambda module, inputs, output: dtypes.add(output.dtype) and None)
    try:
        metrics = actor.update(_samples(tok))
    finally:
        hook.remove()
    assert dtypes == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in actor.params)
    assert any(not torch.equal(a, p) for a, p in zip(before, actor.params))
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())

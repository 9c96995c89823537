"""UpdateProgress: an update's micro-batch passes (old and reference log-probs, each epoch's) are
counted to the total announced at its start, in phases, and shown as whole log lines off a
terminal, as a bar on one, and not at all for a short update."""

from __future__ import annotations

import dataclasses
import io
import logging
import time

import pytest
import torch

from ragen.trainer import PPOActor
from ragen.trainer.actor import adapter_off_reference, frozen_copy_reference
from ragen.trainer.progress import UpdateProgress
from tests.test_trainer import _episode_samples, _trainer_config


class RecordingUpdate(UpdateProgress):
    """Counts, shown nowhere, with each phase and the count when it began."""

    def __init__(self, step: int, total: int) -> None:
        super().__init__(step, total, disable=True)
        self.phases: list[tuple[str, int]] = []

    def start(self, phase: str) -> None:
        self.phases.append((phase, self.done))
        super().start(phase)


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lora", [False, True])
def test_every_micro_batch_pass_of_an_update_is_counted_in_its_phase(tiny_model_and_tokenizer, lora):
    model, tok = tiny_model_and_tokenizer
    # 7 samples, mini-batches of 4 and 3, micro-batches of 2: 2 + 2 training passes an epoch, and
    # ceil(7 / 2) = 4 passes for each of the old and the reference log-probs
    samples = _episode_samples(tok, ["<answer> dragon </answer>", "<answer> phoenix </answer>"] * 3 + ["no"],
                               [1.0, -1.0] * 3 + [0.5])
    cfg = _trainer_config(lr=1e-3, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, ppo_epochs=2,
                          use_kl_loss=True, shuffle=False)
    if lora:
        from ragen.trainer.policy import apply_lora

        model = apply_lora(model, dataclasses.replace(cfg.model, lora_rank=4, lora_alpha=8))
        reference = adapter_off_reference(model, 0, cfg)
    else:
        reference = frozen_copy_reference(model, 0, cfg)
    actor = PPOActor(model, cfg, pad_token_id=0, reference=reference)
    progress = RecordingUpdate(3, 4 + 4 + 2 * (2 + 2))
    metrics = actor.update(samples, 3, progress=progress)
    assert metrics["actor/n_optimizer_steps"] == 4.0
    assert progress.done == progress.total == 16
    assert progress.phases == [("old log-probs", 0), ("reference log-probs", 4), ("epoch 1/2", 8),
                               ("epoch 2/2", 12)]
    assert progress._closed  # the update closed it: no bar is left behind


def test_an_update_counts_its_own_total_when_given_no_display(tiny_model_and_tokenizer, monkeypatch):
    """Without a display the update makes one, with the total of its passes: one epoch of one
    mini-batch takes the old log-probs from its own pass, so only the training passes count."""
    model, tok = tiny_model_and_tokenizer
    made: list[UpdateProgress] = []

    class Made(UpdateProgress):
        def __init__(self, step: int, total: int) -> None:
            super().__init__(step, total, disable=True)
            made.append(self)

    monkeypatch.setattr("ragen.trainer.actor.UpdateProgress", Made)
    samples = _episode_samples(tok, ["<answer> dragon </answer>", "<answer> phoenix </answer>"] * 3, [1.0, -1.0] * 3)
    actor = PPOActor(model, _trainer_config(lr=1e-3, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4),
                     pad_token_id=0)
    actor.update(samples, 1)
    assert [(p.step, p.total, p.done, p.phase) for p in made] == [(1, 2, 2, "epoch 1/1")]


def test_not_on_a_terminal_an_update_logs_whole_lines(caplog):
    now = [50.0]
    caplog.set_level(logging.INFO, logger="ragen.trainer.progress")
    with UpdateProgress(7, 6, delay_s=2, log_every_s=10, file=io.StringIO(), clock=lambda: now[0],
                        tick_s=None) as progress:
        progress.start("epoch 1/1")
        for t in (51, 52.5, 60, 63):
            now[0] = t
            progress.passed()
    lines = [r.getMessage() for r in caplog.records if r.name == "ragen.trainer.progress"]
    assert lines == ["[Progress] update of step 7: 2/6 micro-batches | epoch 1/1 | 2 s",
                     "[Progress] update of step 7: 4/6 micro-batches | epoch 1/1 | 13 s"]


def test_on_a_terminal_an_update_is_a_bar_removed_at_its_end():
    out = io.StringIO()
    with UpdateProgress(2, 4, delay_s=0.05, tick_s=None, file=out, terminal=True) as progress:
        progress.start("reference log-probs")
        time.sleep(0.6)  # past the delay and tqdm's mininterval (0.5 s) between redraws
        progress.passed()
    text = out.getvalue()
    assert "update 2" in text and "1/4" in text and "reference log-probs" in text
    assert text.endswith("\r")  # cleared: the step's summary line follows on a clean line


def test_a_short_update_shows_nothing(caplog):
    caplog.set_level(logging.INFO, logger="ragen.trainer.progress")
    out = io.StringIO()
    with UpdateProgress(1, 2, file=out, terminal=True) as bar, \
            UpdateProgress(1, 2, file=io.StringIO(), terminal=False) as lines:
        for p in (bar, lines):
            p.start("epoch 1/1")
            p.passed()
            p.passed()
    assert out.getvalue() == ""
    assert not [r for r in caplog.records if r.name == "ragen.trainer.progress"]

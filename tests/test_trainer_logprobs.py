"""Token log-probs in chunks at the loss positions alone: equal to the full-vocabulary computation
(log-probs, entropies, the loss and its gradients), and no full-vocabulary tensor kept for backward."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ragen.trainer.core import Sample
from ragen.trainer.logprobs import sequence_logprobs
from ragen.utils import common_prefix_length

pytestmark = pytest.mark.timeout(300)


def _samples(tokenizer) -> list[Sample]:
    """Two groups of multi-turn-like episodes (prompt, answer, more prompt, answer) and a lone one."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    out = []
    for group, prompt in enumerate(["You are on a frozen lake. Which way do you go next? Think first.",
                                    "Push the box onto the target; the grid is below. Which move?"]):
        for i, (first, second) in enumerate([("<answer> Up </answer>", "<answer> Left </answer>"),
                                             ("I go <answer> Down </answer>", "<answer> Right || Up </answer>"),
                                             ("<think> far </think><answer> Left </answer>", "no")]):
            ids, mask = enc(prompt), [0] * len(enc(prompt))
            for answer, more in ((first, " The lake now looks different. Go on."), (second, None)):
                a = enc(answer) + [eos]
                ids, mask = ids + a, mask + [1] * len(a)
                if more:
                    ids, mask = ids + enc(more), mask + [0] * len(enc(more))
            out.append(Sample(ids, mask, advantage=(-1.0) ** i, group_key=group))
    lone = enc("A different question entirely. <answer> Up </answer>")
    out.append(Sample(lone, [0] * 6 + [1] * (len(lone) - 6), advantage=0.5, group_key=7))
    return out


def _full_vocabulary(logits, samples, shifts, temperature):
    """Log-probs and entropies from full-vocabulary logits, in float32 (the state before the chunks).
    The logits that predict position ``p`` of ``samples[row]`` are ``logits[row, p - 1 + shifts[row]]``."""
    logps, entropies = [], []
    for row, s in enumerate(samples):
        pos = [t for t, m in enumerate(s.loss_mask) if m and t >= 1]
        rows = logits[row, [p - 1 + shifts[row] for p in pos]].float() / temperature
        logz = torch.logsumexp(rows, -1)
        logps.append(rows.gather(-1, torch.tensor([s.input_ids[p] for p in pos])[:, None])[:, 0] - logz)
        entropies.append(logz - (torch.softmax(rows, -1) * rows).sum(-1))
    return logps, entropies


def _reference(model, samples, temperature, share_prefix):
    """The same batches through the model's own forward: its logits over the whole vocabulary
    at every position, a prefix pass shared by each group (``share_prefix``) or one left-padded
    batch."""
    if not share_prefix:
        width = max(len(s.input_ids) for s in samples)
        ids = torch.zeros((len(samples), width), dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for row, s in enumerate(samples):
            ids[row, width - len(s.input_ids):] = torch.tensor(s.input_ids)
            mask[row, width - len(s.input_ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logps, entropies = _full_vocabulary(logits, samples, [width - len(s.input_ids) for s in samples], temperature)
        return torch.cat(logps), torch.cat(entropies)
    logps, entropies = [], []
    for group in dict.fromkeys(s.group_key for s in samples):
        members = [s for s in samples if s.group_key == group]
        shared = min(common_prefix_length([s.input_ids for s in members]),
                     min(s.loss_mask.index(1) for s in members) - 1)
        cache = model(input_ids=torch.tensor([members[0].input_ids[:shared]]), use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(members))
        width = max(len(s.input_ids) for s in members) - shared
        ids = torch.zeros((len(members), width), dtype=torch.long)
        for row, s in enumerate(members):
            ids[row, : len(s.input_ids) - shared] = torch.tensor(s.input_ids[shared:])
        positions = (shared + torch.arange(width)).unsqueeze(0).expand(len(members), -1)
        logits = model(input_ids=ids, attention_mask=torch.ones((len(members), shared + width), dtype=torch.long),
                       position_ids=positions, past_key_values=cache).logits
        got = _full_vocabulary(logits, members, [-shared] * len(members), temperature)
        logps += got[0]
        entropies += got[1]
    return torch.cat(logps), torch.cat(entropies)


def _loss(logp, entropy, samples, counts):
    adv = torch.cat([torch.full((c,), s.advantage) for s, c in zip(samples, counts)])
    return (-(adv * logp) - 0.01 * entropy).sum() / len(logp)


def _grads(model, loss) -> torch.Tensor:
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _single_turn_samples(tokenizer) -> list[Sample]:
    """Short answers after a long prompt, two groups and a lone one: the answers are packed in one
    row after their group's prompt."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    rules = enc("You are playing a bandit game. Two arms, owl and wolf; each has its own reward distribution, "
                "related to its name. Guess which arm gives more on average and answer in the format asked.")
    out = []
    for group, question in enumerate([" Which arm now?", " And which arm this time? Think first."]):
        prompt = rules + enc(question)
        for i, answer in enumerate(["<answer> owl </answer>", "<answer> wolf </answer>", "owl"]):
            a = enc(answer)
            out.append(Sample(prompt + a, [0] * len(prompt) + [1] * len(a), advantage=(-1.0) ** i, group_key=group))
    lone = rules + enc(" <answer> owl </answer>")
    out.append(Sample(lone, [0] * len(rules) + [1] * (len(lone) - len(rules)), advantage=0.5, group_key=9))
    return out


def _check_equal(model, tokenizer, settings, make_samples=_samples):
    model.eval()
    samples = make_samples(tokenizer)
    counts = [s.num_loss_tokens for s in samples]
    references = {}  # (temperature, share_prefix) -> log-probs, entropies, gradients: the same for every chunk size
    for temperature in (1.0, 0.7):
        for share_prefix, chunk_size, checkpoint_layers in settings:
            if (temperature, share_prefix) not in references:
                ref_logp, ref_entropy = _reference(model, samples, temperature, share_prefix)
                ref_grads = _grads(model, _loss(ref_logp, ref_entropy, samples, counts))
                references[temperature, share_prefix] = ref_logp.detach(), ref_entropy.detach(), ref_grads
            ref_logp, ref_entropy, ref_grads = references[temperature, share_prefix]
            stats = sequence_logprobs(model, samples, tokenizer.pad_token_id or 0, with_entropy_grad=True,
                                      share_prefix=share_prefix, temperature=temperature, chunk_size=chunk_size,
                                      checkpoint_layers=checkpoint_layers)
            where = (f"share_prefix={share_prefix} chunk_size={chunk_size} checkpoint_layers={checkpoint_layers} "
                     f"temperature={temperature}")
            assert stats.counts == counts, where
            torch.testing.assert_close(stats.logp, ref_logp, atol=1e-5, rtol=1e-5, msg=where)
            torch.testing.assert_close(stats.entropy, ref_entropy, atol=1e-5, rtol=1e-5, msg=where)
            loss = _loss(stats.logp, stats.entropy, samples, counts)
            torch.testing.assert_close(loss, _loss(ref_logp, ref_entropy, samples, counts), atol=1e-5, rtol=1e-5)
            grads = _grads(model, loss)
            assert float((grads - ref_grads).norm() / ref_grads.norm()) < 1e-4, where


def test_chunked_log_probs_equal_the_full_vocabulary_ones_on_the_tiny_model(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    _check_equal(model, tok, [(True, 5, False), (False, 5, False), (True, 256, False), (False, 256, False),
                              (True, 256, True), (False, 5, True)])


def test_packed_answers_after_a_shared_prompt_equal_the_full_vocabulary_ones(tiny_model_and_tokenizer):
    from ragen.trainer.logprobs import _Passes

    model, tok = tiny_model_and_tokenizer
    samples = _single_turn_samples(tok)
    packed = []
    real = _Passes.packed

    def spy(self, batch, start, shared):
        packed.append(len(batch))
        return real(self, batch, start, shared)

    _Passes.packed = spy
    try:
        _check_equal(model, tok, [(True, 5, False), (True, 256, True)], make_samples=_single_turn_samples)
        with torch.no_grad():  # after a prompt root, the lone sample too
            from ragen.trainer.logprobs import prompt_root
            root = prompt_root(model, samples)
            assert root is not None
            torch.testing.assert_close(sequence_logprobs(model, samples, root=root).logp,
                                       sequence_logprobs(model, samples, share_prefix=False).logp,
                                       atol=1e-5, rtol=1e-5)
    finally:
        _Passes.packed = real
    assert 3 in packed and 1 in packed, packed  # both groups' answers packed, and the lone one after the root


def test_chunked_log_probs_equal_the_full_vocabulary_ones_on_the_default_model():
    """What the tiny model lacks: the default model's 49,152-token vocabulary, its tokenizer and its
    trained weights (peaked logits). Its first two decoder layers show them as all thirty would."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen.llm.default_model import resolve_model_path

    torch.manual_seed(0)
    path = resolve_model_path("default")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                 num_hidden_layers=2)
    assert model.config.vocab_size == 49152 and len(model.model.layers) == 2
    _check_equal(model, AutoTokenizer.from_pretrained(path, local_files_only=True),
                 [(True, 16, False), (False, 256, False), (True, 256, True)])


def test_no_full_vocabulary_tensor_is_kept_for_backward(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    vocab = model.get_output_embeddings().weight.shape[0]
    samples = _samples(tok)
    kept = []

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == vocab:
            kept.append(tuple(t.shape))
        return t

    for share_prefix in (True, False):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stats = sequence_logprobs(model, samples, tok.pad_token_id or 0, with_entropy_grad=True,
                                      share_prefix=share_prefix, chunk_size=4)
        assert kept == [], f"share_prefix={share_prefix}: tensors of the vocabulary's width kept: {kept}"
        stats.logp.sum().backward()  # the chunks' logits are made again here
        # the check itself can fail: the textbook computation keeps its logits
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _reference(model, samples, 1.0, share_prefix)
        assert kept, "the check saw no full-vocabulary tensor in the textbook computation"
        kept.clear()


def test_step_memory_reports_the_peak_since_the_step_started():
    # in a fresh process: memory that this one freed and kept would be reused unseen
    script = """
import torch
from ragen.trainer.memory import StepMemory
memory = StepMemory()
memory.start()
big = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
with_big = memory.metrics()
del big
memory.start()
after = memory.metrics()
print(with_big["memory/peak_rss_gb"] - after["memory/peak_rss_gb"], after["memory/peak_rss_since_start"])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    forgotten, since_start = map(float, out.stdout.split())
    assert since_start == 0.0 and forgotten > 0.04  # the reset forgot the 64 MiB


def test_checkpointed_layers_keep_only_their_inputs_and_are_restored(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    model.eval()
    samples = _samples(tok)
    layers = model.get_decoder().layers
    saved = {}
    for checkpoint_layers in (False, True):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stats = sequence_logprobs(model, samples, tok.pad_token_id or 0, checkpoint_layers=checkpoint_layers)
        saved[checkpoint_layers] = sum(sizes)
        stats.logp.sum().backward()
        assert not any(layer.training for layer in layers)  # eval mode again, as the actor keeps it
    assert saved[True] < saved[False] / 2, saved


def test_the_prefix_caches_give_a_layer_run_again_what_its_first_run_got():
    from ragen.trainer.logprobs import _ReadOnlyCache, _RecordOnce

    prefix, again, suffix = (torch.randn(1, 3, n, 4) for n in (5, 5, 2))
    recorded = _RecordOnce()
    assert torch.equal(recorded.update(prefix, prefix, 0)[0], prefix)
    assert recorded.update(again, again, 0)[0] is again  # run again for backward: the empty cache it first saw
    assert torch.equal(recorded.layers[0].keys, prefix)  # kept once
    read_only = _ReadOnlyCache([(recorded.layers[0].keys, recorded.layers[0].values)])
    first = read_only.update(suffix, suffix, 0)
    second = read_only.update(suffix, suffix, 0)
    assert first[0].shape[-2] == second[0].shape[-2] == 7 and torch.equal(first[0], second[0])
    assert read_only.layers[0].keys.shape[-2] == 5  # nothing added


def _with_system_prompt(tokenizer, samples: list[Sample]) -> list[Sample]:
    """The samples behind one system prompt that every one of them starts with (a prompt root)."""
    system = tokenizer.encode("You are a careful agent. Answer in the format asked for, and think first.",
                              add_special_tokens=False)
    return [Sample(system + s.input_ids, [0] * len(system) + s.loss_mask, advantage=s.advantage,
                   group_key=s.group_key) for s in samples]


@pytest.mark.parametrize("checkpoint_layers", [False, True])
@pytest.mark.parametrize("make_samples", [_samples, _single_turn_samples])  # batched rests; packed ones
def test_a_prompt_root_run_once_gives_the_log_probs_and_gradients_of_separate_passes(tiny_model_and_tokenizer,
                                                                                    checkpoint_layers, make_samples):
    from ragen.trainer.logprobs import prompt_root

    model, tok = tiny_model_and_tokenizer
    model.eval()
    samples = _with_system_prompt(tok, make_samples(tok))
    counts = [s.num_loss_tokens for s in samples]
    ref_logp, ref_entropy = _reference(model, samples, 1.0, share_prefix=False)
    ref_grads = _grads(model, _loss(ref_logp, ref_entropy, samples, counts))
    model.zero_grad()
    root = prompt_root(model, samples, checkpoint_layers=checkpoint_layers)
    # the common start, less the token before the first answer token (its state scores that token)
    assert root is not None and root.length == min(common_prefix_length([s.input_ids for s in samples]),
                                                   min(s.loss_mask.index(1) for s in samples) - 1)
    logps = []
    for batch in (samples[:2], samples[2:5], samples[5:]):  # micro-batches that split groups
        stats = sequence_logprobs(model, batch, tok.pad_token_id or 0, with_entropy_grad=True, root=root,
                                  checkpoint_layers=checkpoint_layers)
        _loss(stats.logp, stats.entropy, batch, stats.counts).mul(len(stats.logp) / len(ref_logp)).backward()
        logps.append(stats.logp.detach())
    def grads():
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    before = grads()
    root.backward()
    after = grads()
    # the root's share of the gradient arrives through root.backward(), not before
    assert float((after - before).norm()) > 1e-3 * float(after.norm())
    torch.testing.assert_close(torch.cat(logps), ref_logp.detach(), atol=1e-5, rtol=1e-5)
    assert float((after - ref_grads).norm() / ref_grads.norm()) < 1e-4


def test_a_prompt_root_needs_a_long_enough_common_start(tiny_model_and_tokenizer):
    from ragen.trainer.logprobs import prompt_root

    model, tok = tiny_model_and_tokenizer
    samples = _samples(tok)
    with torch.no_grad():
        assert prompt_root(model, samples) is None  # the two groups' prompts differ from the start
        rooted = _with_system_prompt(tok, samples)
        assert prompt_root(model, rooted[:1]) is None
        root = prompt_root(model, rooted)
        with pytest.raises(ValueError, match="prompt root"):
            sequence_logprobs(model, samples, root=root)

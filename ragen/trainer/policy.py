"""The trainable policy: the model the actor trains, its LoRA adapter, and its weights as an engine and
a checkpoint take them. With the ``hf`` engine the policy is ``engine.model`` itself (LoRA layers are
injected into that same object); with ``vllm`` it is a transformers copy loaded from the same files,
whose weights are pushed to the engine after each step.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from ragen.trainer import checkpoint as ckpt
from ragen.trainer.config import ModelSection


def transformers_copy(path: str) -> tuple[Any, Any]:
    """A transformers model (float32, on the GPU when there is one) and its tokenizer, from ``path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).to(device)
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True)


def apply_lora(model: Any, cfg: ModelSection) -> Any:
    """``model`` with LoRA layers injected in place (``actor_rollout_ref.model``'s rank, alpha, modules)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=cfg.target_modules,
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    try:
        # Injects LoRA layers into `model` in place: the engine's model object is the one trained.
        peft_model = get_peft_model(model, lora)
    except ValueError as exc:
        raise ValueError(f"actor_rollout_ref.model.target_modules={cfg.target_modules!r}: {exc}") from exc
    n = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    if n == 0:
        raise ValueError(f"actor_rollout_ref.model.target_modules={cfg.target_modules!r} gives no trainable "
                         "parameters")
    return peft_model


def merged_weights(model: Any, peft_model: Any | None) -> list[tuple[str, torch.Tensor]]:
    """The policy's weights under the base model's names (LoRA merged in)."""
    if peft_model is None:
        return [(n, p.detach()) for n, p in model.named_parameters()]
    peft_model.merge_adapter()
    try:
        out = []
        for name, p in model.named_parameters():
            if "lora_" in name:
                continue
            out.append((name.replace(".base_layer.", "."), p.detach().clone()))
        return out
    finally:
        peft_model.unmerge_adapter()


def trainable_state(model: Any, peft_model: Any | None) -> dict[str, torch.Tensor]:
    """What a checkpoint stores of the model: all of it, or the LoRA adapter's tensors."""
    if peft_model is None:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_trainable_state(model: Any, peft_model: Any | None, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy a checkpoint's ``trainable_state`` into the policy; ValueError where a LoRA tensor has no place
    or another shape."""
    if peft_model is None:
        model.load_state_dict(tensors)
        return
    params = dict(peft_model.named_parameters())
    for name, tensor in tensors.items():
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in this LoRA model "
                             "(actor_rollout_ref.model.lora_rank / target_modules changed?)")
        if params[name].shape != tensor.shape:  # a checkpoint whose meta.json does not say its rank
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, this LoRA "
                             f"model's {tuple(params[name].shape)}: actor_rollout_ref.model.lora_rank "
                             "must be the checkpoint's")
        params[name].copy_(tensor)


def load_checkpoint_policy(model: Any, folder: str | os.PathLike) -> int:
    """Make ``model`` (the base model the run started from) the policy of the checkpoint in ``folder``
    (``<run>/checkpoints/global_step_<N>``), in place: its whole weights, or its LoRA adapter injected
    as the trainer injects it (the adapter's config from its ``lora_adapter/``); return the
    checkpoint's policy version. CheckpointError where ``folder`` holds no readable checkpoint."""
    run, step = ckpt.checkpoint_folder(folder)
    state = ckpt.load_checkpoint(run, step)
    peft_model = None
    if state.get("lora"):
        from peft import LoraConfig, get_peft_model

        adapter = ckpt.step_dir(run, step) / "lora_adapter"
        try:
            config = LoraConfig.from_pretrained(str(adapter))
        except (OSError, ValueError) as exc:  # no adapter_config.json, or one peft cannot read
            raise ckpt.damaged(run, step, f"its LoRA adapter's config in {adapter}: {exc}") from None
        peft_model = get_peft_model(model, config)
    with torch.no_grad():
        load_trainable_state(model, peft_model, state["model"])
    return int(state["policy_version"])

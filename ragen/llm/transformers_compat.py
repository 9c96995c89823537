"""Differences between transformers versions that more than one module meets.

``dtype_kwarg``: the name of ``from_pretrained``'s dtype argument. It lives here,
not in ``ragen.llm.hf``, so that ``ragen.llm.default_model`` (which ``hf``
imports) can use it without importing ``hf`` back.

``checkpointable_layer``: transformers' ``GradientCheckpointingLayer``, where it
keeps the key/value cache; the trainer's config checks it (without importing
torch) and ``ragen.trainer.logprobs`` uses it.
"""

from __future__ import annotations

from typing import Any


def dtype_kwarg(dtype: Any) -> dict[str, Any]:
    """``from_pretrained``'s dtype argument: ``dtype`` since transformers 4.56, ``torch_dtype`` before."""
    import transformers
    from packaging.version import Version

    new = Version(transformers.__version__.split("+")[0]) >= Version("4.56")
    return {"dtype" if new else "torch_dtype": dtype}


def checkpointable_layer() -> type:
    """transformers' ``GradientCheckpointingLayer``; ValueError naming the key where it has none, or
    where it drops the key/value cache of a checkpointed layer (the prefix passes read one)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError as exc:
        raise ValueError("actor_rollout_ref.model.enable_gradient_checkpointing needs a transformers with "
                         "transformers.modeling_layers.GradientCheckpointingLayer (>= 4.53)") from exc
    if not hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache"):
        # older ones set past_key_values=None in a checkpointed layer: the log-probs would be wrong
        raise ValueError("actor_rollout_ref.model.enable_gradient_checkpointing needs a transformers whose "
                         "GradientCheckpointingLayer can keep the key/value cache (_can_checkpoint_with_cache: "
                         "5.23 has it, 5.10 does not)")
    return GradientCheckpointingLayer

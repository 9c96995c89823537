"""Shared pytest fixtures."""

from __future__ import annotations

import pytest

# ---------------------------------------------------------------------------
# ragen.llm: a tiny random chat model built in-process (no downloads).
# Used by the engine tests and the trainer's tests.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """Folder of a tiny random Llama-style chat model + tokenizer (seed 0)."""
    from ragen.llm.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture
def tiny_model_and_tokenizer(tiny_model_path):
    """A fresh (model, tokenizer) pair loaded from ``tiny_model_path``, in eval mode, on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)
    return model.eval(), tokenizer


# --------------------------- end of ragen.llm fixtures ----------------------

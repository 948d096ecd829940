"""Shared fixtures for the training tests: the embedded target and a small set of its own stories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specheads import load_target
from specheads.training.data_cli import regenerate

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def target_and_tokenizer():
    return load_target("stories260K")


@pytest.fixture(scope="session")
def stories_file(tmp_path_factory, target_and_tokenizer) -> Path:
    """64 short stories written by stories260K itself (fixed seed)."""
    target, tokenizer = target_and_tokenizer
    path = tmp_path_factory.mktemp("data") / "stories.jsonl"
    regenerate(target, tokenizer, path, stories=64, max_new_tokens=48, batch_size=64, seed=0, show_progress=False)
    return path


@pytest.fixture()
def chat_file(tmp_path) -> Path:
    """Two conversations in ShareGPT format and one in OpenAI format."""
    sharegpt = [
        {"id": "a", "conversations": [{"from": "human", "value": "Tell me a story."},
                                      {"from": "gpt", "value": "Once upon a time there was a cat."}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there."},
                                      {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Bye bye."}]},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in sharegpt) + "\n")
    return path

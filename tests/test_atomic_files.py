"""`specheads.atomic_files`: a file is replaced whole or left as it was, and no staged file stays behind."""

from __future__ import annotations

import pytest

from specheads.atomic_files import staged_file, write_atomically


def test_write_atomically_replaces_the_file_whole(tmp_path):
    path = write_atomically(tmp_path / "sub" / "results.json", "{}")  # the folder is made
    assert path.read_text() == "{}"
    write_atomically(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01" and sorted(p.name for p in path.parent.iterdir()) == ["results.json"]


def test_a_failed_write_leaves_the_old_file_and_no_staged_one(tmp_path):
    path = write_atomically(tmp_path / "index.json", "old")
    with pytest.raises(RuntimeError, match="disk full"), staged_file(path) as staged:
        staged.write_text("half of the ne")
        assert staged.parent == path.parent and staged.name.endswith(".partial")
        raise RuntimeError("disk full")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["index.json"]

"""Files written whole or not at all: a reader (or a run that resumes after a crash) never sees a torn one.

The content goes to a temporary file beside the target, which then replaces it in one `os.replace` (atomic on POSIX
and Windows within a file system). A failure while writing leaves the old file as it was and no temporary behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_file(path: str | Path) -> Iterator[Path]:
    """Yields a temporary path beside `path` to write; on leaving the block it replaces `path` (on an error it is
    removed and `path` is left alone)."""
    path = Path(path)
    staged = path.with_name(f".{path.name}.partial")
    try:
        yield staged
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)


def write_atomically(path: str | Path, content: str | bytes) -> Path:
    """Write `content` (text as UTF-8, or bytes) to `path` atomically, creating its folder; returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with staged_file(path) as staged:
        staged.write_bytes(content.encode() if isinstance(content, str) else content)
    return path

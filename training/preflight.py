"""Checks run before long work starts: the output folder is writable and its disk has room.

A run that dies at hour 10 because output_dir is read-only or the disk is full wastes the 10 hours; these
checks fail in the first seconds instead, naming the path, the bytes needed and the bytes free.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# weights + two AdamW moments + the final copy, each float32
TRAINING_BYTES_PER_PARAM = 4 * 4


def check_writable_dir(path: str | Path, what: str = "output folder") -> Path:
    """Create `path` (and parents) if needed and prove a file can be written there.

    Raises:
        OSError: the folder cannot be created (a parent is a file, no permission) or written to.
    """
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".specheads-write-test-"):
            pass
    except OSError as err:
        raise OSError(f"{what} {str(folder)!r} is not writable: {err.strerror or err}") from err
    return folder


def check_writable_file(path: str | Path, what: str = "output file") -> Path:
    """Check that `path` can be created or appended to (its folder is created if needed).

    Raises:
        OSError: the file or its folder cannot be written.
    """
    file = Path(path)
    if file.is_dir():
        raise OSError(f"{what} {str(file)!r} is a folder; expected a file path")
    check_writable_dir(file.parent, f"folder of {what}")
    if file.exists() and not os.access(file, os.W_OK):
        raise OSError(f"{what} {str(file)!r} is not writable (permission denied)")
    return file


def check_free_disk(path: str | Path, needed: int, what: str) -> int:
    """Raise when the disk holding `path` has less than `needed` bytes free; return the free bytes.

    Raises:
        OSError: not enough free space, naming the path, the bytes needed and the bytes free.
    """
    free = shutil.disk_usage(path).free
    if free < needed:
        raise OSError(
            f"not enough disk for {what} in {str(path)!r}: it needs about {needed} bytes "
            f"({needed / 2**20:.1f} MiB), only {free} bytes ({free / 2**20:.1f} MiB) are free"
        )
    return free


def training_disk_bytes(trainable_params: int, save_total_limit: int) -> int:
    """Disk a training run needs: (save_total_limit + 1) copies of weights + AdamW moments + the final save."""
    return trainable_params * TRAINING_BYTES_PER_PARAM * (save_total_limit + 1)

"""Capturing a function of static tensors as a CUDA graph (verification, drafting and decoding steps use it)."""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def capture_cuda_graph(fn: Callable[[], Any], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture `fn` (reading and writing only static tensors) as a CUDA graph, after warm-up on a side stream.

    As the PyTorch CUDA-graph docs prescribe: warm-up iterations run on a side stream (lazy init, autotuning,
    allocator), then one call is recorded. Returns (graph, fn's outputs, which every replay overwrites).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def try_capture(
    fn: Callable[[], Any], what: str, warmup: int = 3, restore: Sequence[torch.Tensor] = ()
) -> tuple[torch.cuda.CUDAGraph | None, Any]:
    """`capture_cuda_graph`, or (None, None) with a warning when capture fails (the caller stays eager).

    `restore`: state tensors that `fn` advances (a decoding step's position, a round's prefix): saved before and
    copied back after, so the warm-up calls leave no trace in them.
    """
    saved = [t.clone() for t in restore]
    try:
        return capture_cuda_graph(fn, warmup)
    except Exception as error:  # noqa: BLE001  (any capture failure: fall back to eager, correct but slower)
        warnings.warn(
            f"CUDA graph capture of the {what} failed ({error!r}{failing_line(error)}); running it eagerly",
            stacklevel=3,
        )
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return None, None
    finally:
        for tensor, value in zip(restore, saved):
            tensor.copy_(value)


def failing_line(error: BaseException) -> str:
    """' at file:line (code)' of the innermost specheads frame of `error`'s traceback, or '' when there is none.

    A capture error ("operation not permitted when stream is capturing") names no operation; the line does.
    """
    package_root = str(Path(__file__).resolve().parent.parent)  # the folder holding specheads' subpackages
    frames = [
        frame for frame in traceback.extract_tb(error.__traceback__)
        if frame.filename.startswith(package_root) and "site-packages" not in frame.filename[len(package_root):]
    ]
    if not frames:
        return ""
    frame = frames[-1]
    return f" at {Path(frame.filename).name}:{frame.lineno} ({frame.line})"

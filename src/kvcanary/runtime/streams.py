"""A switch to another CUDA stream for a block, without torch's per-call Python.

``torch.cuda.stream(s)`` and ``torch.cuda.current_stream()`` look the current device up and build Stream
objects through several layers of Python; a verified step switches streams twice, and its host time is
counted in microseconds.  Here the current stream is read and set through torch's C entry points (what
those wrappers call in the end).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def using(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """``stream`` current for the block: a no-op for None or for the stream already current; torch's own
    context where the stream is on another device than the current one (that switches devices too)."""
    if stream is None:
        yield
        return
    c = torch._C
    if c._cuda_getDevice() != stream.device_index:
        with torch.cuda.stream(stream):
            yield
        return
    previous_id, index, kind = c._cuda_getCurrentStream(stream.device_index)
    if previous_id == stream.stream_id:
        yield
        return
    c._cuda_setStream(stream_id=stream.stream_id, device_index=index, device_type=stream.device_type)
    try:
        yield
    finally:
        c._cuda_setStream(stream_id=previous_id, device_index=index, device_type=kind)

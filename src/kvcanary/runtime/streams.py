"""The current CUDA stream, and a switch to another, without torch's per-call device lookup.

``torch.cuda.current_stream()``, ``Event.record()`` and ``torch.cuda.stream(s)`` look the current device
up through several layers of Python when no device index is given; with an index they go straight to the
C entry points.  A verified step calls them a few times, and its host time is counted in microseconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def record(event: torch.cuda.Event, device_index: int) -> None:
    """``event.record()`` on the current stream of device ``device_index``."""
    event.record(torch.cuda.current_stream(device_index))


@contextlib.contextmanager
def using(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """``stream`` current for the block: a no-op for None or for the stream already current; torch's own
    context where the stream is on another device than the current one (that switches devices too)."""
    if stream is None:
        yield
        return
    if torch.cuda.current_device() != stream.device_index:
        with torch.cuda.stream(stream):
            yield
        return
    previous = torch.cuda.current_stream(stream.device_index)
    if previous == stream:
        yield
        return
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)

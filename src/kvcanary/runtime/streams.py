"""A switch to another CUDA stream for a block, without torch's per-call Python.

``torch.cuda.stream(s)`` and ``torch.cuda.current_stream()`` look the current device up and build Stream
objects through several layers of Python; a verified step switches streams twice, and its host time is
counted in microseconds.  Here the current stream is read and set through torch's C entry points (what
those wrappers call in the end).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch


class StreamSwitch:
    """``with StreamSwitch(stream):`` makes ``stream`` current for the block: a no-op for None or for the stream
    already current; torch's own context where the stream is on another device than the current one (that
    switches devices too).  A class rather than a generator context manager: that is four more Python calls a
    switch, and the per-step path runs with the CPU caches cold, where each costs microseconds."""

    __slots__ = ("_previous", "_stream", "_torch")

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._stream = stream
        self._previous: tuple[int, int, int] | None = None  # (stream id, device index, device type) to restore
        self._torch: Any = None  # torch's context, for a stream of another device

    def __enter__(self) -> None:
        stream = self._stream
        if stream is None:
            return
        c = torch._C
        if c._cuda_getDevice() != stream.device_index:
            self._torch = torch.cuda.stream(stream)
            self._torch.__enter__()
            return
        previous = c._cuda_getCurrentStream(stream.device_index)
        if previous[0] != stream.stream_id:
            c._cuda_setStream(stream_id=stream.stream_id, device_index=previous[1], device_type=stream.device_type)
            self._previous = previous

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        previous, self._previous = self._previous, None
        if previous is not None:
            torch._C._cuda_setStream(stream_id=previous[0], device_index=previous[1], device_type=previous[2])
        elif self._torch is not None:
            context, self._torch = self._torch, None
            context.__exit__(kind, exc, tb)

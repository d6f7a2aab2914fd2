"""The host step's CUDA calls -- a device-to-host copy and an event record on the current stream -- at the cost
of the CUDA call itself, and the staging's host-to-device upload.

Every host step copies the outbox into pinned host memory and records an event behind it (see
:mod:`~kvcanary.runtime.pump`).  Through torch each call costs host time beyond the CUDA call:
``copy_(non_blocking=True)`` dispatches, builds a tensor iterator and records an event for the caching host
allocator; ``Event.record()`` builds the current stream's Python object.  Through cuda-python's runtime
bindings (``cuda.bindings.runtime``) the copy takes 2.2-3.9 us against torch's 3.3-5.9, the record 1.0-1.8
against 2.8-5.4 (``bench_host_step.py``'s breakdown on the H200 host, two runs of one call).  A query costs
the same either way measured in a loop; it goes through the bindings too, since in a serving loop every path
a step touches is cold and the step's uploads and records have just warmed this one.  The bindings are used
where installed, with the stream handle from torch's C entry point (the stream torch would use); elsewhere
torch's calls do the same thing.  The buffers are the callers' own (pinned, kept), so no allocator needs to
know about a copy in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch


def _runtime_bindings() -> ModuleType | None:
    try:
        from cuda.bindings import runtime  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except Exception:  # not installed (a CPU machine, an older CUDA stack): torch's calls instead
        return None
    return runtime  # type: ignore[no-any-return,unused-ignore]


class CudaCalls:
    """The calls for one device; ``bindings=False`` takes torch's path even where the bindings are installed."""

    def __init__(self, device_index: int, *, bindings: bool = True) -> None:
        self.device_index = device_index
        self._rt = _runtime_bindings() if bindings else None
        self._raw_stream: Callable[[int], int] = torch._C._cuda_getCurrentRawStream
        if self._rt is not None:
            self._ok = self._rt.cudaError_t.cudaSuccess
            self._d2h = self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
            self._h2d = self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice
            self._not_ready = self._rt.cudaError_t.cudaErrorNotReady

    @property
    def through_bindings(self) -> bool:
        return self._rt is not None

    def copier(self, dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        """A call that copies ``src`` (device) into ``dst`` (pinned host, same size) asynchronously, on the
        current stream at the time of the call.  Both tensors must outlive it."""
        if dst.nbytes != src.nbytes or not dst.is_pinned() or src.device.type != "cuda":
            raise ValueError("copier: dst must be pinned host memory of src's size, src a CUDA tensor")
        if self._rt is None:

            def torch_copy() -> None:
                dst.copy_(src, non_blocking=True)

            return torch_copy
        args = (dst.data_ptr(), src.data_ptr(), src.nbytes, self._d2h)
        return lambda: self._memcpy(*args)

    def uploader(self, dst: torch.Tensor, src: torch.Tensor) -> Callable[[int], None]:
        """A call that copies the first ``n`` bytes of ``src`` (pinned host, bytes) into ``dst`` (a CUDA byte tensor
        of the same size) asynchronously, on the current stream at the time of the call."""
        if dst.nbytes != src.nbytes or not src.is_pinned() or dst.device.type != "cuda" or dst.element_size() != 1:
            raise ValueError("uploader: src must be pinned host bytes of dst's size, dst a CUDA byte tensor")
        if self._rt is None:

            def torch_upload(n: int) -> None:
                dst[:n].copy_(src[:n], non_blocking=True)

            return torch_upload
        d, s, kind = dst.data_ptr(), src.data_ptr(), self._h2d
        return lambda n: self._memcpy(d, s, n, kind)

    def _memcpy(self, dst: int, src: int, nbytes: int, kind: Any) -> None:
        assert self._rt is not None
        (err,) = self._rt.cudaMemcpyAsync(dst, src, nbytes, kind, self._raw_stream(self.device_index))
        if err != self._ok:
            raise RuntimeError(f"cudaMemcpyAsync failed: {err!r}")

    def event(self) -> StepEvent:
        return StepEvent(self)


class StepEvent:
    """A CUDA event recorded on the current stream of the calls' device; ``query`` never waits."""

    __slots__ = ("_calls", "_event", "_handle")

    def __init__(self, calls: CudaCalls) -> None:
        self._calls = calls
        self._event: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(torch.cuda.current_stream(calls.device_index))  # creates it: its handle is valid now
        self._handle = int(self._event.cuda_event)

    def record(self) -> None:
        calls = self._calls
        rt = calls._rt
        if rt is None:
            self._event.record(torch.cuda.current_stream(calls.device_index))
            return
        (err,) = rt.cudaEventRecord(self._handle, calls._raw_stream(calls.device_index))
        if err != calls._ok:
            raise RuntimeError(f"cudaEventRecord failed: {err!r}")

    def query(self) -> bool:
        """Whether the work before the last record has completed.  Through the bindings where installed: in a
        serving loop the step's copies and records have just run through them, so this call's path is warm."""
        rt = self._calls._rt
        if rt is None:
            return bool(self._event.query())
        (err,) = rt.cudaEventQuery(self._handle)
        if err == self._calls._ok:
            return True
        if err == self._calls._not_ready:
            return False
        raise RuntimeError(f"cudaEventQuery failed: {err!r}")

    def synchronize(self) -> None:
        self._event.synchronize()

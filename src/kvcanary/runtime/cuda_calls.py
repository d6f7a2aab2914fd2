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
know about a copy in flight.  A :class:`Transfer` makes a copy and its record in one Python call: in a serving
loop the step runs with every cache cold, and each distinct function it runs costs microseconds there.
"""

from __future__ import annotations

import functools
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

    def download(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        """Copies of ``src`` (a CUDA tensor) into ``dst`` (pinned host memory of the same size).  Both tensors
        must outlive it."""
        if dst.nbytes != src.nbytes or not dst.is_pinned() or src.device.type != "cuda":
            raise ValueError("download: dst must be pinned host memory of src's size, src a CUDA tensor")
        return Transfer(self, dst, src, self._d2h if self._rt is not None else None)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        """Copies of the first bytes of ``src`` (pinned host bytes) into ``dst`` (a CUDA byte tensor of the same
        size).  Both tensors must outlive it."""
        if dst.nbytes != src.nbytes or not src.is_pinned() or dst.device.type != "cuda" or dst.element_size() != 1:
            raise ValueError("upload: src must be pinned host bytes of dst's size, dst a CUDA byte tensor")
        return Transfer(self, dst, src, self._h2d if self._rt is not None else None)

    def graph_launch(self, graph: Any) -> Callable[[], None]:
        """A launch of ``graph`` (a captured ``torch.cuda.CUDAGraph``, kept alive by the caller) on the current
        stream.  Through the bindings where installed: torch's replay also guards the device, brings the random
        number generators' state up to date and asks the driver its version on every call, none of which a graph
        of the canary's kernels (no random numbers) needs."""
        raw = getattr(graph, "raw_cuda_graph_exec", None)
        if self._rt is None or raw is None:
            return graph.replay  # type: ignore[no-any-return]
        return functools.partial(self._launch, self._rt.cudaGraphExec_t(init_value=raw()))

    def _launch(self, graph_exec: Any) -> None:
        assert self._rt is not None
        (err,) = self._rt.cudaGraphLaunch(graph_exec, self._raw_stream(self.device_index))
        if err != self._ok:
            raise RuntimeError(f"kvcanary: cudaGraphLaunch failed: {err!r}")


class Transfer:
    """Asynchronous copies between two fixed buffers on the current stream, each with an event recorded behind it.

    :meth:`send` makes the copy and the record in one call (on a serving loop's cold step each distinct Python
    function costs microseconds); :meth:`landed` never waits."""

    __slots__ = ("_args", "_calls", "_dst", "_event", "_handle", "_src", "_untracked", "sent")

    def __init__(self, calls: CudaCalls, dst: torch.Tensor, src: torch.Tensor, kind: Any) -> None:
        self._calls = calls
        self._dst, self._src = dst.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8)
        self._args = (dst.data_ptr(), src.data_ptr(), kind)
        self._event: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(torch.cuda.current_stream(calls.device_index))  # creates it: its handle is valid now
        self._handle = int(self._event.cuda_event)
        self.sent = False  # no copy yet: nothing to wait for
        self._untracked = False  # the last copy had no event behind it (see copy())

    def copy(self, nbytes: int) -> None:
        """Copy the first ``nbytes`` on the current stream with no event behind it, for a caller that knows from other
        work on the stream when it has run (:class:`~kvcanary.runtime.pump.CopyFence`): one CUDA call instead of two.
        :meth:`landed` and :meth:`wait` refuse until the next :meth:`send`."""
        calls = self._calls
        rt = calls._rt
        self.sent = self._untracked = True
        if rt is None:
            self._dst[:nbytes].copy_(self._src[:nbytes], non_blocking=True)
            return
        dst, src, kind = self._args
        (err,) = rt.cudaMemcpyAsync(dst, src, nbytes, kind, calls._raw_stream(calls.device_index))
        if err != calls._ok:
            raise RuntimeError(f"kvcanary: a {nbytes}-byte asynchronous copy failed: {err!r}")

    def send(self, nbytes: int) -> None:
        """Copy the first ``nbytes`` and record the event behind the copy, on the current stream."""
        calls = self._calls
        rt = calls._rt
        self.sent = True
        self._untracked = False
        if rt is None:
            self._dst[:nbytes].copy_(self._src[:nbytes], non_blocking=True)
            self._event.record(torch.cuda.current_stream(calls.device_index))
            return
        dst, src, kind = self._args
        stream = calls._raw_stream(calls.device_index)
        (err,) = rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream)
        if err == calls._ok:
            (err,) = rt.cudaEventRecord(self._handle, stream)
        if err != calls._ok:
            raise RuntimeError(f"kvcanary: a {nbytes}-byte asynchronous copy or its event record failed: {err!r}")

    def landed(self) -> bool:
        """Whether the last :meth:`send` has completed (True before the first).  Through the bindings where
        installed: in a serving loop the step's sends have just run through them, so this path is warm."""
        if not self.sent:
            return True
        if self._untracked:
            raise RuntimeError("landed: the last copy was made with copy(), which records no event")
        calls = self._calls
        rt = calls._rt
        if rt is None:
            return bool(self._event.query())
        (err,) = rt.cudaEventQuery(self._handle)
        if err == calls._ok:
            return True
        if err == calls._not_ready:
            return False
        raise RuntimeError(f"kvcanary: cudaEventQuery failed: {err!r}")

    def wait(self) -> None:
        if self._untracked:
            raise RuntimeError("wait: the last copy was made with copy(), which records no event")
        if self.sent:
            self._event.synchronize()

"""The host step's CUDA calls -- a device-to-host copy and an event record on the current stream -- at the cost
of the CUDA call itself, and the staging's host-to-device upload and the step graph's launch.

Every host step copies the outbox into pinned host memory and records an event behind it (see
:mod:`~kvcanary.runtime.pump`).  Through torch each call costs host time beyond the CUDA call:
``copy_(non_blocking=True)`` dispatches, builds a tensor iterator and records an event for the caching host
allocator; ``Event.record()`` builds the current stream's Python object.  So the per-step calls go straight to the
CUDA runtime's C entry points, by the first of these that is there:

* the runtime torch itself loaded (``libcudart``, by the soname of torch's CUDA version, else found among the
  process's mapped libraries), through ``ctypes``: each call converts its integer arguments in C and returns the
  error code as an int;
* cuda-python's runtime bindings (``cuda.bindings.runtime``): each call also builds its result's error enum in Python
  (cuda-bindings' enums), the larger part of a call's host time with the caches cold, as they are in a serving loop;
* torch's own calls, which do the same thing.

Measured by ``bench_host_step.py`` on the H200 host, the bindings' copy took 2.2-3.9 us against torch's 3.3-5.9 and
the record 1.0-1.8 against 2.8-5.4.  The stream handle is torch's current one, from its C entry point.  The buffers
are the callers' own (pinned, kept), so no allocator needs to know about a copy in flight.  A :class:`Transfer`
makes a copy and its record in one Python call: in a serving loop the step runs with every cache cold, and each
distinct function it runs costs microseconds there.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from typing import Any

import torch


class RuntimeCalls:
    """The runtime calls the per-step path makes, each returning the CUDA error code (compared with :attr:`ok` and
    :attr:`not_ready`); ``name`` says which way they go."""

    __slots__ = ("d2h", "event_query", "event_record", "exec_handle", "graph_launch", "h2d", "memcpy_async", "name",
                 "not_ready", "ok")  # fmt: skip

    def __init__(self, name: str, *, ok: Any, not_ready: Any, h2d: Any, d2h: Any) -> None:
        self.name = name
        self.ok, self.not_ready, self.h2d, self.d2h = ok, not_ready, h2d, d2h
        self.memcpy_async: Callable[[int, int, int, Any, int], Any] = _missing
        self.event_record: Callable[[int, int], Any] = _missing
        self.event_query: Callable[[int], Any] = _missing
        self.graph_launch: Callable[[Any, int], Any] = _missing
        self.exec_handle: Callable[[int], Any] = int  # a graph exec's handle as graph_launch takes it


def _missing(*args: Any) -> Any:
    raise RuntimeError("kvcanary: this CUDA runtime call was not bound")


def _loaded_cudart() -> str | None:
    """The path of the CUDA runtime library this process has loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            text = maps.read()  # one read and one search: a process with CUDA loaded maps a thousand lines or more
    except OSError:  # not Linux
        return None
    at = text.find("/libcudart.so")
    if at < 0:
        return None
    start, end = text.rfind("\n", 0, at) + 1, text.find("\n", at)
    fields = text[start : end if end >= 0 else len(text)].split(maxsplit=5)
    return fields[-1].strip() if len(fields) == 6 else None  # the path: the line's sixth field


def _resident(name: str) -> ctypes.PyDLL | None:
    """The library ``name`` (a soname or a path) if this process has loaded it already, else None: ``RTLD_NOLOAD``
    never loads one.  A ``PyDLL``: the calls keep the GIL (a released one may go to another thread for
    milliseconds)."""
    try:
        return ctypes.PyDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):  # not loaded; AttributeError: a platform without RTLD_NOLOAD
        return None


def _loaded_runtime() -> ctypes.PyDLL | None:
    """The CUDA runtime torch loaded: by the soname of torch's CUDA version (``libcudart.so.<major>``: microseconds),
    else by its path in the process's memory map (reading ``/proc/self/maps`` took about 2 ms on a GPU host, where
    CUDA maps a thousand lines or more, on each cache's set-up); None where neither finds it."""
    version = torch.version.cuda
    lib = _resident(f"libcudart.so.{version.split('.')[0]}") if version else None
    if lib is None:
        path = _loaded_cudart()
        lib = None if path is None else _resident(path)
    return lib


def cudart_calls() -> RuntimeCalls | None:
    """The calls through ``ctypes`` into the runtime torch loaded; None where it is not found (a CPU build, a runtime
    linked statically) or lacks an entry point."""
    lib = _loaded_runtime()
    if lib is None:
        return None
    try:
        entries = [lib.cudaMemcpyAsync, lib.cudaEventRecord, lib.cudaEventQuery, lib.cudaGraphLaunch]
    except (OSError, AttributeError):
        return None
    ptr, c_int = ctypes.c_void_p, ctypes.c_int
    argtypes = [(ptr, ptr, ctypes.c_size_t, c_int, ptr), (ptr, ptr), (ptr,), (ptr, ptr)]
    for fn, types in zip(entries, argtypes, strict=True):
        fn.argtypes, fn.restype = types, c_int
    calls = RuntimeCalls("cudart through ctypes", ok=0, not_ready=600, h2d=1, d2h=2)  # cudaSuccess, cudaErrorNotReady
    calls.memcpy_async, calls.event_record, calls.event_query, calls.graph_launch = entries
    return calls


def bindings_calls() -> RuntimeCalls | None:
    """The calls through cuda-python's runtime bindings; None where they are not installed."""
    try:
        from cuda.bindings import runtime as rt  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except Exception:  # not installed (a CPU machine, an older CUDA stack)
        return None
    err, kind = rt.cudaError_t, rt.cudaMemcpyKind
    calls = RuntimeCalls(
        "cuda.bindings", ok=err.cudaSuccess, not_ready=err.cudaErrorNotReady, h2d=kind.cudaMemcpyHostToDevice,
        d2h=kind.cudaMemcpyDeviceToHost,
    )  # fmt: skip
    calls.memcpy_async = lambda dst, src, n, k, stream: rt.cudaMemcpyAsync(dst, src, n, k, stream)[0]
    calls.event_record = lambda event, stream: rt.cudaEventRecord(event, stream)[0]
    calls.event_query = lambda event: rt.cudaEventQuery(event)[0]
    calls.graph_launch = lambda graph, stream: rt.cudaGraphLaunch(graph, stream)[0]
    calls.exec_handle = lambda raw: rt.cudaGraphExec_t(init_value=raw)
    return calls


def device_index(device: torch.device) -> int:
    """The index of CUDA device ``device``: the current device's where it names none (``torch.device("cuda")``).
    torch's stubs type ``index`` as an int, so the compiled build's typed read of it refuses a None: callers in
    compiled modules go through here."""
    index: int | None = device.index
    return torch.cuda.current_device() if index is None else index


class CudaCalls:
    """The calls for one device; ``bindings=False`` takes torch's path wherever a direct one exists, ``runtime``
    names one direct path (``"cudart"``, ``"bindings"``) instead of the first found."""

    def __init__(self, device_index: int, *, bindings: bool = True, runtime: str | None = None) -> None:
        self.device_index = device_index
        found = {"cudart": cudart_calls, "bindings": bindings_calls}
        self._rt: RuntimeCalls | None = None
        if bindings:
            for name in (runtime,) if runtime is not None else tuple(found):
                self._rt = found[name]()
                if self._rt is not None:
                    break
        self._raw_stream: Callable[[int], int] = torch._C._cuda_getCurrentRawStream

    @property
    def through_bindings(self) -> bool:
        """Whether the calls go straight to the runtime (through ``ctypes`` or cuda-python), not through torch."""
        return self._rt is not None

    @property
    def path(self) -> str:
        return "torch" if self._rt is None else self._rt.name

    def download(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        """Copies of ``src`` (a CUDA tensor) into ``dst`` (pinned host memory of the same size).  Both tensors
        must outlive it."""
        if dst.nbytes != src.nbytes or not dst.is_pinned() or src.device.type != "cuda":
            raise ValueError("download: dst must be pinned host memory of src's size, src a CUDA tensor")
        return Transfer(self, dst, src, self._rt.d2h if self._rt is not None else None)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        """Copies of the first bytes of ``src`` (pinned host bytes) into ``dst`` (a CUDA byte tensor of the same
        size).  Both tensors must outlive it."""
        if dst.nbytes != src.nbytes or not src.is_pinned() or dst.device.type != "cuda" or dst.element_size() != 1:
            raise ValueError("upload: src must be pinned host bytes of dst's size, dst a CUDA byte tensor")
        return Transfer(self, dst, src, self._rt.h2d if self._rt is not None else None)

    def graph_launch(self, graph: Any) -> Callable[[], None]:
        """A launch of ``graph`` (a captured ``torch.cuda.CUDAGraph``, kept alive by the caller) on the current
        stream.  Straight to the runtime where it can: torch's replay also guards the device, brings the random
        number generators' state up to date and asks the driver its version on every call, none of which a graph
        of the canary's kernels (no random numbers) needs."""
        raw = getattr(graph, "raw_cuda_graph_exec", None)
        if self._rt is None or raw is None:
            return graph.replay  # type: ignore[no-any-return]
        return functools.partial(self._launch, self._rt.exec_handle(raw()))

    def _launch(self, graph_exec: Any) -> None:
        rt = self._rt
        assert rt is not None
        err = rt.graph_launch(graph_exec, self._raw_stream(self.device_index))
        if err != rt.ok:
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
        err = rt.memcpy_async(dst, src, nbytes, kind, calls._raw_stream(calls.device_index))
        if err != rt.ok:
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
        err = rt.memcpy_async(dst, src, nbytes, kind, stream)
        if err == rt.ok:
            err = rt.event_record(self._handle, stream)
        if err != rt.ok:
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
        err = rt.event_query(self._handle)
        if err == rt.ok:
            return True
        if err == rt.not_ready:
            return False
        raise RuntimeError(f"kvcanary: cudaEventQuery failed: {err!r}")

    def wait(self) -> None:
        if self._untracked:
            raise RuntimeError("wait: the last copy was made with copy(), which records no event")
        if self.sent:
            self._event.synchronize()

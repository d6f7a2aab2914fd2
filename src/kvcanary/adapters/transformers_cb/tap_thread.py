"""The step tap on a thread of its own, optionally pinned to a CPU, while the engine's thread waits for it.

The engine's own work runs longer with the canary on than the canary's timed work accounts for: on the GPU demo
the steps grew by about as much again as the tap's host time.  Part of that is the engine's Python running with
the CPU caches the tap left (an engine step measured 86 us slower right after a few hundred microseconds of other
Python on its core).  Here the tap runs on a worker thread, pinned to ``cpu`` where given, so its Python runs on
another core's caches; the engine's thread hands each step over and blocks (the GIL released) until the tap
returns, so the order of everything the two threads enqueue is the order of the inline tap.  The handover costs
two thread wake-ups a step.

What the tap inherits from the engine's thread is handed over with each step: the current CUDA device and stream
(the tap enqueues behind the forward on it), and the grad and inference modes.  An exception the tap raises is
raised again on the engine's thread (raise mode).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

_STOP = None  # handed to the worker to end it


class TapThread:
    """A worker thread that runs one call at a time for a waiting caller (see the module docstring).  Started on the
    first call; :meth:`close` ends it."""

    def __init__(self, cpu: int | None = None) -> None:
        self.cpu = check_cpu(cpu)
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._cuda = torch.cuda.is_available()

    def run(self, call: Callable[..., None], *args: Any) -> None:
        """``call(*args)`` on the worker, with this thread's device, stream and autograd modes; returns when it
        did, raising what it raised."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._serve, name="kvcanary-tap", daemon=True)
            self._worker.start()
        c = torch._C
        stream = None
        if self._cuda and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            stream = c._cuda_getCurrentStream(c._cuda_getDevice())
        self._calls.put((call, args, stream, c.is_grad_enabled(), torch.is_inference_mode_enabled()))
        error = self._done.get()
        if error is not None:
            raise error

    def close(self) -> None:
        """End the worker (it finishes the call it runs, if any)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            self._calls.put(_STOP)
            worker.join(timeout=5)

    def _serve(self) -> None:
        if self.cpu is not None:
            os.sched_setaffinity(0, {self.cpu})  # this thread only (0: the calling thread)
        while True:
            item = self._calls.get()
            if item is _STOP:
                return
            call, args, stream, grad, inference = item
            try:
                _on_stream(stream)
                guard = torch._C._InferenceMode(inference)  # sets the grad mode too: set it after
                torch._C._set_grad_enabled(grad)
                try:
                    call(*args)
                finally:
                    del guard
                self._done.put(None)
            except BaseException as exc:  # handed to the waiting engine thread, raised there
                self._done.put(exc)


def check_cpu(cpu: object) -> int | None:
    """``cpu`` as the CPU to pin the tap thread to (None: not pinned); a ValueError naming the problem for one this
    process may not run on."""
    if cpu is None:
        return None
    if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
        raise ValueError(f"the tap thread's cpu must be a CPU number (an int >= 0) or None, got {cpu!r}")
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if not hasattr(os, "sched_setaffinity") or (allowed is not None and cpu not in allowed):
        raise ValueError(f"CPU {cpu} is not one this process may run on ({sorted(allowed or ())})")
    return cpu


def _on_stream(stream: tuple[int, int, int] | None) -> None:
    """Make ``stream`` (stream id, device index, device type, as torch's C entry point reads it) current here."""
    if stream is None:
        return
    c = torch._C
    if c._cuda_getDevice() != stream[1]:
        torch.cuda.set_device(stream[1])
    if c._cuda_getCurrentStream(stream[1])[0] != stream[0]:
        c._cuda_setStream(stream_id=stream[0], device_index=stream[1], device_type=stream[2])

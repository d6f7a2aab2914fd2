"""Run the step tap on a thread of its own, while the engine's thread waits for it.

The tap's host time is mostly the cost of running its code with the CPU caches cold: between two taps the engine's
own Python (a step of it is milliseconds) runs on the same core and evicts the tap's code and data, and the tap in
turn leaves the engine's next Python cold (a GPU probe measured an engine step 86 us slower after a stretch of other
Python than after none).  Handed to a thread that runs nothing else, the tap runs where its own code stayed, and the
engine's core keeps the engine's.  The hand-off is synchronous: the engine's thread sleeps on a lock (releasing the
interpreter lock) until the tap is done, so the two never contend for the interpreter and the tap sees the step
exactly where it would have run inline.  What torch keeps per thread is carried over: the CUDA device and stream
that were current on the engine's thread, and its inference mode (the tap's tensors were made under it).  An
exception of the tap is raised again on the engine's thread.  On by default where the model is on CUDA
(``install(tap_thread=...)``); on the CPU the tap's own compute dominates and it stays inline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class TapThread:
    """A thread that runs one call at a time for the caller, who waits for it (see the module docstring)."""

    def __init__(self) -> None:
        self._go = threading.Lock()
        self._done = threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job: tuple[Callable[..., Any], tuple[Any, ...], tuple[int, int, int] | None] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._inference = False  # the inference mode the thread runs under (the first caller's)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on the thread (started by the first call), the caller waiting; inline where the caller's
        inference mode is not the thread's."""
        inference = torch.is_inference_mode_enabled()
        if self._thread is None:
            self._start(inference)
        if inference != self._inference:
            fn(*args)
            return
        c = torch._C
        stream = c._cuda_getCurrentStream(c._cuda_getDevice()) if _cuda_in_use() else None
        self._job = (fn, args, stream)
        self._go.release()
        self._done.acquire()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _start(self, inference: bool) -> None:
        self._inference = inference
        device = torch.cuda.current_device() if _cuda_in_use() else None
        self._thread = threading.Thread(target=self._loop, args=(device,), name="kvcanary-tap", daemon=True)
        self._thread.start()

    def _loop(self, device: int | None) -> None:
        c = torch._C
        if device is not None:
            torch.cuda.set_device(device)
        with torch.inference_mode(self._inference):
            while True:
                self._go.acquire()
                job = self._job
                if job is None:  # closed
                    return
                fn, args, stream = job
                try:
                    if stream is not None:
                        c._cuda_setStream(stream_id=stream[0], device_index=stream[1], device_type=stream[2])
                    fn(*args)
                except BaseException as exc:  # raised again on the caller's thread
                    self._error = exc
                finally:
                    self._job = None
                    self._done.release()

    def close(self) -> None:
        """Stop the thread (a later call starts another); idempotent."""
        if self._thread is not None:
            self._job = None
            self._go.release()
            self._thread.join()
            self._thread = None


def _cuda_in_use() -> bool:
    """Whether this process initialised CUDA (asking for a device or stream otherwise would initialise it)."""
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]

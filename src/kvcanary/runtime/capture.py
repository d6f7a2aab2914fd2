"""Whether the current call is being captured into a CUDA graph (the manager and the adapters ask)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def is_capturing(device: torch.device) -> bool:
    """True while the current CUDA stream of a CUDA ``device`` is capturing a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def stream_capturing_probe() -> Callable[[], bool]:
    """The cheapest ``is_current_stream_capturing``: the C entry point skips the Python wrapper's checks
    (a host step counts microseconds)."""
    probe: Callable[[], bool] = getattr(
        torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing
    )
    return probe

"""Work-around: CPU offloading on a host without an accelerator (transformers 5.24.0).

``OffloadingManager.__init__`` allocates its CPU swap pool with ``torch.empty(..., pin_memory=True)``;
on a CPU-only host there is no pinned-memory allocator and it raises
``RuntimeError: pin_memory=True requires a CUDA or other accelerator backend``, so
``ContinuousBatchingConfig(cpu_offload_space=...)`` cannot be used at all there.  Pinning only speeds
up host<->device copies, which a CPU-only run does not make, so while the adapter is installed (and
``unpinned_cpu_offload=True``, the default) the constructor runs with a ``torch`` whose ``empty``
ignores ``pin_memory`` -- only on hosts without an accelerator, only inside that constructor.
Nothing changes on a GPU host.  Without kvcanary, the same effect needs this patch by hand or
offloading left off (``cpu_offload_space=0``, transformers' default).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch


def accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return bool(torch.cuda.is_available())


def _empty_unpinned(*args: Any, **kwargs: Any) -> torch.Tensor:
    kwargs.pop("pin_memory", None)
    return torch.empty(*args, **kwargs)


class _UnpinnedTorch(types.ModuleType):
    """``torch`` with an ``empty`` that never pins; every other attribute is torch's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def unpinned_torch() -> types.ModuleType:
    shim = _UnpinnedTorch("torch")
    shim.empty = _empty_unpinned  # type: ignore[attr-defined]
    return shim


def wrap_offloading_init(original: Callable[..., None], module: types.ModuleType) -> Callable[..., None]:
    """``OffloadingManager.__init__`` that allocates its pool unpinned when no accelerator exists."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if accelerator_available():
            original(self, *args, **kwargs)
            return
        real = getattr(module, "torch")  # noqa: B009 -- the engine module's global, swapped for this call only
        setattr(module, "torch", unpinned_torch())  # noqa: B010
        try:
            original(self, *args, **kwargs)
        finally:
            setattr(module, "torch", real)  # noqa: B010

    return __init__

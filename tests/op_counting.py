"""Counting what a step costs on the host: torch ops through a dispatch mode, and the manager's validations,
state checks and kernel launches through counting stand-ins (``count_step_work``, the ``counted`` fixture)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvcanary import batch as batch_module
from kvcanary import canary as canary_module
from kvcanary.ops import launchers

# Ops that launch no device kernel (views, metadata, CPU scalars wrapped for torch.where).
NO_KERNEL = {"slice", "view", "detach", "alias", "reshape", "_unsafe_view", "unsqueeze", "select", "scalar_tensor"}
# Ops that read a device value on the host or build a tensor from Python data (a blocking copy on GPU).
SYNCING = {"_local_scalar_dense", "item", "lift_fresh", "nonzero", "is_nonzero", "tolist"}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class CountingKernel:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` only counts the launch."""

    def __init__(self, name: str, launches: collections.Counter[str]) -> None:
        self.name = name
        self.launches = launches

    def __getitem__(self, grid: object) -> Any:
        def launch(*args: object, **kwargs: object) -> None:
            self.launches[self.name] += 1

        return launch


def count_step_work(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Counts of validate_batch calls, launcher state checks and kernel launches."""
    counts: collections.Counter[str] = collections.Counter()
    real_validate = batch_module.validate_batch
    real_state = launchers._check_state

    def validate(*args: Any, **kwargs: Any) -> None:
        counts["validate_batch"] += 1
        real_validate(*args, **kwargs)

    def check_state(*args: Any, **kwargs: Any) -> torch.device:
        counts["check_state"] += 1
        return real_state(*args, **kwargs)

    for module in (canary_module, launchers):
        monkeypatch.setattr(module, "validate_batch", validate)
    monkeypatch.setattr(launchers, "_check_state", check_state)
    for name in ("plan_kernel", "verify_kernel", "stamp_kernel"):
        monkeypatch.setattr(launchers, name, CountingKernel(name, counts))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors on the kernel path (the stand-ins run nothing)
    return counts

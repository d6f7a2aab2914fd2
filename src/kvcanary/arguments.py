"""Argument checks shared by the public constructors: exact types and affordable sizes.

A float where a count belongs (``max_batch=2.5``), a string where an enum belongs, or an int where a
tuple belongs would otherwise pass the range checks and fail far away (or allocate something absurd);
each check names the argument and what it got.
"""

from __future__ import annotations

import enum
import os
from typing import Any

import torch


def require_int(name: str, value: object) -> int:
    """``value`` must be a real int (not a bool, not a float that happens to be whole)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def require_enum(name: str, value: object, cls: type[enum.Enum]) -> None:
    if not isinstance(value, cls):
        choices = ", ".join(f"{cls.__name__}.{m.name}" for m in cls)
        raise TypeError(f"{name} must be a {cls.__module__}.{cls.__name__} ({choices}), got {value!r}")


def require_int_tuple(name: str, value: object) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{name} must be a tuple of ints (e.g. (0,) or ()), got {value!r}")


def _memory_of(device: torch.device) -> int | None:
    """Bytes the device can hold at most (free memory on CUDA, physical memory on the CPU), if known."""
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError):
            return None
    return None


def require_affordable(what: str, nbytes: int, device: torch.device | str, **detail: Any) -> None:
    """Refuse an allocation larger than the device can hold, saying what it would cost, before trying it."""
    dev = torch.device(device)
    limit = _memory_of(dev)
    if limit is not None and nbytes > limit:
        extra = ", ".join(f"{k}={v}" for k, v in detail.items())
        raise MemoryError(
            f"{what} would need {nbytes / 2**30:.2f} GiB on {dev} ({extra}), more than its "
            f"{limit / 2**30:.2f} GiB {'free' if dev.type == 'cuda' else 'of memory'}"
        )

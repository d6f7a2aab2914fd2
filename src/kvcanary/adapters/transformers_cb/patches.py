"""Reversible method patches on engine classes.

Each wrapper carries the function it replaced, so a second kvcanary install on the same classes is
refused instead of silently stacking, and :meth:`PatchSet.restore` puts every original back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("kvcanary")

_ORIGINAL = "__kvcanary_original__"


class AlreadyPatched(RuntimeError):
    """Another kvcanary adapter is installed on the same engine classes."""


class PatchSet:
    def __init__(self) -> None:
        self._applied: list[tuple[type, str, Any, bool, Any]] = []

    def wrap(self, owner: type, name: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.name`` with ``make(original)``."""
        own = name in owner.__dict__
        original = owner.__dict__[name] if own else getattr(owner, name)
        if getattr(original, _ORIGINAL, None) is not None:
            raise AlreadyPatched(
                f"{owner.__qualname__}.{name} is already patched by a kvcanary adapter; uninstall that one first"
            )
        wrapper = make(original)
        setattr(wrapper, _ORIGINAL, original)
        setattr(owner, name, wrapper)
        self._applied.append((owner, name, original, own, wrapper))

    def restore(self) -> None:
        """Undo every patch, last first; safe to call twice."""
        while self._applied:
            owner, name, original, own, wrapper = self._applied.pop()
            if owner.__dict__.get(name) is not wrapper:
                logger.warning("kvcanary: %s.%s was re-patched by someone else; restoring it anyway", owner, name)
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

    def __len__(self) -> int:
        return len(self._applied)

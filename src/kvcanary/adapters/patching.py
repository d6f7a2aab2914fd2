"""Reversible attribute patches on engine classes and objects: the one patch/restore mechanism.

Every adapter and every fault replaces engine methods through a :class:`PatchSet`: ``wrap`` replaces
``owner.name`` with ``make(original)`` and remembers what was there, ``restore`` puts it back (last
patch first).  An *exclusive* set (an adapter patching engine classes) marks each wrapper with the
function it replaced, so a second kvcanary install on the same classes is refused instead of silently
stacking.  A non-exclusive set (a fault wrapping one engine object inside an installed adapter) wraps
whatever is there, the adapter's wrappers included.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("kvcanary")

_ORIGINAL = "__kvcanary_original__"

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]  # make(original) -> replacement


class AlreadyPatched(RuntimeError):
    """Another kvcanary adapter is installed on the same engine classes."""


class PatchSet:
    """The patches one adapter install (or one fault run) made, undone together by :meth:`restore`."""

    def __init__(self, *, exclusive: bool = True) -> None:
        self._exclusive = exclusive
        self._applied: list[tuple[Any, str, Any, bool, Any]] = []

    def wrap(self, owner: Any, name: str, make: Wrapper) -> None:
        """Replace ``owner.name`` (a class or an object) with ``make(original)``.

        ``original`` is the owner's own attribute when it has one, else what attribute lookup finds
        (an inherited function, or a bound method for an object).
        """
        own = name in vars(owner)
        original = vars(owner)[name] if own else getattr(owner, name)
        if self._exclusive and getattr(original, _ORIGINAL, None) is not None:
            raise AlreadyPatched(
                f"{_label(owner)}.{name} is already patched by a kvcanary adapter; uninstall that one first"
            )
        wrapper = make(original)
        if self._exclusive:
            with contextlib.suppress(AttributeError):  # a wrapper that takes no attributes is simply unmarked
                setattr(wrapper, _ORIGINAL, original)
        setattr(owner, name, wrapper)
        self._applied.append((owner, name, original, own, wrapper))

    def restore(self) -> None:
        """Undo every patch, last first; safe to call twice."""
        while self._applied:
            owner, name, original, own, wrapper = self._applied.pop()
            if vars(owner).get(name) is not wrapper:
                logger.warning(
                    "kvcanary: %s.%s was re-patched by someone else; restoring it anyway", _label(owner), name
                )
            if own:
                setattr(owner, name, original)
            elif name in vars(owner):
                delattr(owner, name)

    def __len__(self) -> int:
        return len(self._applied)


def _label(owner: Any) -> str:
    return owner.__qualname__ if isinstance(owner, type) else f"{type(owner).__qualname__} object"

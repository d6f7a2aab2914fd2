"""What every engine adapter offers, and a lazy registry of the adapters kvcanary ships.

An adapter is installed on a live engine object with one call (the adapter module's ``install``) and
returns an :class:`EngineAdapter` handle; :meth:`EngineAdapter.uninstall` restores everything it patched.
The registry maps a name to ``"module:function"`` so that no engine is imported until it is asked for.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable


class UnsupportedEngineVersion(RuntimeError):
    """The installed engine is a version this adapter was not validated against."""


@runtime_checkable
class EngineAdapter(Protocol):
    """Handle of an installed adapter."""

    def uninstall(self) -> None:
        """Remove every hook and restore every patched function; safe to call twice."""

    def stats(self) -> dict[str, int]:
        """Counters of the canary (steps, verified slots, violations, ...)."""

    def features(self) -> dict[str, int]:
        """Counters of the engine features the canary saw (prefix hits, forks, offloads, ...)."""


# name -> "module:function"; the function installs the adapter and returns an EngineAdapter.
ADAPTERS: Mapping[str, str] = types.MappingProxyType(
    {
        "sglang": "kvcanary.adapters.sglang:install_canary",
        "transformers-cb": "kvcanary.adapters.transformers_cb:install",
        "vllm": "kvcanary.adapters.vllm:install",
    },
)


def load_adapter(name: str) -> Callable[..., Any]:
    """Import the named adapter's ``install`` function; the engine is imported only now."""
    if not isinstance(name, str):
        raise TypeError(f"adapter name must be a str, got {type(name).__name__}")
    target = ADAPTERS.get(name)
    if target is None:
        raise ValueError(f"unknown adapter {name!r}; choose one of: {', '.join(sorted(ADAPTERS))}")
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    install: Callable[..., Any] = getattr(module, attr)
    return install

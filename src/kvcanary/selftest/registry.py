"""Which engines have a self-test, found lazily: ``kvcanary selftest --engine NAME`` imports only NAME's.

An engine's self-test lives with its adapter, in ``kvcanary.adapters.<package>.selftest``, and exposes
``driver() -> EngineDriver`` (:mod:`kvcanary.selftest.protocol`).  Adding an engine: one line here.
"""

from __future__ import annotations

import importlib
import types

from kvcanary.selftest.protocol import EngineDriver, EngineUnavailable

ENGINES: types.MappingProxyType[str, str] = types.MappingProxyType(
    {
        "transformers": "kvcanary.adapters.transformers_cb.selftest",
        "sglang": "kvcanary.adapters.sglang.selftest",
        "vllm": "kvcanary.adapters.vllm.selftest",
    }
)
DEFAULT_ENGINE = "transformers"


def load_driver(engine: str) -> EngineDriver:
    """The engine's self-test driver; :class:`EngineUnavailable` naming the reason when it cannot be loaded
    (no self-test for that engine in this install, or the engine itself missing)."""
    module_name = ENGINES.get(engine)
    if module_name is None:
        raise ValueError(f"unknown engine {engine!r}; choose from: {', '.join(ENGINES)}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise EngineUnavailable(f"no self-test for engine {engine!r} in this install ({module_name})") from exc
        raise EngineUnavailable(f"the {engine} self-test cannot be imported: {exc}") from exc
    except ImportError as exc:
        raise EngineUnavailable(f"the {engine} self-test cannot be imported: {exc}") from exc
    make = getattr(module, "driver", None)
    if not callable(make):
        raise EngineUnavailable(f"{module_name} has no driver() function")
    driver: EngineDriver = make()
    return driver

"""Engine adapters: translate an engine's per-step KV indices into kvcanary's canonical batch.

Importing this package imports no engine; :func:`load_adapter` imports one on demand.
"""

from kvcanary.adapters.base import ADAPTERS, EngineAdapter, UnsupportedEngineVersion, load_adapter

__all__ = ["ADAPTERS", "EngineAdapter", "UnsupportedEngineVersion", "load_adapter"]

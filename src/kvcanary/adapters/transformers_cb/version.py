"""Which transformers releases the adapter was validated against.

The adapter patches private methods of transformers' continuous batching (``ModelRunner.compute_batch``,
``CacheAllocator.copy_blocks``, ``OffloadingManager._offload_to_cpu`` ...), whose names and semantics
change between releases, so it refuses any version it was not tested with.
"""

from __future__ import annotations

from kvcanary.adapters.base import UnsupportedEngineVersion

SUPPORTED_VERSIONS: tuple[str, ...] = ("5.24.0",)


def installed_version() -> str:
    import transformers

    return str(transformers.__version__)


def check_version(version: str | None = None, *, allow_untested: bool = False) -> str:
    """Return the transformers version, or raise :class:`UnsupportedEngineVersion` if it is not supported."""
    found = installed_version() if version is None else version
    if found not in SUPPORTED_VERSIONS and not allow_untested:
        supported = ", ".join(SUPPORTED_VERSIONS)
        raise UnsupportedEngineVersion(
            f"kvcanary's transformers adapter supports transformers {supported}, but {found} is installed. "
            f"Install a supported version (pip install 'kvcanary[transformers]'), or pass "
            f"allow_untested_version=True to try anyway (the adapter patches private engine methods)."
        )
    return found

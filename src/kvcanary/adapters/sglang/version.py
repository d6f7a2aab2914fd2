"""Which sglang releases the adapter was validated against, and the guard that enforces it.

The adapter reads sglang's private objects (``ModelRunner`` pools, ``ForwardBatch`` fields per forward
mode, the SWA pool's ``full_to_swa_index_mapping``), whose names and semantics change between releases,
so :func:`~kvcanary.adapters.sglang.install_canary` refuses a version it was not tested with.
"""

from __future__ import annotations

import importlib.metadata

from kvcanary.adapters.base import UnsupportedEngineVersion

SUPPORTED_SGLANG_VERSIONS: tuple[str, ...] = ("0.5.23",)


def installed_version() -> str | None:
    """The installed sglang distribution's version, None when there is none."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version(version: str | None = None, *, allow_untested: bool = False) -> str:
    """Return the sglang version, or raise :class:`UnsupportedEngineVersion` when it is not supported."""
    found = installed_version() if version is None else version
    if found is None:
        raise UnsupportedEngineVersion(
            "kvcanary's sglang adapter found no installed sglang distribution (importlib.metadata); install "
            f"sglang {', '.join(SUPPORTED_SGLANG_VERSIONS)}"
        )
    if found not in SUPPORTED_SGLANG_VERSIONS and not allow_untested:
        raise UnsupportedEngineVersion(
            f"kvcanary's sglang adapter supports sglang {', '.join(SUPPORTED_SGLANG_VERSIONS)}, but {found} is "
            "installed. Install a supported version, or pass install_canary(..., allow_untested_version=True) "
            "to try anyway (the adapter reads sglang's private pool and ForwardBatch fields)."
        )
    return found

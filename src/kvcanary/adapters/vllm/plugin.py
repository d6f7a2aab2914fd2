"""vLLM general plugin (entry point ``kvcanary`` in group ``vllm.general_plugins``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers) before it builds
engines.  With ``KVCANARY_MODE`` unset or ``off`` it does nothing.  Otherwise it checks the mode and the
vLLM version (a bad value stops start-up with one message), then wraps ``GPUModelRunner.initialize_kv_cache``
so that every runner gets a canary as soon as its KV cache exists (an unknown KV layout stops start-up there,
before the runner is patched), and, for ``fail-request``, ``Scheduler.update_from_output``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from kvcanary.adapters.patching import PatchSet
from kvcanary.adapters.vllm.options import VllmCanaryOptions, options_from_env
from kvcanary.adapters.vllm.version import check_version
from kvcanary.config import Mode

logger = logging.getLogger("kvcanary")


def register() -> None:
    options = options_from_env(os.environ)
    if not options.enabled:
        return
    check_version()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.initialize_kv_cache, "__kvcanary_original__", None) is not None:
        return  # registered already in this process
    patches = PatchSet(exclusive=True)
    patches.wrap(GPUModelRunner, "initialize_kv_cache", _installing(options))
    if options.config.mode is Mode.FAIL_REQUEST:
        from kvcanary.adapters.vllm.attach import scheduler_patches

        scheduler_patches()
    logger.info("kvcanary: vLLM plugin registered (mode=%s)", options.config.mode.value)


def _installing(options: VllmCanaryOptions) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def initialize_kv_cache(runner: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(runner, kv_cache_config, *args, **kwargs)
            profiling = kwargs.get("is_profiling", args[0] if args else False)
            if not profiling and getattr(runner, "kvcanary", None) is None:
                from kvcanary.adapters.vllm.hooks import VllmCanary

                canary = VllmCanary(runner, options)
                canary.patch()
                logger.info(
                    "kvcanary: canary installed on %s (mode=%s)", type(runner).__name__, options.config.mode.value
                )
            return out

        return initialize_kv_cache

    return make

"""One call: ``install(llm)`` puts the canary on a running vLLM engine (in-process engine core).

``target`` may be an ``LLM``, an ``LLMEngine``, an ``EngineCore`` or the model runner itself; the engine core
must live in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); otherwise use the plugin
(:mod:`.plugin`), which installs the canary inside the engine core process.  Everything is validated
(version, mode, runner class, KV layout) before anything is patched.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvcanary.adapters.patching import PatchSet
from kvcanary.adapters.vllm import failing
from kvcanary.adapters.vllm.hooks import VllmCanary
from kvcanary.adapters.vllm.options import VllmCanaryOptions, options_from_env
from kvcanary.adapters.vllm.version import check_version
from kvcanary.config import CanaryConfig, Mode
from kvcanary.runtime import FailRequestCallback

logger = logging.getLogger("kvcanary")

# LLM -> LLMEngine -> InprocClient -> EngineCore -> executor -> worker wrapper -> worker -> model runner
_PATH = ("llm_engine", "engine_core", "engine_core", "model_executor", "driver_worker", "worker", "model_runner")


def find_runner(target: Any) -> Any:
    """The V1 model runner behind ``target`` (walks vLLM's in-process object chain)."""
    obj = target
    for attr in _PATH:
        if hasattr(obj, "execute_model") and hasattr(obj, "_update_states"):
            return obj
        nxt = getattr(obj, attr, None)
        if nxt is not None:
            obj = nxt
    if hasattr(obj, "execute_model") and hasattr(obj, "_update_states"):
        return obj
    raise TypeError(
        f"kvcanary: no in-process vLLM model runner behind {type(target).__name__}; run the engine core in this "
        "process (VLLM_ENABLE_V1_MULTIPROCESSING=0) or enable the canary with KVCANARY_MODE (the vLLM plugin)"
    )


def resolve_options(options: VllmCanaryOptions | CanaryConfig | str | None) -> VllmCanaryOptions:
    if options is None:
        return options_from_env(os.environ)
    if isinstance(options, VllmCanaryOptions):
        return options
    if isinstance(options, CanaryConfig):
        return VllmCanaryOptions(config=options)
    if isinstance(options, str):
        return VllmCanaryOptions(config=CanaryConfig.from_mode_name(options))
    raise TypeError(f"options must be VllmCanaryOptions, CanaryConfig, a mode name or None, got {options!r}")


def scheduler_patches() -> PatchSet | None:
    """Patch ``Scheduler.update_from_output`` for fail-request, unless the plugin (or an install) already did."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.update_from_output, "__kvcanary_original__", None) is not None:
        return None
    patches = PatchSet(exclusive=True)
    patches.wrap(Scheduler, "update_from_output", failing.wrap_update_from_output)
    return patches


class _Installed(VllmCanary):
    """A canary that also owns the scheduler patch it made (restored by uninstall)."""

    scheduler_patch: PatchSet | None = None

    def uninstall(self) -> None:
        super().uninstall()
        if self.scheduler_patch is not None:
            self.scheduler_patch.restore()
            self.scheduler_patch = None


def install(
    target: Any,
    options: VllmCanaryOptions | CanaryConfig | str | None = None,
    *,
    on_fail_request: FailRequestCallback | None = None,
) -> VllmCanary | None:
    """Install the canary on ``target``'s model runner; None when the mode is off."""
    opts = resolve_options(options)
    if not opts.enabled:
        return None
    check_version()
    runner = find_runner(target)
    if getattr(runner, "kvcanary", None) is not None:
        raise RuntimeError("kvcanary: a canary is already installed on this model runner; uninstall it first")
    canary = _Installed(runner, opts, on_fail_request=on_fail_request)  # validates before any patch
    try:
        if opts.config.mode is Mode.FAIL_REQUEST:
            canary.scheduler_patch = scheduler_patches()
        canary.patch()
    except BaseException:
        canary.uninstall()
        raise
    logger.info(
        "kvcanary: installed on %s: mode=%s groups=%s",
        type(runner).__name__, opts.config.mode.value, [(g.canary.name, g.canary.kind.value) for g in canary.groups],
    )  # fmt: skip
    return canary

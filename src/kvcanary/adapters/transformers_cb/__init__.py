"""kvcanary adapter for HF transformers continuous batching (``generate_batch``, ``ContinuousBatchingManager``).

Usage::

    from kvcanary.adapters.transformers_cb import install
    canary = install(model, CanaryConfig(mode=Mode.LOG))
    out = model.generate_batch(prompts, generation_config=..., continuous_batching_config=...)
    canary.flush(); print(canary.stats(), canary.features())
    canary.uninstall()

Supported transformers versions: :data:`SUPPORTED_VERSIONS`.  How the engine's indices map onto the
canary: :mod:`.translate` and :mod:`.geometry` (the host-side plan of a step: :mod:`.step_plan`, sent to
the device in one copy by :mod:`.staging`); the hooks: :mod:`.adapter`; CPU offloading on a host
without an accelerator: :mod:`.cpu_offload`.
"""

from kvcanary.adapters.transformers_cb.adapter import TransformersCBAdapter, install
from kvcanary.adapters.transformers_cb.version import SUPPORTED_VERSIONS, check_version

__all__ = ["SUPPORTED_VERSIONS", "TransformersCBAdapter", "check_version", "install"]

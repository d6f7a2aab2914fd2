"""Where a fault context meets the transformers engine, for the self-test's runs and for the demo.

:class:`FaultHooks` binds the context to the engine's batch processor at its first batch, installs the
faults (then the read oracle, when one is given) on its objects, and runs the context's forward and
after-update hooks in place.  :func:`attach_fault` injects one library fault into an installed adapter's
runs, once, at its first opportunity at or after a step: what the demo and the engine tests use.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from kvcanary.adapters.patching import PatchSet
from kvcanary.adapters.transformers_cb.adapter import TransformersCBAdapter
from kvcanary.adapters.transformers_cb.selftest.catalogue import FAULTS
from kvcanary.adapters.transformers_cb.selftest.context import SLIDING, FaultContext, TransformersFault
from kvcanary.adapters.transformers_cb.selftest.workload import PAGE_SIZE
from kvcanary.selftest.protocol import Injection, InjectMode
from kvcanary.selftest.read_oracle import ReadOracle


def attach_fault(adapter: TransformersCBAdapter, name: str, *, after_step: int = 0, seed: int = 0) -> FaultHooks:
    """Inject library fault ``name`` once into the runs of ``adapter``, at its first opportunity at or after
    canary step ``after_step``; ``detach()`` (or leave the ``with`` block) before uninstalling the adapter."""
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; choose one of: {', '.join(FAULTS)}")
    if after_step < 0:
        raise ValueError(f"after_step must be >= 0, got {after_step}")
    rng = random.Random(f"{seed}:{name}")
    ctx = FaultContext(adapter, InjectMode.INJECT, rng=rng, target=(name, after_step), page_size=PAGE_SIZE)
    hooks = FaultHooks(ctx, [FAULTS[name]()], oracle=None)
    hooks.attach()
    return hooks


class FaultHooks:
    """Where a fault context meets the engine: its objects are bound at the processor's first batch, the
    faults (then the oracle, when given) installed on them, forward and after-update hooks run in place."""

    def __init__(self, ctx: FaultContext, faults: Sequence[TransformersFault], oracle: ReadOracle | None) -> None:
        self.ctx = ctx
        self.faults = faults
        self.oracle = oracle
        self._classes = PatchSet(exclusive=False)  # around the adapter's own patches (fail-request wraps update_batch)

    @property
    def injection(self) -> Injection | None:
        return self.ctx.injection

    def __enter__(self) -> FaultHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def attach(self) -> None:
        from transformers.generation.continuous_batching import continuous_api

        ctx = self.ctx
        processor = continuous_api.ContinuousBatchProcessor
        self._classes.wrap(processor, "prepare_next_batch", self._bind_on_prepare)
        self._classes.wrap(processor, "update_batch", self._after_update)

        def before_forward(kwargs: dict[str, Any]) -> None:
            if ctx.processor is not None and kwargs.get("cache") is ctx.cache and "write_index" in kwargs:
                ctx.run_forward_hooks(kwargs)

        ctx.adapter.set_input_probe(before_forward)  # the step's static input buffers, just before the forward

    def detach(self) -> None:
        """Undo everything :meth:`attach` and the faults did (the adapter stays installed)."""
        self.ctx.adapter.set_input_probe(None)
        self._classes.restore()
        self.ctx.patches.restore()

    def _bind_on_prepare(self, orig: Any) -> Any:
        ctx = self.ctx

        def prepare_next_batch(processor: Any, *args: Any, **kwargs: Any) -> Any:
            if ctx.processor is None:
                ctx.processor = processor
                for fault in self.faults:
                    fault.install(ctx)
                if self.oracle is not None:
                    _install_oracle(ctx, self.oracle)  # last: it must see what the faults made attention read
            return orig(processor, *args, **kwargs)

        return prepare_next_batch

    def _after_update(self, orig: Any) -> Any:
        ctx = self.ctx

        def update_batch(processor: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(processor, *args, **kwargs)
            if processor is ctx.processor:
                ctx.run_after_update_hooks()
            return out

        return update_batch


def _install_oracle(ctx: FaultContext, oracle: ReadOracle) -> None:
    for name, allocator in ctx.cache.cache_allocators.items():
        window = int(getattr(allocator, "sliding_window", 0) or 0) if name == SLIDING else 0

        def make(inner: Any, window: int = window) -> Any:
            def update(key_states: Any, value_states: Any, layer_idx: int, read_index: Any, write_index: Any) -> Any:
                out = inner(key_states, value_states, layer_idx, read_index, write_index)
                host = ctx.host
                if oracle.check_from is None and ctx.injection is not None:
                    oracle.check_from = ctx.injection.step
                if host is not None and not host.is_warmup:
                    ctx.guard(oracle.observe)(
                        ctx.step, host, layer_idx, window, key_states, value_states,
                        int(read_index.numel()) > 0, out[0], out[1],
                    )  # fmt: skip
                return out

            return update

        ctx.wrap(allocator, "update", make)

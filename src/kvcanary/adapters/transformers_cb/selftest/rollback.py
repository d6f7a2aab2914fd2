"""Draft tokens left in place after a speculative rollback -- the closest analogue in transformers.

transformers' continuous batching has no speculative decoding, so there is no draft to reject.  What a
rollback bug leaves behind is a request whose *committed token history* and *KV* disagree: the rejection
sampler replaced draft token d at position p by the target's token c, but the slot of p still holds the
KV computed for d, and every later token attends to it as if it were c's.  The fault produces exactly that
state in the engine: after a step, one committed token of a decoding request (already written to the
cache) is replaced in the request's history, its KV is left as it was.  (transformers' own rollback, the
one-token rewind of asynchronous batching when a request is offloaded mid-flight, is CUDA-only.)
"""

from __future__ import annotations

from kvcanary.adapters.transformers_cb.selftest.context import FaultContext, TransformersFault
from kvcanary.adapters.transformers_cb.selftest.specs import SPECS

_VOCAB = 1000  # the workload models' vocabulary


class RollbackKeepsDraft(TransformersFault):
    spec = SPECS["rollback-keeps-draft"]

    def install(self, ctx: FaultContext) -> None:
        def after_update() -> None:
            options = [
                state
                for rid, state in ctx.scheduler.active_requests.items()
                if len(state.generated_tokens) >= 2 and ctx.remaining(rid) >= 2 and not state.is_cpu_offloaded
            ]
            if options and ctx.take(self.name):
                state = ctx.rng.choice(options)
                old = int(state.generated_tokens[-2])  # the newest token already in the cache
                new = (old + ctx.rng.randrange(1, _VOCAB - 1)) % _VOCAB
                state.generated_tokens[-2] = new
                pos = len(state.initial_tokens) + len(state.generated_tokens) - 2
                ctx.injected(
                    f"history of {state.request_id!r} at position {pos}: {old} -> {new}, KV of {old} kept",
                    [state.request_id],
                )

        ctx.after_update(after_update)

"""Issue 10 item 2 on the real transformers engine: a step's own new tokens' read entries are checked in
that step (``new_read_mismatch``), not only from the next step on.

The probe redirects, in one decode step's ``read_index``, the entry attention reads for the new token of
one request to the slot of that request's position 0.  The engine's next step reads the right slots
again, so before the check existed the corruption was never reported at all.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from kvcanary import CanaryConfig, Mode
from kvcanary.adapters.transformers_cb import install
from kvcanary.demo import build_model, build_prompts, quiet_engine_logs

AFTER_STEP = 6


class NewReadRedirect:
    """Once, at the first decode step at or after ``AFTER_STEP``: the last entry of batch row 0's full-attention
    read segment (its new token, which a full group reads back from the slot it writes) -> its first entry."""

    def __init__(self, canary: Any) -> None:
        self.canary = canary
        self.step: int | None = None
        self.request_id: str | None = None

    def __call__(self, kwargs: dict[str, Any]) -> None:
        host = self.canary.pending_batch
        if self.step is not None or host is None or host.is_warmup or self.canary.next_step < AFTER_STEP:
            return
        if kwargs.get("block_table") is not None or host.query_lens[0] != 1 or host.past_lens[0] < 2:
            return
        names = list(kwargs["cache"].cache_allocators)
        gi = names.index("full_attention")
        read = kwargs["read_index"][gi]
        cu_k = kwargs["cu_seq_lens_k"]["full_attention"].tolist()
        read[cu_k[1] - 1] = read[cu_k[0]].clone()
        self.step, self.request_id = self.canary.next_step, host.request_ids[0]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_a_new_tokens_read_entry_sent_elsewhere_is_caught_at_its_own_step(kind: str) -> None:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = build_model(kind)
    gen = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=-1)  # type: ignore[no-untyped-call]
    cb = ContinuousBatchingConfig(page_size=8, num_blocks=48, max_batch_tokens=64, max_requests_per_batch=8)
    canary = install(model, CanaryConfig(mode=Mode.LOG))
    probe = NewReadRedirect(canary)
    canary.set_input_probe(probe)
    try:
        with quiet_engine_logs():
            model.generate_batch(build_prompts(6), generation_config=gen, continuous_batching_config=cb)
        canary.flush()
    finally:
        canary.uninstall()
    assert probe.step is not None, "the probe found no decode step to corrupt"
    assert canary.reports, f"the redirected new-token read was not reported: {canary.stats()}"
    first = canary.reports[0]
    assert first.step == probe.step
    assert probe.request_id in first.affected_request_ids
    reasons = {r for v in first.violations for r in v.reasons}
    assert "new_read_mismatch" in reasons, first.block()
    assert {v.group for v in first.violations} == {"full_attention"}

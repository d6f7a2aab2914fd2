"""raise and fail-request on the real engine (transformers continuous batching on CPU).

raise: the caller of ``generate_batch`` gets the CanaryViolation (the canary runs in the engine's thread,
whose exceptions transformers swallows).  fail-request: the corrupted request ends FAILED through the
engine, with no tokens returned, the others complete, and the callback names each request once.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch

from kvcanary import CanaryConfig, CanaryViolation, Mode, StepReport
from kvcanary.adapters.transformers_cb import install
from kvcanary.adapters.transformers_cb.selftest.hooks import attach_fault
from kvcanary.demo import build_model, build_prompts, quiet_engine_logs

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model("dense")


FAULT = "slot-mapping-foreign"  # corrupts what one request reads: only that request is affected


def generate(model: torch.nn.Module, n: int = 4) -> dict[str, object]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, num_return_sequences=1)
    cb = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=64, max_requests_per_batch=4)
    with quiet_engine_logs():
        out: dict[str, object] = model.generate_batch(
            build_prompts(n), generation_config=gen, continuous_batching_config=cb
        )
    return out


def test_raise_mode_raises_the_violation_to_the_caller_of_generate_batch(model: torch.nn.Module) -> None:
    with install(model, CanaryConfig(mode=Mode.RAISE)) as canary:
        assert all(getattr(o, "error", None) is None for o in generate(model).values())  # clean: no raise
        with attach_fault(canary, FAULT, after_step=3), pytest.raises(CanaryViolation) as caught:
            generate(model)
        assert caught.value.report.violations and canary.stats()["violations"] > 0


def test_fail_request_fails_the_request_in_the_engine_and_calls_back_once(model: torch.nn.Module) -> None:
    calls: list[list[object]] = []

    def on_fail(request_ids: list[object], report: StepReport) -> None:
        calls.append(list(request_ids))

    with install(model, CanaryConfig(mode=Mode.FAIL_REQUEST), on_fail_request=on_fail) as canary:
        clean = generate(model)
        assert not calls and all(getattr(o, "error", None) is None for o in clean.values())
        with attach_fault(canary, FAULT, after_step=3) as fault:
            outputs = generate(model)
        canary.flush()
    assert fault.injection is not None and len(fault.injection.requests) == 1
    victim = fault.injection.requests[0]
    reported = [rid for call in calls for rid in call]
    assert reported == [victim], calls  # once, for the corrupted request only
    failed = outputs[victim]
    assert getattr(failed, "error", None) and "kvcanary" in str(failed.error).lower()  # type: ignore[attr-defined]
    assert list(failed.generated_tokens) == []  # type: ignore[attr-defined]
    for rid, out in outputs.items():
        if rid != victim:
            assert out.error is None and len(out.generated_tokens) == NEW_TOKENS, rid  # type: ignore[attr-defined]

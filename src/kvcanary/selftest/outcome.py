"""The parts of a run's :class:`~kvcanary.selftest.protocol.RunOutcome` every driver fills the same way.

A driver knows its canary (counters, features, reports) and its engine's failures; what was injected, the
eligible steps and the read oracle's findings come from the engine-neutral :class:`Injector` and
:class:`ReadOracle`, so they are gathered here once, and so is the rule of when a faulted run may stop.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvcanary.runtime import StepReport
from kvcanary.selftest.protocol import Injector, RunOutcome
from kvcanary.selftest.read_oracle import GRACE_STEPS, ReadOracle


def run_outcome(
    ctx: Injector,
    oracle: ReadOracle,
    *,
    stats: dict[str, int],
    features: dict[str, int],
    reports: list[StepReport],
    seconds: float,
    errors: list[str],
    stopped_early: bool,
) -> RunOutcome:
    """The outcome of one run: the driver's side as given, the injector's and the oracle's side from them."""
    return RunOutcome(
        stats=stats,
        features=features,
        reports=reports,
        seconds=seconds,
        opportunities=ctx.opportunities,
        injection=ctx.injection,
        affected=oracle.first,
        later_reads=oracle.later_reads,
        store=oracle.store,
        errors=errors + [f"harness: {type(e).__name__}: {e}" for e in ctx.errors],
        stopped_early=stopped_early,
    )


def verdict_settled(
    ctx: Injector, oracle: ReadOracle, done: int, report_steps: Iterable[int], grace: int = GRACE_STEPS
) -> bool:
    """Whether a faulted run may stop: injected, and :meth:`ReadOracle.settled` given the first report at or
    after the injection (``report_steps``: the steps of the canary's reports, in the injection's numbering)."""
    inj = ctx.injection
    if inj is None:
        return False
    detected: int | None = next((int(s) for s in report_steps if s >= inj.step), None)
    return oracle.settled(done, detected, grace)

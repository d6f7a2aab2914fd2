"""The scenario runner: clean controls and faulted trials on a real engine, judged against the read oracle.

Engine-neutral: everything engine-specific goes through the :class:`~kvcanary.selftest.protocol.EngineDriver`.

For each trial seed and model kind, one clean control runs with every selected fault *probing*: it must
raise no violation (a false positive otherwise), and it yields each fault's eligible steps and the oracle's
reference K/V.  Then each fault runs once with that seed, injected at a step drawn (seeded) from its
eligible steps.  A seed that offers a fault no eligible step is skipped for that fault and another seed is
drawn, so every fault gets its full number of trials (up to a cap).

A trial's verdict:

* the *first affected read* is the oracle's (:mod:`kvcanary.selftest.read_oracle`): the first step at which an
  attention layer received K/V that a correct engine would not have given it;
* *detection* is the canary's first report at or after the injection step; ``steps`` goes from the first
  affected read to detection, counting after that read only the forwards the affected requests ran in (a
  parked request reads nothing, so nothing can be checked for it): <= 0 caught at or before that read
  (negative: the bad write was flagged when stamped), 1 caught by the affected requests' next forward;
* *caught* means ``steps`` <= 1 (or detected while no read was ever affected); *late* means detected
  later; *missed* means not reported (each driver stops a faulted run a few reported forwards after its
  verdict is settled).  Reports before the injection are false positives.
* a trial whose corruption never reached a read and was not reported (*no effect*), or reached only the
  affected requests' very last forward (*unobservable*: nothing reads those slots again, so no check made
  before a read can see it) does not test the canary: it is counted apart and redrawn with another seed.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence

from kvcanary.runtime import StepReport
from kvcanary.selftest.protocol import (
    AffectedRead,
    EngineDriver,
    Expect,
    FaultSpec,
    Injection,
    InjectMode,
    RunOutcome,
    RunSpec,
)

Progress = Callable[[int, int, str], None]  # (runs done, runs planned, what runs now)

MAX_SEED_FACTOR = 3  # give up on a fault after trials * this many seeds without enough eligible steps


@dataclasses.dataclass(frozen=True)
class Trial:
    fault: str
    seed: int
    target_step: int
    injection: Injection | None
    affected: AffectedRead | None
    later_reads: tuple[int, ...]  # steps after the first affected read in which an affected request ran
    detection_step: int | None
    first_check: str  # "phase:reason+reason" of the first violation row reported, "" when none
    expected_check: bool  # the first report contains a row of the expected check
    attributed: bool  # the first report names a corrupted or affected request
    false_reports: int  # reports before the injection
    errors: tuple[str, ...]
    seconds: float

    @property
    def raw_steps(self) -> int | None:
        """Detection step minus the first affected read's step (None unless both exist)."""
        if self.detection_step is None or self.affected is None:
            return None
        return self.detection_step - self.affected.step

    @property
    def steps(self) -> int | None:
        """Steps from the first affected read to detection, counting after it only the forwards the affected
        requests ran in (a request the scheduler parks reads nothing, so nothing can be verified for it):
        <= 0 caught at or before that read, 1 caught by the affected requests' next forward (or sooner)."""
        raw = self.raw_steps
        if raw is None or raw <= 0 or self.detection_step is None:
            return raw
        return 1 + sum(s < self.detection_step for s in self.later_reads)

    @property
    def no_effect(self) -> bool:
        """The corruption never reached attention and nothing was reported: not a test of the canary."""
        return not self.errors and self.injection is not None and self.affected is None and self.detection_step is None

    @property
    def unobservable(self) -> bool:
        """The corruption reached only the affected requests' last forward: nothing ever read those slots
        again, so no check made before a read could see it (and the run ended without a report)."""
        return not self.errors and self.affected is not None and self.detection_step is None and not self.later_reads

    @property
    def outcome(self) -> str:
        if self.errors or self.injection is None:
            return "error"
        if self.detection_step is None:
            return "missed"
        s = self.steps
        return "late" if s is not None and s > 1 else "caught"


@dataclasses.dataclass(frozen=True)
class Control:
    kind: str
    seed: int
    steps: int
    violations: int
    errors: tuple[str, ...]
    seconds: float
    features: dict[str, int]

    @property
    def false_positive(self) -> bool:
        return self.violations > 0


@dataclasses.dataclass(frozen=True)
class FaultRow:
    spec: FaultSpec
    trials: list[Trial]
    no_effect: int = 0  # injections that never reached a read and were not reported (redrawn, not counted)
    unobservable: int = 0  # reached only the affected requests' last forward, never read again (redrawn)

    @property
    def detected(self) -> int:
        return sum(t.outcome == "caught" for t in self.trials)

    def count(self, outcome: str) -> int:
        return sum(t.outcome == outcome for t in self.trials)

    @property
    def not_affected(self) -> int:
        """Counted trials whose corruption was reported before any read was affected."""
        return sum(t.affected is None and t.outcome != "error" for t in self.trials)

    @property
    def median_steps(self) -> float | None:
        steps = [t.steps for t in self.trials if t.outcome in ("caught", "late") and t.steps is not None]
        return statistics.median(steps) if steps else None

    @property
    def fired(self) -> dict[str, int]:
        return dict(Counter(t.first_check for t in self.trials if t.first_check).most_common())

    @property
    def passed(self) -> bool:
        """Miss rows: no trial errored or reported before its injection.  Detect rows also: every trial caught
        within one step, with the documented check among the first report's rows."""
        if any(t.outcome == "error" or t.false_reports for t in self.trials) or not self.trials:
            return False
        if self.spec.expected is Expect.MISS:
            return True
        return self.detected == len(self.trials) and all(t.expected_check for t in self.trials)


@dataclasses.dataclass(frozen=True)
class SelftestResult:
    engine: str
    engine_version: str
    engine_label: str  # the engine as the matrix's title names it
    rows: list[FaultRow]
    controls: list[Control]
    requested_trials: int
    seconds: float

    @property
    def false_positives(self) -> int:
        return sum(c.false_positive for c in self.controls)

    @property
    def control_errors(self) -> int:
        return sum(bool(c.errors) for c in self.controls)

    @property
    def passed(self) -> bool:
        return (
            all(r.passed and len(r.trials) >= self.requested_trials for r in self.rows)
            and self.false_positives == 0
            and self.control_errors == 0
        )


def _first_check(report: StepReport) -> str:
    if not report.violations:
        return "+".join(sorted(report.counts))
    v = report.violations[0]
    return f"{v.phase}:{'+'.join(v.reasons)}"


def judge(spec: FaultSpec, seed: int, target: int, run: RunOutcome) -> Trial:
    inj = run.injection
    start = inj.step if inj is not None else target
    early = [r for r in run.reports if r.step < start]
    after = [r for r in run.reports if r.step >= start]
    first = after[0] if after else None
    victims = set(inj.requests if inj is not None else ()) | set(run.affected.requests if run.affected else ())
    return Trial(
        fault=spec.name,
        seed=seed,
        target_step=target,
        injection=inj,
        affected=run.affected,
        later_reads=tuple(run.later_reads),
        detection_step=None if first is None else first.step,
        first_check="" if first is None else _first_check(first),
        expected_check=first is not None
        and any((v.phase, r) in spec.checks for v in first.violations for r in v.reasons),
        attributed=first is not None and bool(victims.intersection(str(x) for x in first.affected_request_ids)),
        false_reports=len(early),
        errors=tuple(run.errors),
        seconds=run.seconds,
    )


def run_selftest(
    driver: EngineDriver,
    fault_names: Sequence[str] | None = None,
    *,
    trials: int = 20,
    seed: int = 0,
    progress: Progress | None = None,
) -> SelftestResult:
    """Run every named fault of ``driver``'s library (all by default) ``trials`` times, plus one clean
    control per seed and workload kind."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    faults = driver.faults
    names = list(faults) if fault_names is None else list(fault_names)
    unknown = [n for n in names if n not in faults]
    if unknown or not names:
        raise ValueError(f"unknown fault(s) {unknown}; choose from: {', '.join(faults)}")
    version = driver.check()
    start = time.perf_counter()
    kinds = sorted({faults[n].spec.model for n in names}, key=list(driver.workloads).index)
    plan = _Plan(driver, names, trials, len(kinds), progress)
    with driver.session(kinds):
        # Every engine shutdown runs gc.collect(); with torch and an engine loaded that costs ~0.1 s a run.
        # Objects alive now (modules, the models) are never garbage: keep them out of the collector's way.
        gc.freeze()
        try:
            for kind in kinds:
                plan.run_kind(kind, seed)
        finally:
            gc.unfreeze()
    plan.tick("done")
    rows = [FaultRow(faults[n].spec, plan.trials[n], plan.no_effect[n], plan.unobservable[n]) for n in names]
    label = driver.describe(version)
    return SelftestResult(driver.name, version, label, rows, plan.controls, trials, time.perf_counter() - start)


class _Plan:
    """The trials still needed, the runs done and planned (for the progress bar), and the results so far."""

    def __init__(
        self, driver: EngineDriver, names: list[str], trials: int, kinds: int, progress: Progress | None
    ) -> None:
        self.driver = driver
        self.names = names
        self.wanted_trials = trials
        self.progress = progress
        self.trials: dict[str, list[Trial]] = {n: [] for n in names}
        self.no_effect = dict.fromkeys(names, 0)
        self.unobservable = dict.fromkeys(names, 0)
        self.controls: list[Control] = []
        self.planned = trials * (len(names) + kinds)
        self.done = 0

    def tick(self, label: str) -> None:
        if self.progress is not None:
            self.progress(self.done, self.planned, label)

    def run_kind(self, kind: str, seed: int) -> None:
        faults = self.driver.faults
        wanted = [n for n in self.names if faults[n].spec.model == kind]
        for t in range(self.wanted_trials * MAX_SEED_FACTOR):
            need = [n for n in wanted if len(self.trials[n]) < self.wanted_trials]
            if not need:
                break
            if t >= self.wanted_trials:  # an extra seed: some fault had no eligible step or no effect
                self.planned += 1 + len(need)
            self.run_seed(kind, seed * 1000 + t, need)

    def run_seed(self, kind: str, run_seed: int, need: list[str]) -> None:
        faults = self.driver.faults
        self.tick(f"{kind} control, seed {run_seed}")
        control = self.driver.run(RunSpec(kind, run_seed, [faults[n]() for n in need]))
        self.controls.append(
            Control(
                kind, run_seed, control.stats["steps"], control.violations, tuple(control.errors),
                control.seconds, control.features,
            )
        )  # fmt: skip
        self.done += 1
        rng = random.Random(run_seed)
        for name in need:
            steps = control.opportunities.get(name, [])
            if not steps:  # no eligible step: counted as done, so the total never shrinks
                self.done += 1
                continue
            target = rng.choice(steps)
            self.tick(f"{name}, seed {run_seed}, step {target}")
            run = self.driver.run(
                RunSpec(kind, run_seed, [faults[name]()], InjectMode.INJECT, target=(name, target), store=control.store)
            )
            trial = judge(faults[name].spec, run_seed, target, run)
            self.done += 1
            if trial.no_effect:
                self.no_effect[name] += 1
            elif trial.unobservable:
                self.unobservable[name] += 1
            else:
                self.trials[name].append(trial)

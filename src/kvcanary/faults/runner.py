"""The scenario runner: clean controls and faulted trials on the real engine, judged against the oracle.

For each trial seed and model kind, one clean control runs with every selected fault *probing*: it must
raise no violation (a false positive otherwise), and it yields each fault's eligible steps and the oracle's
reference K/V.  Then each fault runs once with that seed, injected at a step drawn (seeded) from its
eligible steps.  A seed that offers a fault no eligible step is skipped for that fault and another seed is
drawn, so every fault gets its full number of trials (up to a cap).

A trial's verdict:

* the *first affected read* is the oracle's (:mod:`kvcanary.faults.oracle`): the first step at which an
  attention layer received K/V that a correct engine would not have given it;
* *detection* is the canary's first report at or after the injection step; ``steps`` goes from the first
  affected read to detection, counting after that read only the forwards the affected requests ran in (a
  parked request reads nothing, so nothing can be checked for it): <= 0 caught at or before that read
  (negative: the bad write was flagged when stamped), 1 caught by the affected requests' next forward;
* *caught* means ``steps`` <= 1 (or detected while no read was ever affected); *late* means detected
  later; *missed* means not reported (a faulted run stops a few reported forwards after its verdict is
  settled, see :mod:`kvcanary.faults.engine`).  Reports before the injection are false positives.
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

from kvcanary.faults.base import Expect, FaultSpec, Injection, InjectMode
from kvcanary.faults.catalogue import FAULTS
from kvcanary.faults.engine import WORKLOADS, RunOutcome, build_models, run_engine
from kvcanary.faults.oracle import AffectedRead
from kvcanary.runtime import StepReport

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
    fault_names: Sequence[str] | None = None,
    *,
    trials: int = 20,
    seed: int = 0,
    progress: Progress | None = None,
) -> SelftestResult:
    """Run every named fault (all by default) ``trials`` times on the transformers engine, plus one clean
    control per seed and model kind."""
    import torch

    from kvcanary.adapters.transformers_cb.version import check_version
    from kvcanary.demo import quiet_engine_logs

    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    names = list(FAULTS) if fault_names is None else list(fault_names)
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        raise ValueError(f"unknown fault(s) {unknown}; choose from: {', '.join(FAULTS)}")
    version = check_version()
    start = time.perf_counter()
    specs = [FAULTS[n].spec for n in names]
    kinds = sorted({s.model for s in specs}, key=list(WORKLOADS).index)
    models = build_models(kinds)
    trials_by_fault: dict[str, list[Trial]] = {n: [] for n in names}
    no_effect = dict.fromkeys(names, 0)
    unobservable = dict.fromkeys(names, 0)
    controls: list[Control] = []
    planned = trials * (len(names) + len(kinds))
    done = 0

    def tick(label: str) -> None:
        if progress is not None:
            progress(done, planned, label)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add contention on a shared CI core
    # Every engine shutdown runs gc.collect(); with torch and transformers loaded that costs ~0.1 s a run.
    # Objects alive now (modules, the models) are never garbage: keep them out of the collector's way.
    gc.freeze()
    try:
        with quiet_engine_logs():
            for kind in kinds:
                wanted = [n for n in names if FAULTS[n].spec.model == kind]
                for t in range(trials * MAX_SEED_FACTOR):
                    need = [n for n in wanted if len(trials_by_fault[n]) < trials]
                    if not need:
                        break
                    if t >= trials:  # an extra seed: some fault had no eligible step or no effect
                        planned += 1 + len(need)
                    run_seed = seed * 1000 + t
                    tick(f"{kind} control, seed {run_seed}")
                    control = run_engine(
                        models[kind], WORKLOADS[kind], run_seed, [FAULTS[n]() for n in need], mode=InjectMode.PROBE
                    )
                    controls.append(
                        Control(
                            kind, run_seed, control.stats["steps"], control.violations, tuple(control.errors),
                            control.seconds, control.features,
                        )
                    )  # fmt: skip
                    done += 1
                    rng = random.Random(run_seed)
                    for name in need:
                        steps = control.opportunities.get(name, [])
                        if not steps:  # no eligible step: counted as done, so the total never shrinks
                            done += 1
                            continue
                        target = rng.choice(steps)
                        tick(f"{name}, seed {run_seed}, step {target}")
                        run = run_engine(
                            models[kind],
                            WORKLOADS[kind],
                            run_seed,
                            [FAULTS[name]()],
                            mode=InjectMode.INJECT,
                            target=(name, target),
                            store=control.store,
                        )
                        trial = judge(FAULTS[name].spec, run_seed, target, run)
                        done += 1
                        if trial.no_effect:
                            no_effect[name] += 1
                        elif trial.unobservable:
                            unobservable[name] += 1
                        else:
                            trials_by_fault[name].append(trial)
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
    tick("done")
    rows = [FaultRow(FAULTS[n].spec, trials_by_fault[n], no_effect[n], unobservable[n]) for n in names]
    return SelftestResult("transformers", version, rows, controls, trials, time.perf_counter() - start)

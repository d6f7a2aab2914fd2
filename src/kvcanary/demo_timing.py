"""The demo's timing lines: the canary's host time per step, and its share of the step time (``kvcanary demo
--baseline``: the workload timed with and without the canary, in alternating pairs).

One timed run of each side moved the share by tens of points from one device call to the next (0.0 % and 36.5 %
for the same host time per step): the engine's run time drifts and jitters far more than the canary costs.  So
the two sides run in turn, ROUNDS pairs, the order flipping each pair (a drift then favours neither side), and
the share reported is the median of the pairs' shares.  What each side times is the engine's steps (see
:mod:`kvcanary.adapters.transformers_cb.step_clock`), not the set-up and clean-up around them.  Every canary run
is a full clean run: one with a violation fails the demo like the clean run would.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence

ROUNDS = 3  # pairs of timed runs


_PHASE_NAMES = (
    ("capture", "batch capture"),
    ("translate", "translation"),
    ("launch", "plan/verify/stamp"),
    ("host_step", "host step"),
)


def host_time_lines(stats: dict[str, int], features: dict[str, int]) -> list[str]:
    """Mean host time per verified step, its median, and the mean of each phase (see the adapter's TapTimer); and
    how many steps reused a kept translation of their shape class (the GPU path's steady steps), where any did."""
    steps = stats["steps"]
    text = f"{stats['tap_us'] / steps / 1000:.2f} ms per step"
    if "tap_median_us" in stats:
        phases = ", ".join(f"{name} {stats[f'tap_{key}_us'] / steps / 1000:.3f}" for key, name in _PHASE_NAMES)
        text += f" (median {stats['tap_median_us'] / 1000:.2f} ms; mean by phase, ms: {phases})"
    lines = [f"  host time in the canary: {text}"]
    if features.get("steady_steps"):
        reused = f"{features['steady_steps']:,} of {steps:,}"
        lines.append(f"  steady steps (a kept translation of their shape class reused): {reused}")
    if (graphs := graph_line(stats)) is not None:
        lines.append(graphs)
    if stats.get("queued_move_entries"):
        lines.append(
            f"  block moves queued for the step work: {stats['queued_move_entries']:,} moved blocks over "
            f"{stats.get('steps_with_queued_moves', 0):,} steps, {stats.get('move_entries_applied_at_once', 0):,} "
            "applied at once"
        )
    return lines


def graph_line(stats: dict[str, int]) -> str | None:
    """The canary's own step graphs (CUDA): steps replayed, graphs captured and steps run eagerly, and what the
    captures and eager steps cost per step of the run (most of the plan/verify/stamp phase's mean: a replay is one
    launch); None where no graph was used."""
    replays, captures, eager = (
        stats.get("graph_replays", 0),
        stats.get("graph_captures", 0),
        stats.get("graph_eager_steps", 0),
    )
    if not replays and not captures:
        return None
    capture_ms, eager_ms = stats.get("graph_capture_us", 0) / 1000, stats.get("graph_eager_us", 0) / 1000
    per_step = (capture_ms + eager_ms) / stats["steps"]
    each = f" ({capture_ms / captures:.1f} ms each)" if captures else ""
    failed = stats.get("graph_capture_failures", 0)
    return (
        f"  canary step graphs: {replays:,} steps replayed, {captures} captured{each}, {eager} run eagerly "
        f"({eager_ms / max(eager, 1):.2f} ms each): captures and eager steps {per_step:.3f} ms a step"
        + (f"; {failed} captures failed (those steps ran eagerly)" if failed else "")
    )


def timed_host_line(stats: Sequence[dict[str, int]]) -> str | None:
    """Host time per step of each timed canary run, and their median (None without two runs that verified steps).
    The first run's mean carries what the warm-up left to do (kernels of shape classes it never met compile then);
    each run also captures its own step graphs (a new install), which one long-lived install would not repeat."""
    per_run = [s["tap_us"] / s["steps"] / 1000 for s in stats if s.get("steps")]
    if len(per_run) < 2:
        return None
    runs = ", ".join(f"{v:.2f}" for v in per_run)
    return f"  host time per step of each timed run: {runs} ms (median {statistics.median(per_run):.2f} ms)"


@dataclasses.dataclass(frozen=True)
class ShareTiming:
    """The seconds of each pair's runs, without and with the canary (the engine's steps where they were timed)."""

    without: tuple[float, ...]
    with_canary: tuple[float, ...]
    # The same runs' wall seconds (set-up, the engine's end-of-run collections and waits included), without and with
    # the canary, where the compared seconds are the steps': the share as the demo measured it before the step clock.
    walls: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    # Each run's steps' seconds, in order, without and with the canary (see :func:`step_by_step_line`).
    steps: tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]] | None = None
    # The engine's loop thread's CPU seconds in the same steps, without and with the canary: the time the thread ran,
    # its waits and descheduling left out (None where not kept).
    cpus: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    @property
    def shares(self) -> list[float]:
        """Per pair: the time the canary added, as a share of the run with it (0 where it added none)."""
        return _shares(self.without, self.with_canary)

    @property
    def share(self) -> float:
        return statistics.median(self.shares)

    @property
    def wall_share(self) -> float | None:
        """The median share of the pairs' wall times (None where they were not kept)."""
        return None if self.walls is None else statistics.median(_shares(*self.walls))

    @property
    def cpu_shares(self) -> list[float] | None:
        """Per pair: the CPU time the canary added to the engine's loop thread in its steps, as a share of the run with
        it (None where the CPU time was not kept)."""
        return None if self.cpus is None else _shares(*self.cpus)

    def line(self) -> str:
        pairs = ", ".join(f"{s:.1%}" for s in self.shares)
        text = (
            f"the engine's steps without the canary: {statistics.median(self.without):.2f} s, with it: "
            f"{statistics.median(self.with_canary):.2f} s (medians of {len(self.without)} alternating runs each); "
            f"the canary's share of step time: {self.share:.1%} (median of the pairs: {pairs})"
            + ("" if (wall := self.wall_share) is None else f"; of the runs' wall time: {wall:.1%}")
        )
        if (cpu := self.cpu_shares) is not None:
            each = ", ".join(f"{s:.1%}" for s in cpu)
            text += f"; of the loop thread's CPU time in the steps: {statistics.median(cpu):.1%} (pairs: {each})"
        return text


def _shares(without: Sequence[float], with_canary: Sequence[float]) -> list[float]:
    return [max(w - b, 0.0) / w if w else 0.0 for b, w in zip(without, with_canary, strict=True)]


def added_time_line(timing: ShareTiming, stats: Sequence[dict[str, int]]) -> str | None:
    """Where the time a canary run added per step went, median of the pairs: the canary's own timed host work (the
    tap's, each cache's set-up, mirroring the engine's block moves) and the rest, which none of it accounts for.
    ``stats``: each timed canary run's, in the order of ``timing.with_canary``."""
    if len(stats) != len(timing.with_canary) or not stats or not all(s.get("steps") for s in stats):
        return None
    parts: dict[str, list[float]] = {"added": [], "tap": [], "setup": [], "mirror": [], "rest": [], "floor": []}
    for before, after, s in zip(timing.without, timing.with_canary, stats, strict=True):
        ms = 1000 / s["steps"]
        added, tap = (after - before) * ms, s["tap_us"] / 1000 * ms / 1000
        setup, mirror = s.get("setup_us", 0) / 1000 * ms / 1000, s.get("mirror_us", 0) / 1000 * ms / 1000
        own = tap + setup + mirror
        floor = own / (after * ms) if after else 0.0
        for key, value in zip(parts, (added, tap, setup, mirror, added - own, floor), strict=True):
            parts[key].append(value)
    m = {k: statistics.median(v) for k, v in parts.items()}
    return (
        f"  time added per step (medians of the pairs): {m['added']:.3f} ms; the canary's host time in the step "
        f"{m['tap']:.3f}, each cache's set-up {m['setup']:.3f}, mirroring the engine's block moves {m['mirror']:.3f}, "
        f"the rest {m['rest']:.3f} (none of the canary's timed work: the engine's own work ran longer, or waited for "
        f"the canary's device work); the canary's timed work alone is {m['floor']:.1%} of the time with it (a floor "
        "under the share: it is timed inside the runs, without the pairs' noise)"
    )


FIRST_STEPS = 3  # steps of a run told apart by the step-by-step line: a new cache's set-up and first shapes


def step_by_step_line(timing: ShareTiming) -> str | None:
    """The runs compared step by step: each step's median over the runs of a side (every run is the same workload,
    so step ``i`` is the same step in each), what the canary added to the first :data:`FIRST_STEPS` steps (a new
    cache's set-up, its first shapes' translations and step graphs) and to the others, and their share.  A slow
    stretch of one run (the machine, a collection) moves a median over the runs less than it moves a run's total.
    None where the steps were not timed or the runs did not take the same number of steps."""
    if timing.steps is None:
        return None
    without, with_canary = timing.steps
    counts = {len(run) for run in (*without, *with_canary)}
    if len(counts) != 1 or counts.pop() <= FIRST_STEPS or not without or not with_canary:
        return None
    med = statistics.median
    base = [med(step) for step in zip(*without, strict=True)]
    on = [med(step) for step in zip(*with_canary, strict=True)]
    added = [(b - a) * 1000 for a, b in zip(base, on, strict=True)]
    first = ", ".join(f"{a:.2f}" for a in added[:FIRST_STEPS])
    rest, rest_on = added[FIRST_STEPS:], sum(on[FIRST_STEPS:]) * 1000
    share = max(sum(rest), 0.0) / rest_on if rest_on else 0.0
    return (
        f"  step by step (each step's median over the runs of a side): the first {FIRST_STEPS} steps added {first} ms "
        f"(the cache's set-up, its first shapes); the other {len(rest):,} added {statistics.fmean(rest):.3f} ms a step "
        f"(median {med(rest):.3f}), {share:.1%} of their time with the canary"
    )


def timing_lines(timing: ShareTiming | None, stats: Sequence[dict[str, int]]) -> list[str]:
    """The summary's timing lines after the clean run's host time: each timed run's host time, the share, where the
    added time went (``stats``: the timed canary runs', in order)."""
    lines = [] if (timed := timed_host_line(stats)) is None else [timed]
    if timing is not None:
        lines.append("  " + timing.line())
        if (added := added_time_line(timing, stats)) is not None:
            lines.append(added)
        if (by_step := step_by_step_line(timing)) is not None:
            lines.append(by_step)
    return lines


def time_share(
    run_with: Callable[[int], tuple[float, int]], run_without: Callable[[], float], rounds: int = ROUNDS
) -> tuple[ShareTiming, list[int]]:
    """``rounds`` pairs of runs, the canary's run first in odd pairs.  ``run_with(i)``: the ``i``-th canary run's
    seconds and violations; ``run_without()``: a run's seconds without it.  Returns the timing and each canary
    run's violations."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    without: list[float] = []
    with_canary: list[float] = []
    violations: list[int] = []

    def canary_run() -> None:
        seconds, found = run_with(len(with_canary))
        with_canary.append(seconds)
        violations.append(found)

    for r in range(rounds):
        if r % 2:
            canary_run()
            without.append(run_without())
        else:
            without.append(run_without())
            canary_run()
    return ShareTiming(tuple(without), tuple(with_canary)), violations

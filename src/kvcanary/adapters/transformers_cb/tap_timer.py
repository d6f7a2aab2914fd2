"""Host time the adapter spends on each verified step, by phase (its own overhead, reported in stats).

Phases: ``capture`` (the scheduler's view of the batch, read while the engine prepares it), ``translate`` (from the
tap's entry: its checks, the binding and the switch to the engine's stream, then forward kwargs -> StepBatches),
``launch`` (plan/verify/stamp issued by the manager; on GPU the device work itself runs asynchronously) and
``host_step`` (the lagged report of the previous step, and the switch back). Medians (of the step and of each phase)
are taken over the last :data:`RECENT_STEPS` steps, so a one-off cost (kernel compilation on first use) shows in the
mean but not in the median. ``cpu`` is the tap thread's CPU time over translate, launch and host step: wall time
above it is time the thread waited (for the GIL, a blocking CUDA call, or a CPU other threads kept busy). It is read
on one step in :data:`CPU_EVERY` (its total scaled up to every step): the thread's CPU clock is a system call, about
3 us each with the caches cold on this project's CPUs, and a step reading it twice paid that every step for a
diagnostic.
"""

from __future__ import annotations

import collections
import statistics

PHASES = ("capture", "translate", "launch", "host_step")
RECENT_STEPS = 4096
CPU_EVERY = 16  # steps per step whose CPU time is read


class TapTimer:
    """The phases' totals and recent values.  Per step it takes one attribute write (:attr:`capture_ns`) and one
    :meth:`commit` of the tap's clock readings: the tap runs every step with the CPU caches cold, where each call
    and loop of its own costs microseconds (the timer's too)."""

    def __init__(self) -> None:
        self.total_ns = 0
        self.capture_ns = 0  # the last prepared step's capture; a step prepared but never tapped is overwritten
        self._sums = [0] * len(PHASES)
        self._recent: collections.deque[int] = collections.deque(maxlen=RECENT_STEPS)
        self._recent_phase = tuple(collections.deque[int](maxlen=RECENT_STEPS) for _ in PHASES)
        self.cpu_ns = 0
        self._recent_cpu: collections.deque[int] = collections.deque(maxlen=RECENT_STEPS)
        self.steps = 0
        self.cpu_steps = 0  # steps whose CPU time was read
        self.cpu_next = True  # whether the next step reads it (the tap reads this attribute, no call)

    def commit(self, marks: tuple[int, int, int, int], host_start: int, end: int, cpu_end: int) -> None:
        """A verified step: ``marks`` = (translation start, its end, the launches' end, the tap thread's CPU clock at
        the start), then the host step's start and end (``time.perf_counter_ns``) and the CPU clock at the end
        (``time.thread_time_ns``); both CPU clocks -1 on a step that did not read them (see :attr:`cpu_next`)."""
        start, translated, launched, cpu_start = marks
        capture, self.capture_ns = self.capture_ns, 0
        translate, launch, host_step = translated - start, launched - translated, end - host_start
        sums, recent = self._sums, self._recent_phase
        sums[0] += capture
        sums[1] += translate
        sums[2] += launch
        sums[3] += host_step
        recent[0].append(capture)
        recent[1].append(translate)
        recent[2].append(launch)
        recent[3].append(host_step)
        total = capture + translate + launch + host_step
        self.total_ns += total
        self._recent.append(total)
        self.steps += 1
        self.cpu_next = self.steps % CPU_EVERY == 0
        if cpu_start >= 0:
            cpu = cpu_end - cpu_start
            self.cpu_ns += cpu
            self.cpu_steps += 1
            self._recent_cpu.append(cpu)

    def stats(self) -> dict[str, int]:
        out = {"tap_us": self.total_ns // 1000, "tap_median_us": _median_us(self._recent)}
        out.update({f"tap_{k}_us": ns // 1000 for k, ns in zip(PHASES, self._sums, strict=True)})
        out.update({f"tap_median_{k}_us": _median_us(d) for k, d in zip(PHASES, self._recent_phase, strict=True)})
        cpu_us = self.cpu_ns * self.steps // self.cpu_steps // 1000 if self.cpu_steps else 0  # scaled to every step
        out.update(tap_cpu_us=cpu_us, tap_median_cpu_us=_median_us(self._recent_cpu), tap_cpu_steps=self.cpu_steps)
        return out


def _median_us(ns: collections.deque[int]) -> int:
    return int(statistics.median(ns)) // 1000 if ns else 0

"""Host time the adapter spends on each verified step, by phase (its own overhead, reported in stats).

Phases: ``capture`` (the scheduler's view of the batch, read while the engine prepares it),
``translate`` (forward kwargs -> StepBatches), ``launch`` (plan/verify/stamp issued by the manager;
on GPU the device work itself runs asynchronously) and ``host_step`` (the lagged report of the
previous step).  Medians (of the step and of each phase) are taken over the last :data:`RECENT_STEPS` steps,
so a one-off cost (kernel compilation on first use) shows in the mean but not in the median.  ``cpu`` is the
tap thread's CPU time over translate, launch and host step: wall time above it is time the thread waited (for
the GIL, a blocking CUDA call, or a CPU other threads kept busy).
"""

from __future__ import annotations

import collections
import statistics
import time

PHASES = ("capture", "translate", "launch", "host_step")
RECENT_STEPS = 4096


class TapTimer:
    def __init__(self) -> None:
        self.total_ns = 0
        self.phase_ns = dict.fromkeys(PHASES, 0)
        self._recent: collections.deque[int] = collections.deque(maxlen=RECENT_STEPS)
        self._recent_phase = {k: collections.deque[int](maxlen=RECENT_STEPS) for k in PHASES}
        self._step = dict.fromkeys(PHASES, 0)  # the step being timed
        self.cpu_ns = 0
        self._step_cpu = 0
        self._cpu_mark = 0
        self._recent_cpu: collections.deque[int] = collections.deque(maxlen=RECENT_STEPS)

    def add(self, phase: str, ns: int) -> None:
        self._step[phase] += ns

    def start_cpu(self) -> None:
        """The tap's own work starts (translate): its thread's CPU time is counted from here."""
        self._cpu_mark = time.thread_time_ns()

    def stop_cpu(self) -> None:
        """The tap's own work ends (after the host step)."""
        self._step_cpu += time.thread_time_ns() - self._cpu_mark

    def discard(self) -> None:
        """Forget the step being timed (it was not verified)."""
        for k in self._step:
            self._step[k] = 0
        self._step_cpu = 0

    def commit(self) -> None:
        """The step being timed was verified: add it to the totals."""
        total = 0
        for k, ns in self._step.items():
            self.phase_ns[k] += ns
            self._recent_phase[k].append(ns)
            total += ns
            self._step[k] = 0
        self.total_ns += total
        self._recent.append(total)
        self.cpu_ns += self._step_cpu
        self._recent_cpu.append(self._step_cpu)
        self._step_cpu = 0

    def stats(self) -> dict[str, int]:
        out = {"tap_us": self.total_ns // 1000, "tap_median_us": _median_us(self._recent)}
        out.update({f"tap_{k}_us": ns // 1000 for k, ns in self.phase_ns.items()})
        out.update({f"tap_median_{k}_us": _median_us(d) for k, d in self._recent_phase.items()})
        out.update(tap_cpu_us=self.cpu_ns // 1000, tap_median_cpu_us=_median_us(self._recent_cpu))
        return out


def _median_us(ns: collections.deque[int]) -> int:
    return int(statistics.median(ns)) // 1000 if ns else 0

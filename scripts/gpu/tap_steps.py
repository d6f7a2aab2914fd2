"""Which steps make the canary's mean host time per step exceed its median on the demo (not run by CI).

The demo prints the tap's mean and median host time per step (dense on an H100 at c750421: 0.17 and 0.15 ms).  This
runs the demo workload three times (the last is reported: the first two compile and warm up) with the tap timer's
per-step readings kept, and splits the steps by whether their translation was steady (a kept translation reused)
and whether a request joined the batch that step, and by batch rows: where the steps above the median are, and how
much of the mean each kind of step adds.

Usage: PYTHONPATH=src python scripts/gpu/tap_steps.py [--model dense] [--device cuda]
"""

from __future__ import annotations

import collections
import statistics
from typing import Any

from probe_args import demo_options

from kvcanary import demo
from kvcanary.adapters.transformers_cb import install, step_tap, tap_timer
from kvcanary.config import CanaryConfig, Mode

PHASES = ("capture", "translate", "launch", "host_step")


class StepLog:
    """Per tapped step: the four phases (us), the batch rows, requests new to the batch, whether it was steady."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, float, float, int, int, bool]] = []
        self._ids: tuple[object, ...] = ()
        self._before: set[object] = set()
        self._steady = False

    def patch(self) -> None:
        log, commit, verify = self, tap_timer.TapTimer.commit, step_tap.StepTap._verify_step

        def timed_commit(timer: Any, marks: Any, host_start: int, end: int, cpu_end: int) -> None:
            start, translated, launched, _ = marks
            phases = (timer.capture_ns, translated - start, launched - translated, end - host_start)
            new = sum(1 for r in log._ids if r not in log._before)
            log.rows.append((*(p / 1000 for p in phases), len(log._ids), new, log._steady))  # type: ignore[arg-type]
            log._before = set(log._ids)
            commit(timer, marks, host_start, end, cpu_end)

        def counted_verify(tap: Any, runner: Any, batch_data: Any, pending: Any) -> Any:
            before = tap._bindings.current.translator.steady_steps if tap._bindings.current is not None else None
            out = verify(tap, runner, batch_data, pending)
            after = tap._bindings.current.translator.steady_steps if tap._bindings.current is not None else None
            log._steady = before is not None and after == before + 1
            if out is not None:
                log._ids = out[0].request_ids
            return out

        tap_timer.TapTimer.commit = timed_commit  # type: ignore[method-assign]
        step_tap.StepTap._verify_step = counted_verify  # type: ignore[method-assign]

    def reset(self) -> None:
        self.rows.clear()
        self._before = set()


def report(log: StepLog) -> None:
    rows = log.rows
    for i, name in enumerate(PHASES):
        v = sorted(r[i] for r in rows)
        n = len(v)
        spread = f"p90 {v[int(n * 0.9)]:7.1f} max {v[-1]:8.1f}"
        print(f"{name:<10} mean {sum(v) / n:7.1f} median {v[n // 2]:7.1f} {spread} us")
    total = [sum(r[:4]) for r in rows]
    median = statistics.median(total)
    print(f"total      mean {sum(total) / len(total):7.1f} median {median:7.1f} us; {len(total)} steps")
    kinds: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for r, t in zip(rows, total, strict=True):
        kinds["steady" if r[6] else "full", "a request joined" if r[5] else "same requests"].append(t)
    print("steps by kind: count, mean, median us, and what they add to the mean over the median (us a step)")
    for k, v in sorted(kinds.items()):
        added = sum(x - median for x in v) / len(total)
        print(f"  {k[0]:<7}{k[1]:<18}{len(v):>5}{sum(v) / len(v):8.1f}{statistics.median(v):8.1f}{added:8.2f}")
    sizes: dict[int, list[float]] = collections.defaultdict(list)
    for r, t in zip(rows, total, strict=True):
        sizes[r[4]].append(t)
    print("by batch rows: rows, steps, mean, median us")
    for k in sorted(sizes):
        print(f"  {k:>4}{len(sizes[k]):>5}{sum(sizes[k]) / len(sizes[k]):8.1f}{statistics.median(sizes[k]):8.1f}")


def main() -> None:
    opts = demo_options(__doc__.splitlines()[0])
    model, prompts = demo.workload(opts)
    log = StepLog()
    log.patch()
    with demo.quiet_engine_logs():
        for _ in range(3):
            log.reset()
            with install(model, CanaryConfig(mode=Mode.LOG)) as c:
                demo.generate_waves(model, prompts, opts)
    stats = c.stats()
    print(f"model {opts.model}: {stats['steps']} steps, {stats['violations']} violations (the last of three runs)")
    report(log)


if __name__ == "__main__":
    main()

"""The reports an adapter keeps for inspection: the first few in full, all of them counted (bounded in a
violation storm)."""

from __future__ import annotations

from kvcanary.runtime import StepReport


class ReportKeeper:
    def __init__(self, max_kept: int) -> None:
        if max_kept < 0:
            raise ValueError(f"max_kept_reports must be >= 0, got {max_kept}")
        self._max_kept = max_kept
        self.kept: list[StepReport] = []
        self.total = 0
        self.first_step: int | None = None  # the canary step of the first violation seen

    def collect(self, report: StepReport | None) -> None:
        if report is None:
            return
        self.total += 1
        if self.first_step is None:
            self.first_step = report.step
        if len(self.kept) < self._max_kept:
            self.kept.append(report)

"""Frozen run-time configuration of the canary."""

from __future__ import annotations

import dataclasses
import enum
import math


class Mode(enum.Enum):
    OFF = "off"  # nothing runs
    LOG = "log"  # log violations, keep serving
    RAISE = "raise"  # raise CanaryViolation with all rows of the step
    FAIL_REQUEST = "fail-request"  # hand the affected request ids to a callback


@dataclasses.dataclass(frozen=True)
class DigestConfig:
    """The KV digest (``docs/design.md`` §12): stamped on every slot written, verified on a budget.

    ``budget`` is the share of a step's read slots whose bytes are re-digested in the step that reads
    them (after its forward, with the stamp; before it on vLLM), rotating so that a slot read on
    consecutive steps is covered within ``period`` steps (1.0: every read slot, every step).  Slots whose
    bytes were moved (copied, restored) are verified after the move whatever the budget.  ``layers``
    restricts the digest to those layer indices (None: all).
    """

    # Default 1/256: the measured cost at 0.01 (benchmarks/results/*-digest.json) is 3.2-3.6 % of a decode step's
    # KV read time at 32-256 x 4k; the verify part scales with the budget, so 1/256 is about 1.3-1.6 %.
    budget: float = 1 / 256
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not 0 < self.budget <= 1:
            raise ValueError(f"digest budget must be a fraction in (0, 1], got {self.budget!r}")
        if self.layers is not None:
            if not isinstance(self.layers, tuple) or not all(isinstance(i, int) and i >= 0 for i in self.layers):
                raise TypeError(f"digest layers must be a tuple of layer indices >= 0 or None, got {self.layers!r}")
            if not self.layers:
                raise ValueError("digest layers is empty: use digest=None to turn the digest off")

    @property
    def period(self) -> int:
        """Steps within which the budgeted verify covers every position of a read span."""
        return max(1, math.ceil(1 / self.budget - 1e-9))


@dataclasses.dataclass(frozen=True)
class CanaryConfig:
    mode: Mode = Mode.LOG
    log_rows: int = 64  # K: the violation log keeps the first K and the last K rows per step
    log_rate_limit_per_s: float = 10.0  # human-readable log blocks per second, at most
    stats_every: int = 0  # steps between stats lines; 0 = never
    health_every: int = 100  # steps between "kernels actually ran" checks; 0 = never
    health_warmup: int = 1  # steps before the first health check
    events_path: str | None = None  # JSON-lines event log, when set
    events_max_bytes: int = 64 << 20  # rotate the event log past this size (one old file kept); 0 = unbounded
    check_values: bool | None = None  # host-side value checks of each batch (default: CPU only)
    digest: DigestConfig | None = None  # the KV digest of the real K/V bytes; None: off, nothing allocated

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Mode):
            raise TypeError(f"mode must be a kvcanary.Mode, got {self.mode!r}")
        for name in ("log_rows",):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("stats_every", "health_every", "health_warmup", "events_max_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.digest is not None and not isinstance(self.digest, DigestConfig):
            raise TypeError(f"digest must be a kvcanary.config.DigestConfig or None, got {self.digest!r}")
        if self.log_rate_limit_per_s <= 0:
            raise ValueError(f"log_rate_limit_per_s must be positive, got {self.log_rate_limit_per_s}")

    @classmethod
    def from_mode_name(cls, name: str, **kw: object) -> CanaryConfig:
        try:
            mode = Mode(name)
        except ValueError:
            choices = ", ".join(m.value for m in Mode)
            raise ValueError(f"unknown canary mode {name!r}; choose one of: {choices}") from None
        return cls(mode=mode, **kw)  # type: ignore[arg-type]

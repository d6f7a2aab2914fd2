"""sglang-style command-line options for the canary, and the configuration they build.

``--kv-canary {none,log,raise}`` keeps the seed's spelling (``none`` is our ``off``); ``fail-request``
and the other flags are ours.  Options are read from any object with the attributes (sglang's
``ServerArgs`` once the flags are registered, or an ``argparse.Namespace``); a missing attribute takes
its default, so an engine that never registered the flags gets the canary off.
"""

from __future__ import annotations

import argparse
import dataclasses

from kvcanary.config import CanaryConfig, DigestConfig, Mode
from kvcanary.ops import Backend

# The CLI spelling of each mode: the seed's none/log/raise plus fail-request.
MODE_CHOICES: dict[str, Mode] = {
    "none": Mode.OFF,
    "log": Mode.LOG,
    "raise": Mode.RAISE,
    "fail-request": Mode.FAIL_REQUEST,
}
BACKEND_CHOICES: dict[str, Backend] = {b.value: b for b in Backend}

_DEFAULTS = CanaryConfig()


@dataclasses.dataclass(frozen=True)
class SglangCanaryOptions:
    """Everything the sglang adapter takes from the command line."""

    config: CanaryConfig
    backend: Backend = Backend.AUTO
    verify_entries: int = 0  # per group and forward; 0 = derived from the pool size (see capacities)

    def __post_init__(self) -> None:
        if not isinstance(self.config, CanaryConfig):
            raise TypeError(f"config must be a kvcanary.CanaryConfig, got {type(self.config).__name__}")
        if not isinstance(self.backend, Backend):
            raise TypeError(f"backend must be a kvcanary.Backend, got {self.backend!r}")
        if isinstance(self.verify_entries, bool) or not isinstance(self.verify_entries, int):
            raise TypeError(f"verify_entries must be an int, got {type(self.verify_entries).__name__}")
        if self.verify_entries < 0:
            raise ValueError(f"verify_entries must be >= 0 (0 = derived), got {self.verify_entries}")

    @property
    def enabled(self) -> bool:
        return self.config.mode is not Mode.OFF


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Register the ``--kv-canary*`` flags (sglang's ``ServerArgs.add_cli_args`` style)."""
    group = parser.add_argument_group("KV canary")
    group.add_argument(
        "--kv-canary",
        choices=list(MODE_CHOICES),
        default="none",
        help="Check KV-cache bookkeeping every forward. log: report violations and keep serving; "
        "raise: fail on the first violation (CI); fail-request: fail only the affected requests.",
    )
    group.add_argument("--kv-canary-log-rows", type=int, default=_DEFAULTS.log_rows, help="K: rows kept per step.")
    group.add_argument("--kv-canary-events", default=None, help="Append JSON-lines events to this file.")
    group.add_argument("--kv-canary-stats-every", type=int, default=0, help="Steps between stats lines (0: never).")
    group.add_argument(
        "--kv-canary-health-every", type=int, default=_DEFAULTS.health_every, help="Steps between health checks."
    )
    group.add_argument(
        "--kv-canary-verify-entries",
        type=int,
        default=0,
        help="Verify entries per forward and group (0: derived from the pool size).",
    )
    group.add_argument("--kv-canary-backend", choices=list(BACKEND_CHOICES), default=Backend.AUTO.value)
    group.add_argument(
        "--kv-canary-digest-budget",
        type=float,
        default=0.0,
        help="KV digest of the real K/V bytes (stamped on every write, verified on this share of each forward's "
        f"reads, 1.0 = all; moved bytes always). 0: off. The default when on is {DigestConfig().budget:.4g}.",
    )
    group.add_argument(
        "--kv-canary-digest-layers",
        default=None,
        help="Comma-separated model layer ids the digest covers (default: every layer).",
    )


def _int_option(args: object, name: str, default: int) -> int:
    value = getattr(args, name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"option {name} must be an int, got {value!r}")
    return value


def _choice(args: object, name: str, choices: dict[str, object], default: str) -> str:
    value = getattr(args, name, default)
    if value is None:
        return default
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"option {name}={value!r} is not one of: {', '.join(choices)}")
    return value


def options_from_args(args: object) -> SglangCanaryOptions:
    """Build the options from ``ServerArgs``/``Namespace`` attributes (``kv_canary``, ``kv_canary_*``)."""
    mode = MODE_CHOICES[_choice(args, "kv_canary", dict(MODE_CHOICES), "none")]
    backend = BACKEND_CHOICES[_choice(args, "kv_canary_backend", dict(BACKEND_CHOICES), Backend.AUTO.value)]
    events = getattr(args, "kv_canary_events", None)
    if events is not None and not isinstance(events, str):
        raise TypeError(f"option kv_canary_events must be a path string, got {events!r}")
    config = CanaryConfig(
        mode=mode,
        log_rows=_int_option(args, "kv_canary_log_rows", _DEFAULTS.log_rows),
        stats_every=_int_option(args, "kv_canary_stats_every", 0),
        health_every=_int_option(args, "kv_canary_health_every", _DEFAULTS.health_every),
        events_path=events,
        digest=digest_from_args(args),
    )
    return SglangCanaryOptions(
        config=config,
        backend=backend,
        verify_entries=_int_option(args, "kv_canary_verify_entries", 0),
    )


def digest_from_args(args: object) -> DigestConfig | None:
    """``--kv-canary-digest-budget`` (0 or unset: off) and ``--kv-canary-digest-layers`` (``"0,3,5"``)."""
    budget = getattr(args, "kv_canary_digest_budget", None)
    if budget is None or budget == 0:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"option kv_canary_digest_budget must be a number, got {budget!r}")
    raw = getattr(args, "kv_canary_digest_layers", None)
    if raw is None:
        return DigestConfig(budget=float(budget))
    if not isinstance(raw, str):
        raise TypeError(f"option kv_canary_digest_layers must be a comma-separated string, got {raw!r}")
    try:
        layers = tuple(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"option kv_canary_digest_layers={raw!r} is not a comma-separated list of ints") from None
    return DigestConfig(budget=float(budget), layers=layers)

"""The canary's settings for vLLM, from environment variables a vLLM deployment already passes through.

``KVCANARY_MODE`` (``off`` or unset, ``log``, ``raise``, ``fail-request``) switches the canary on;
``KVCANARY_EVENTS`` appends JSON-lines events to a file; ``KVCANARY_LOG_ROWS`` and
``KVCANARY_STATS_EVERY`` tune the log; ``KVCANARY_DIGEST_BUDGET`` (a fraction in (0, 1]; unset or 0: off)
turns on the KV digest of the real K/V bytes and ``KVCANARY_DIGEST_LAYERS`` (``0,3,5``) restricts it to those
layers.  An unknown value is refused at start-up with one message naming the variable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from kvcanary.config import CanaryConfig, DigestConfig, Mode
from kvcanary.ops import Backend

ENV_MODE = "KVCANARY_MODE"
ENV_EVENTS = "KVCANARY_EVENTS"
ENV_LOG_ROWS = "KVCANARY_LOG_ROWS"
ENV_STATS_EVERY = "KVCANARY_STATS_EVERY"
ENV_DIGEST_BUDGET = "KVCANARY_DIGEST_BUDGET"
ENV_DIGEST_LAYERS = "KVCANARY_DIGEST_LAYERS"
OFF_SPELLINGS = ("", "off", "none", "0")


@dataclasses.dataclass(frozen=True)
class VllmCanaryOptions:
    config: CanaryConfig
    truth_width: int = 32768  # positions of ground truth kept per request (beyond: token checks off)
    backend: Backend = Backend.AUTO  # the canary's kernels: AUTO is the kernels on CUDA, the reference on the CPU

    def __post_init__(self) -> None:
        if not isinstance(self.config, CanaryConfig):
            raise TypeError(f"config must be a kvcanary.CanaryConfig, got {type(self.config).__name__}")
        if isinstance(self.truth_width, bool) or not isinstance(self.truth_width, int) or self.truth_width < 0:
            raise ValueError(f"truth_width must be an int >= 0, got {self.truth_width!r}")

    @property
    def enabled(self) -> bool:
        return self.config.mode is not Mode.OFF


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def mode_from_env(env: Mapping[str, str]) -> Mode:
    raw = env.get(ENV_MODE, "").strip().lower()
    if raw in OFF_SPELLINGS:
        return Mode.OFF
    try:
        return Mode(raw)
    except ValueError:
        choices = ", ".join(m.value for m in Mode if m is not Mode.OFF)
        raise ValueError(f"{ENV_MODE}={raw!r} is not a kvcanary mode; choose one of: {choices} (or off)") from None


def options_from_env(env: Mapping[str, str]) -> VllmCanaryOptions:
    """The options the environment asks for (``os.environ``, or any mapping in tests)."""
    mode = mode_from_env(env)
    events = env.get(ENV_EVENTS, "").strip() or None
    defaults = CanaryConfig()
    config = CanaryConfig(
        mode=mode,
        events_path=events,
        log_rows=_int_env(env, ENV_LOG_ROWS, defaults.log_rows),
        stats_every=_int_env(env, ENV_STATS_EVERY, 0),
        digest=digest_from_env(env),
    )
    return VllmCanaryOptions(config=config)


def digest_from_env(env: Mapping[str, str]) -> DigestConfig | None:
    raw = env.get(ENV_DIGEST_BUDGET, "").strip()
    try:
        budget = float(raw) if raw else 0.0
    except ValueError:
        raise ValueError(f"{ENV_DIGEST_BUDGET}={raw!r} is not a number (a fraction in (0, 1]; 0: off)") from None
    if budget == 0:
        return None
    layers_raw = env.get(ENV_DIGEST_LAYERS, "").strip()
    try:
        layers = tuple(int(x) for x in layers_raw.split(",") if x.strip()) if layers_raw else None
    except ValueError:
        raise ValueError(f"{ENV_DIGEST_LAYERS}={layers_raw!r} is not a comma-separated list of ints") from None
    try:
        return DigestConfig(budget=budget, layers=layers)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{ENV_DIGEST_BUDGET}/{ENV_DIGEST_LAYERS}: {exc}") from None

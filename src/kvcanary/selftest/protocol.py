"""What an engine implements to be self-tested, and what a fault is: the engine-neutral contract.

A *fault* is written against the engine (its allocator, block tables, the index tensors it builds, its
block copies, offload restore, sampled token ids, the KV bytes), never against the canary: the canary must
find out by itself.  Each fault class carries a :class:`FaultSpec` -- the bug class it models, an example
issue of that class in a real engine's tracker, whether the canary is expected to detect it and by which
check, or why it cannot -- and installs its hooks on an engine-specific context (a subclass of
:class:`Injector`).

Injection is two-phase so that the injected step is a *random eligible* one: on the clean control run every
fault only *probes* (its hooks call :meth:`Injector.take`, which records the step as an opportunity and
returns False); the faulted run, identical to the control up to that point (same seed, deterministic
engine), gets one recorded step as its target and :meth:`Injector.take` returns True there, once.

An engine's :class:`EngineDriver` runs one workload with a list of faults in either mode and returns a
:class:`RunOutcome`: the canary's reports and counters, what was injected, and the read oracle's first
affected read (see :mod:`kvcanary.selftest.read_oracle`).  :mod:`kvcanary.selftest.runner` does the rest.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import importlib
import random
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Generic, TypeVar

from kvcanary.adapters.patching import PatchSet, Wrapper
from kvcanary.runtime import StepReport


class Expect(enum.StrEnum):
    DETECT = "detect"
    MISS = "miss"


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    name: str
    bug_class: str  # short: what goes wrong, in the catalogue's vocabulary
    catalogue: str  # the real bug(s) it models: engine and example issue(s)
    mechanism: str  # what the fault does to the engine, one sentence
    model: str  # the driver's workload kind it runs on (transformers: "dense" or "hybrid")
    expected: Expect
    check: str  # the check expected to fire ("phase: reason/reason"), or "none"
    checks: frozenset[tuple[str, str]] = frozenset()  # (phase, reason) pairs that count as the expected check
    why_miss: str = ""  # for Expect.MISS: why the token/position/link checks cannot see it


class InjectMode(enum.Enum):
    PROBE = "probe"  # record opportunities, change nothing (the clean control)
    INJECT = "inject"  # corrupt once, at the first opportunity at or after the target step


@dataclasses.dataclass
class Injection:
    step: int  # canary step label when the corruption happened (the next forward's step between steps)
    detail: str
    requests: tuple[str, ...]  # the requests whose KV or mapping was corrupted (for attribution)


@dataclasses.dataclass(frozen=True)
class AffectedRead:
    """The read oracle's verdict: the first step at which attention received K/V a correct engine would not
    have given it."""

    step: int
    requests: tuple[str, ...]
    layer: int
    entries: int  # read entries (request, position) that differed in that layer
    diverged: bool  # some read prefix has no clean reference (the engine believes in a history no clean run had)


class Injector:
    """The engine-neutral part of a fault's context: probe/inject bookkeeping, error capture and patches.

    An engine's context subclasses it, adds the engine objects its faults touch and implements
    :attr:`step` (the canary step the next or current forward gets).
    """

    def __init__(self, mode: InjectMode, *, rng: random.Random, target: tuple[str, int] | None = None) -> None:
        if mode is InjectMode.INJECT and target is None:
            raise ValueError("inject mode needs a target (fault name, step)")
        self.mode = mode
        self.rng = rng
        self.target = target
        self.opportunities: dict[str, list[int]] = {}
        self.injection: Injection | None = None
        self.errors: list[BaseException] = []
        self.stop_requested = False
        self.request_stop: Callable[[], None] = lambda: None  # set by the driver: end the run early
        self.patches = PatchSet(exclusive=False)  # on engine objects, inside the adapter's class patches

    @property
    def step(self) -> int:
        raise NotImplementedError

    def take(self, name: str) -> bool:
        """Called by a fault's hook where it *could* corrupt now.  Probe: note the step, return False.
        Inject: True once, for the target fault at or after its target step."""
        if self.injection is not None and self.mode is InjectMode.INJECT:
            return False
        if self.mode is InjectMode.PROBE:
            steps = self.opportunities.setdefault(name, [])
            if not steps or steps[-1] != self.step:
                steps.append(self.step)
            return False
        return self.target is not None and name == self.target[0] and self.step >= self.target[1]

    def injected(self, detail: str, requests: Sequence[str] = ()) -> None:
        self.injection = Injection(self.step, detail, tuple(requests))

    def guard(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Run ``fn``; an exception of the fault's own code is recorded (the trial errors) instead of
        reaching the engine, which would fail every request."""

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # recorded and reported as a harness error, never swallowed silently
                self.errors.append(exc)
                return None

        return guarded

    def wrap(self, obj: Any, name: str, make: Wrapper) -> None:
        """Replace ``obj.name`` on this object only (engine objects live for one run; the driver restores
        them).  ``make`` gets the current bound callable, so the adapter's class-level wrappers run inside."""
        self.patches.wrap(obj, name, make)


C = TypeVar("C", bound=Injector, contravariant=True)


class Fault(abc.ABC, Generic[C]):
    """One fault of an engine's library; ``install`` places its hooks on the engine objects of ``ctx``."""

    spec: ClassVar[FaultSpec]

    @abc.abstractmethod
    def install(self, ctx: C) -> None: ...

    @property
    def name(self) -> str:
        return self.spec.name


@dataclasses.dataclass
class RunOutcome:
    """One workload run, as the runner judges it."""

    stats: dict[str, int]  # the canary's counters (``violations``, ``steps``...)
    features: dict[str, int]  # what engine features the run exercised
    reports: list[StepReport]  # the canary's reports, in step order (a few are enough: the first matters)
    seconds: float
    opportunities: dict[str, list[int]]  # probe mode: each fault's eligible steps
    injection: Injection | None
    affected: AffectedRead | None  # the read oracle's first affected read
    later_reads: list[int]  # steps after the first affected read whose batch holds an affected request
    store: object  # probe mode: the oracle's clean reference, handed to the inject runs of the same seed
    errors: list[str]  # harness errors (a fault's own code failed) and engine failures
    stopped_early: bool = False

    @property
    def violations(self) -> int:
        return int(self.stats.get("violations", 0))


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run as the runner asks a driver for it.

    PROBE: the clean control (faults record opportunities, the read oracle records its reference into the
    outcome's ``store``); INJECT: ``target = (fault name, step)``, and the oracle checks reads against
    ``store`` (the control's reference) from the injection on.
    """

    kind: str  # the workload kind (one of the driver's ``workloads``)
    seed: int
    faults: Sequence[Fault[Any]]
    mode: InjectMode = InjectMode.PROBE
    target: tuple[str, int] | None = None
    store: object = None  # INJECT: the probe run's ``RunOutcome.store``, passed through untouched

    def rng(self) -> random.Random:
        """The faults' random choices: the same for the same seed and target."""
        return random.Random(f"{self.seed}:{self.target}")


class EngineUnavailable(RuntimeError):
    """The engine (or its self-test) cannot run here: not installed, unsupported version, no device."""


class EngineDriver(abc.ABC):
    """What ``kvcanary selftest --engine NAME`` needs from an engine (see docs/architecture.md).

    The engine's package ``kvcanary.adapters.<engine>.selftest`` exposes ``driver() -> EngineDriver``.  A
    driver names its engine, fault library and workloads, says where its version check lives and how the
    matrix's title reads; it implements :meth:`session` and :meth:`run`.
    """

    name: ClassVar[str]  # the engine, as reports name it
    faults: ClassVar[Mapping[str, type[Fault[Any]]]]  # the engine's fault library, in matrix order
    workloads: ClassVar[Sequence[str]]  # workload kinds, in matrix order; every fault's ``spec.model`` is one
    version_module: ClassVar[str]  # the adapter's module whose ``check_version()`` names the engine's version
    needs: ClassVar[str]  # what the self-test needs, as :class:`EngineUnavailable` says it
    title: ClassVar[str]  # the matrix's title, ``{version}`` filled in

    def check(self) -> str:
        """The engine's version; :class:`EngineUnavailable` when it cannot run here."""
        from kvcanary.adapters.base import UnsupportedEngineVersion

        try:
            return str(importlib.import_module(self.version_module).check_version())
        except (ImportError, UnsupportedEngineVersion) as exc:
            raise EngineUnavailable(f"{self.needs}: {exc}") from exc

    def describe(self, version: str) -> str:
        """The engine as the matrix's title names it, e.g. ``transformers 5.24.0 continuous batching``."""
        return self.title.format(version=version)

    @abc.abstractmethod
    def session(self, kinds: Sequence[str]) -> AbstractContextManager[None]:
        """Set up for a series of runs of these workload kinds (models, log levels) and tear down after."""

    @abc.abstractmethod
    def run(self, spec: RunSpec) -> RunOutcome:
        """Run ``spec`` once, deterministically for its seed, with every fault installed (see :class:`RunSpec`)."""

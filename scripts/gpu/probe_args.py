"""The command line the demo probes share (``--model``, ``--device``), parsed into demo options, and their clocks
(scripts/gpu only)."""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvcanary import demo
from kvcanary.adapters.patching import PatchSet


def demo_parser(description: str, default_model: str = "dense") -> argparse.ArgumentParser:
    """The shared ``--model`` and ``--device`` options; a probe adds its own before parsing."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=default_model, choices=demo.MODEL_KINDS)
    p.add_argument("--device", default="cuda")
    return p


def options_of(args: argparse.Namespace, **extra: object) -> demo.DemoOptions:
    """The demo options the parsed ``args`` name (and ``extra`` fields of :class:`~kvcanary.demo.DemoOptions`)."""
    return demo.DemoOptions(model=args.model, device=args.device, **extra)


def demo_options(description: str, default_model: str = "dense") -> demo.DemoOptions:
    """For a probe with no options of its own: parse the shared ones."""
    return options_of(demo_parser(description, default_model).parse_args())


def timed(original: Callable[..., Any], key: str, ns: collections.Counter[str]) -> Callable[..., Any]:
    """``original`` with its host time added to ``ns[key]`` and its calls counted in ``ns[key + "_calls"]``."""

    def run(*a: Any, **k: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return original(*a, **k)
        finally:
            ns[key] += time.perf_counter_ns() - start
            ns[key + "_calls"] += 1

    return run


@contextlib.contextmanager
def clocks(ns: collections.Counter[str], pieces: Iterable[tuple[str, Any, str]]) -> Iterator[PatchSet]:
    """Each ``(key, owner, attribute)`` of ``pieces`` timed into ``ns`` (:func:`timed`) while inside; the patch set is
    yielded for the caller's own wraps, and every original is put back after."""
    patches = PatchSet(exclusive=False)  # a probe's clocks, over kvcanary's patches or its own functions: none refused
    try:
        for key, owner, name in pieces:
            patches.wrap(owner, name, functools.partial(timed, key=key, ns=ns))
        yield patches
    finally:
        patches.restore()

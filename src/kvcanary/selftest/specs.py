"""A fault library's specs as data: an engine's ``faults.toml`` beside its fault classes, in matrix order.

Each table is one fault (its name the key): the :class:`~kvcanary.selftest.protocol.FaultSpec` fields, with
``checks`` a list of ``[phase, reason]`` pairs, and ``class``, the ``module.Class`` that implements it, so a
reader goes from a row of the matrix to its code.  Each fault class takes its spec from the loaded
mapping by name.
"""

from __future__ import annotations

import tomllib
import types
from importlib import resources
from typing import Any

from kvcanary.selftest.protocol import Expect, FaultSpec


def _spec(name: str, entry: dict[str, Any]) -> FaultSpec:
    return FaultSpec(
        name=name,
        bug_class=entry["bug_class"],
        catalogue=entry["catalogue"],
        mechanism=entry["mechanism"],
        model=entry["model"],
        expected=Expect(entry["expected"]),
        check=entry["check"],
        checks=frozenset((phase, reason) for phase, reason in entry.get("checks", ())),
        why_miss=entry.get("why_miss", ""),
    )


def load_specs(package: str) -> tuple[types.MappingProxyType[str, FaultSpec], types.MappingProxyType[str, str]]:
    """``package``'s ``faults.toml``: fault name -> spec, and fault name -> the ``module.Class`` implementing it."""
    text = resources.files(package).joinpath("faults.toml").read_text(encoding="utf-8")
    table = tomllib.loads(text)
    specs = {name: _spec(name, entry) for name, entry in table.items()}
    classes = {name: str(entry["class"]) for name, entry in table.items()}
    return types.MappingProxyType(specs), types.MappingProxyType(classes)

"""The transformers fault library's specs, read from ``faults.toml`` (the catalogue as data, in matrix order).

Each fault class takes its :class:`~kvcanary.selftest.protocol.FaultSpec` from :data:`SPECS` by name; the
file names the class (``module.Class``) so a reader goes from a row of the matrix to its code.
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


def _load() -> tuple[types.MappingProxyType[str, FaultSpec], types.MappingProxyType[str, str]]:
    text = resources.files(__package__).joinpath("faults.toml").read_text(encoding="utf-8")
    table = tomllib.loads(text)
    specs = {name: _spec(name, entry) for name, entry in table.items()}
    classes = {name: str(entry["class"]) for name, entry in table.items()}
    return types.MappingProxyType(specs), types.MappingProxyType(classes)


SPECS, CLASSES = _load()  # fault name -> spec; fault name -> "module.Class" that implements it

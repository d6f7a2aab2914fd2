"""The transformers fault library's specs, read from ``faults.toml`` (:mod:`kvcanary.selftest.specs`)."""

from __future__ import annotations

from kvcanary.selftest.specs import load_specs

SPECS, CLASSES = load_specs(__package__)  # fault name -> spec; fault name -> "module.Class" that implements it

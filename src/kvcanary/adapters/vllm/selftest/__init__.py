"""The vLLM self-test: fault library (:mod:`.faults`), copy-on-write relocations (:mod:`.cow`), engine
context and read-oracle tap (:mod:`.context`), and the driver (:mod:`.driver`) that
``kvcanary selftest --engine vllm`` runs."""

from __future__ import annotations

from kvcanary.adapters.vllm.selftest.engine import VllmDriver


def driver() -> VllmDriver:
    return VllmDriver()


__all__ = ["VllmDriver", "driver"]

"""Loggers held at ERROR for a while: the self-test and the demo print their own report, so the canary's and
the engine's log lines (every faulted run logs its violations) would only bury it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """Set the named loggers to ERROR inside the block; their own levels come back after it."""
    levels = {name: logging.getLogger(name).level for name in names}
    try:
        for name in names:
            logging.getLogger(name).setLevel(logging.ERROR)
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)

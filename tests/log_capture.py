"""A logging handler that keeps the messages reaching it: what the canary logged, for tests to read."""

from __future__ import annotations

import logging


class Messages(logging.Handler):
    """Keeps every message at ``level`` (default WARNING) or above, in order."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

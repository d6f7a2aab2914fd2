"""Session set-up and the fixtures several test modules share (their helpers are imported lazily: the engine
suites run with this file in venvs of their own)."""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before anything imports
# kvcanary.ops.kernels.  Without a GPU the kernels can only run under the interpreter; with one, the
# kernel tests use CUDA tensors and compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Counts of validate_batch calls, launcher state checks and kernel launches (the kernels stand in)."""
    from op_counting import count_step_work

    return count_step_work(monkeypatch)


@pytest.fixture(scope="module")
def faulted_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The event log of a real transformers run with a fault, and its stats."""
    from report_logs import faulted_log_run

    return faulted_log_run(tmp_path_factory)


@pytest.fixture(scope="module")
def clean_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The event log of the same run without a fault."""
    from report_logs import clean_log_run

    return clean_log_run(tmp_path_factory)

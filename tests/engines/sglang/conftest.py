"""sglang engine tests: collected only where sglang is importable (the .venv-sglang job).

In the main suite these files are ignored outright (no import of sglang, no skip noise).  Here, the
environment sglang's in-process scheduler needs is prepared first (Triton's interpreter for sglang's
scheduling kernels, the ground-truth snapshot; see ``kvcanary.adapters.sglang.selftest.scheduler_loop``),
then the sglang modules are imported once with their import-time UserWarnings silenced (CUDA-only
quantisation notices), since the project's pytest config turns warnings into errors.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

import pytest

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py", "sglang_harness.py", "sglang_model.py"]
else:
    from kvcanary.adapters.sglang.selftest.scheduler_loop import prepare_environment

    prepare_environment()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in (
            "sglang.srt.layers.attention.torch_native_backend",
            "sglang.srt.mem_cache.radix_cache",
            "sglang.srt.mem_cache.swa_memory_pool",
            "sglang.srt.speculative.eagle_info",
            "sglang.srt.managers.scheduler",
        ):
            importlib.import_module(module)


@pytest.fixture(scope="session")
def scheduler_loop():
    """sglang's real scheduler, once per process (sglang builds its process groups once); reset per test."""
    from kvcanary.adapters.sglang.selftest.scheduler_loop import SchedulerLoop

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loop = SchedulerLoop()
    yield loop
    loop.reset()


@pytest.fixture
def loop(scheduler_loop):
    scheduler_loop.reset()
    yield scheduler_loop
    scheduler_loop.reset()

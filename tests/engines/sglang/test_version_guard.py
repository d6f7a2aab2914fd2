"""SUPPORTED_SGLANG_VERSIONS acts: install_canary refuses any other sglang release before touching the runner."""

from __future__ import annotations

import importlib.metadata

import pytest
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang_model import DTYPE, HEAD_DIM, HEADS, TinyModel, TinyRunner, server_args

from kvcanary.adapters.base import UnsupportedEngineVersion
from kvcanary.adapters.sglang import SUPPORTED_SGLANG_VERSIONS, install_canary
from kvcanary.adapters.sglang import version as sglang_version


def _runner() -> TinyRunner:
    rtp = ReqToTokenPool(size=3, max_context_len=32, device="cpu", enable_memory_saver=False)
    pool = MHATokenToKVPool(32, 1, DTYPE, HEADS, HEAD_DIM, layer_num=2, device="cpu", enable_memory_saver=False)
    return TinyRunner(rtp, pool, TinyModel(), server_args(kv_canary="log"))


def _pretend_installed(monkeypatch: pytest.MonkeyPatch, version: str | None) -> None:
    real = importlib.metadata.version

    def fake(name: str) -> str:
        if name != "sglang":
            return real(name)
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(sglang_version.importlib.metadata, "version", fake)


def test_the_installed_sglang_is_the_supported_one() -> None:
    assert sglang_version.check_version() == importlib.metadata.version("sglang") in SUPPORTED_SGLANG_VERSIONS


@pytest.mark.parametrize("found", ["0.5.24", "0.4.9"])
def test_another_sglang_release_is_refused_before_anything_is_patched(monkeypatch, found: str) -> None:
    _pretend_installed(monkeypatch, found)
    runner = _runner()
    with pytest.raises(UnsupportedEngineVersion, match=rf"supports sglang 0\.5\.23, but {found} is installed"):
        install_canary(runner)
    assert "forward" not in vars(runner.model) and "forward" not in vars(runner)  # nothing patched
    assert not hasattr(runner.token_to_kv_pool, "_kvcanary_attached")  # the pool left free
    canary = install_canary(runner, allow_untested_version=True)  # the documented escape hatch
    assert canary is not None
    canary.uninstall()


def test_no_sglang_distribution_is_refused_and_mode_none_never_checks(monkeypatch) -> None:
    _pretend_installed(monkeypatch, None)
    with pytest.raises(UnsupportedEngineVersion, match="no installed sglang distribution"):
        install_canary(_runner())
    assert install_canary(_runner(), server_args(kv_canary="none")) is None  # off: no check, no error

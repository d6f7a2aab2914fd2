"""The transformers adapter's install machinery, without running the engine: the patch set, the declared patches
against the installed transformers, the version check, the adapter registry and the pinned-memory shim."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from kvcanary.adapters import ADAPTERS, UnsupportedEngineVersion, load_adapter
from kvcanary.adapters.patching import AlreadyPatched, PatchSet
from kvcanary.adapters.transformers_cb import cpu_offload, patches
from kvcanary.adapters.transformers_cb.version import SUPPORTED_VERSIONS, check_version


def test_patch_set_restores_originals_and_refuses_a_second_kvcanary_patch() -> None:
    class Engine:
        def step(self) -> str:
            return "engine"

    class Child(Engine):
        pass

    original = Engine.__dict__["step"]
    p = PatchSet()
    p.wrap(Child, "step", lambda orig: lambda self: "child " + orig(self))  # inherited: restored by deletion
    p.wrap(Engine, "step", lambda orig: lambda self: "wrapped " + orig(self))
    assert Child().step() == "child engine" and Engine().step() == "wrapped engine"
    with pytest.raises(AlreadyPatched):
        PatchSet().wrap(Engine, "step", lambda orig: orig)
    p.restore()
    p.restore()
    assert Engine.__dict__["step"] is original and "step" not in Child.__dict__


def test_patch_set_on_an_object_wraps_what_lookup_finds_and_restores_it() -> None:
    class Engine:
        def step(self) -> str:
            return "engine"

    exclusive = PatchSet()
    exclusive.wrap(Engine, "step", lambda orig: lambda self: "adapter " + orig(self))
    engine = Engine()
    faults = PatchSet(exclusive=False)  # inside an installed adapter: wraps the adapter's wrapper
    faults.wrap(engine, "step", lambda orig: lambda: "fault " + orig())
    assert engine.step() == "fault adapter engine" and "step" in vars(engine)
    faults.restore()
    assert "step" not in vars(engine) and engine.step() == "adapter engine"
    exclusive.restore()
    assert engine.step() == "engine"


def test_every_declared_patch_names_a_symbol_of_the_supported_transformers() -> None:
    pytest.importorskip("transformers")
    assert check_version() in SUPPORTED_VERSIONS
    assert patches.PATCHES and patches.missing() == []
    assert {p.role for p in patches.PATCHES} == set(patches.Role)
    keys = [(p.owner, p.method) for p in patches.PATCHES]
    assert len(keys) == len(set(keys))  # one entry a method: the adapter finds each wrapper by (class, method)
    gone = patches.EnginePatch("model_runner", "ModelRunner", "no_such_method", patches.Role.CRITICAL, "test")
    assert patches.missing((gone,)) == [gone]


class _TinyCBModel(torch.nn.Module):
    def generate_batch(self) -> None: ...


def test_install_refuses_a_missing_critical_patch_by_name_and_skips_a_missing_counter(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("transformers")
    from kvcanary.adapters.transformers_cb import install

    declared = patches.PATCHES
    counter = patches.EnginePatch("cache", "PagedAttentionCache", "gone_counter", patches.Role.COUNTER, "a counter")
    saving = patches.EnginePatch("cache", "PagedAttentionCache", "gone_saving", patches.Role.SAVING, "joined moves")
    monkeypatch.setattr(patches, "PATCHES", (counter, saving))
    adapter = install(_TinyCBModel())
    assert adapter.installed and "gone_counter is missing; the a counter counter" in caplog.text
    assert "gone_saving is missing; no joined moves (the canary is as correct)" in caplog.text
    adapter.uninstall()
    critical = patches.EnginePatch("model_runner", "ModelRunner", "gone_tap", patches.Role.CRITICAL, "the tap")
    tap = next(p for p in declared if p.method == "compute_batch")
    monkeypatch.setattr(patches, "PATCHES", (tap, critical))
    with pytest.raises(RuntimeError, match=r"ModelRunner\.gone_tap"):
        install(_TinyCBModel())
    from transformers.generation.continuous_batching import model_runner

    assert not hasattr(model_runner.ModelRunner.compute_batch, "__kvcanary_original__")  # refused before patching


def test_version_check_names_the_supported_versions() -> None:
    assert check_version(SUPPORTED_VERSIONS[0]) == SUPPORTED_VERSIONS[0]
    with pytest.raises(UnsupportedEngineVersion, match=r"supports transformers 5\.24\.0, but 5\.23\.0"):
        check_version("5.23.0")
    assert check_version("5.23.0", allow_untested=True) == "5.23.0"


def test_registry_is_lazy_and_names_its_adapters() -> None:
    assert set(ADAPTERS) == {"sglang", "transformers-cb", "vllm"}
    with pytest.raises(ValueError, match="transformers-cb"):
        load_adapter("no-such-engine")
    code = (
        "import sys, kvcanary, kvcanary.adapters, kvcanary.adapters.transformers_cb, kvcanary.selftest; "
        "assert not {'transformers', 'sglang', 'vllm'} & set(sys.modules), 'an engine was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_load_adapter_imports_the_install_function() -> None:
    install = load_adapter("transformers-cb")
    assert install.__module__ == "kvcanary.adapters.transformers_cb.adapter" and install.__name__ == "install"


def test_unpinned_torch_drops_pin_memory_only_inside_the_wrapped_constructor() -> None:
    module = types.ModuleType("fake_offloading_manager")
    module.torch = torch  # type: ignore[attr-defined]
    seen = []

    def init(self: object, n: int) -> None:
        seen.append(module.torch.empty(n, dtype=torch.uint8, pin_memory=True).shape[0])

    wrapped = cpu_offload.wrap_offloading_init(init, module)
    if cpu_offload.accelerator_available():
        pytest.skip("an accelerator exists: the constructor runs unchanged")
    wrapped(object(), 16)
    assert seen == [16] and module.torch is torch

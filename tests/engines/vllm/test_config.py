"""Start-up configuration: the plugin in a real ``vllm`` process, and one clear error for each bad setting
(unknown mode, unsupported vLLM version, a KV layout the adapter does not know), nothing left patched."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from kvcanary.adapters.base import UnsupportedEngineVersion
from kvcanary.adapters.vllm import install, plugin
from kvcanary.adapters.vllm.attach import find_runner

ORIGINAL = "__kvcanary_original__"


def _runner_classes_unpatched() -> bool:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return not hasattr(GPUModelRunner.initialize_kv_cache, ORIGINAL) and not hasattr(
        Scheduler.update_from_output, ORIGINAL
    )


def test_unknown_mode_is_refused_at_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCANARY_MODE", "loud")
    with pytest.raises(ValueError, match=r"KVCANARY_MODE='loud' is not a kvcanary mode; choose one of: log, raise"):
        plugin.register()
    assert _runner_classes_unpatched()


def test_unsupported_version_is_refused_at_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setenv("KVCANARY_MODE", "log")
    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    with pytest.raises(UnsupportedEngineVersion, match=r"supports vLLM 0\.32\.0, but 0\.31\.1 is installed"):
        plugin.register()
    assert _runner_classes_unpatched()


def test_mode_off_registers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCANARY_MODE", raising=False)
    plugin.register()
    assert _runner_classes_unpatched()


def test_unknown_kv_layout_is_refused_before_any_patch(llm: Any) -> None:
    from vllm.v1.kv_cache_interface import MambaSpec

    runner = find_runner(llm)
    real = runner.kv_cache_config
    fake = copy.copy(real)
    group = copy.copy(real.kv_cache_groups[0])
    group.kv_cache_spec = MambaSpec(
        block_size=32, shapes=((1,),), dtypes=(real.kv_cache_groups[0].kv_cache_spec.dtype,)
    )
    fake.kv_cache_groups = [group]
    runner.kv_cache_config = fake
    try:
        with pytest.raises(
            ValueError, match="KV cache group 0 uses MambaSpec, a KV layout the vLLM adapter does not know"
        ):
            install(llm, "fail-request")
    finally:
        runner.kv_cache_config = real
    assert not {"_update_states", "execute_model", "_model_forward", "sample_tokens"} & set(vars(runner))
    assert getattr(runner, "kvcanary", None) is None
    assert _runner_classes_unpatched()


_PLUGIN_RUN = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    from vllm import LLM, SamplingParams
    from kvcanary.adapters.vllm import tiny
    if __name__ == "__main__":  # the engine core starts as a spawned process
        llm = LLM(model=sys.argv[1], **tiny.engine_kwargs())
        prompts = [{"prompt_token_ids": list(range(10, 80)) + [100 + i]} for i in range(4)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        print("GENERATED", sum(len(o.outputs[0].token_ids) for o in outs))
    """
)


def _run_plugin(model_dir: str, tmp_path: pathlib.Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "run.py"
    script.write_text(_PLUGIN_RUN)
    full = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **env}  # the engine core in its own process
    return subprocess.run(
        [sys.executable, str(script), model_dir], env=full, capture_output=True, text=True, timeout=400, check=False
    )


def test_plugin_runs_the_canary_inside_the_engine_core_process(model_dir: str, tmp_path: pathlib.Path) -> None:
    events = tmp_path / "events.jsonl"
    run = _run_plugin(model_dir, tmp_path, KVCANARY_MODE="log", KVCANARY_EVENTS=str(events), KVCANARY_STATS_EVERY="1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "GENERATED 32" in run.stdout
    stats = [e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "stats"]
    assert stats and stats[-1]["verified_slots"] > 0 and stats[-1]["violations"] == 0, stats[-1:]


def test_plugin_refuses_an_unknown_mode_at_start_up(model_dir: str, tmp_path: pathlib.Path) -> None:
    run = _run_plugin(model_dir, tmp_path, KVCANARY_MODE="loud")
    assert run.returncode != 0
    assert "KVCANARY_MODE='loud' is not a kvcanary mode" in run.stderr
    assert "GENERATED" not in run.stdout

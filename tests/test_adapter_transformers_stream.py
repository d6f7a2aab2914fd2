"""The transformers adapter issues all of a step's canary work -- including the host step's copy of the
step's counters -- inside the engine's compute-stream context.

On a GPU the engine's streams do not synchronise with the default stream: a host step issued outside the
compute stream copied the counters before the canary's kernels had run, and clean steps were reported as
"no canary device work ran" (issue 14, Qwen3-0.6B-shaped model on the H200).  On CPU there are no streams,
so the test records, through the adapter's stream context, where each host step was issued.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

import compiled_build

pytest.importorskip("transformers")

from kvcanary.runtime import CanaryManager, streams
from transformers_helpers import demo_run


@compiled_build.patches("kvcanary.runtime.manager")
def test_every_host_step_is_issued_inside_the_engine_stream_context(monkeypatch: pytest.MonkeyPatch) -> None:
    depth = [0]
    seen: list[int] = []
    real_stream = streams.StreamSwitch
    real_host_step = CanaryManager.host_step

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        with real_stream(s):
            depth[0] += 1
            try:
                yield
            finally:
                depth[0] -= 1

    def host_step(self: CanaryManager, *args: Any, **kwargs: Any) -> Any:
        seen.append(depth[0])
        return real_host_step(self, *args, **kwargs)

    monkeypatch.setattr(streams, "StreamSwitch", stream)
    monkeypatch.setattr(CanaryManager, "host_step", host_step)
    result = demo_run("dense", requests=6)
    assert result.stats["steps"] == len(seen) > 0
    assert set(seen) == {1}, seen

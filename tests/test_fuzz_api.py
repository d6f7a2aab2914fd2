"""Property-based fuzzing of the public API: random and corrupt steps through CanaryManager.

Each example is one of :mod:`gen`'s cases (a small world; corrupt tables, lookups, records, batch
values and capacities), run through a :class:`~kvcanary.runtime.CanaryManager` in log mode, on the
reference path and on the kernel path (Triton interpreter on the CPU), optionally after one API-level
mutation of the batch (a wrong dtype, rank, length or device; a missing or extra group).  Properties:

* the manager either refuses the step with the documented errors (TypeError or ValueError) or runs it;
  nothing else escapes (an out-of-range index on the reference path is an IndexError/RuntimeError);
* a refused call changes nothing: records, plan epoch, live log and stats are as before;
* a step that runs yields the same stats and report counts on both paths (a kernel's out-of-range read
  or write would show as a difference; the Triton interpreter itself faults on wild pointers).

Budget: KVCANARY_FUZZ_EXAMPLES examples per property (default 20: the CI budget, well under 60 s);
for a longer local run, e.g. ``KVCANARY_FUZZ_EXAMPLES=2000 .venv/bin/pytest tests/test_fuzz_api.py``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gen
from kvcanary import CanaryConfig, Mode, StepBatch
from kvcanary.ops import Backend
from kvcanary.runtime import CanaryManager

EXAMPLES = int(os.environ.get("KVCANARY_FUZZ_EXAMPLES", "20"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
FIELDS = [f.name for f in dataclasses.fields(StepBatch)]
MUTATIONS = ("none", "float_dtype", "int16_dtype", "extra_dim", "scalar", "drop_last", "meta_device",
             "not_a_tensor", "missing_group", "extra_group")  # fmt: skip


def _mutate_tensor(t: torch.Tensor, how: str) -> Any:
    if how == "float_dtype":
        return t.float()
    if how == "int16_dtype":
        return t.to(torch.int16)
    if how == "extra_dim":
        return t.unsqueeze(0)
    if how == "scalar":
        return t.reshape(-1)[:1].reshape(()) if t.numel() else torch.tensor(0, dtype=t.dtype)
    if how == "drop_last":
        return t[:-1]
    if how == "meta_device":
        return t.to("meta")
    return [int(v) for v in t.reshape(-1).tolist()]  # not_a_tensor


def _batches(case: gen.Case, how: str, field: str) -> dict[str, Any]:
    name = case.group.name
    if how == "missing_group":
        return {}
    if how == "extra_group":
        return {name: case.batch, name + "-unknown": case.batch}
    if how == "none":
        return {name: case.batch}
    tensors = case.batch.tensors()
    present = [f for f in FIELDS if tensors[f] is not None]
    target = field if field in present else present[0]
    tensors[target] = _mutate_tensor(tensors[target], how)  # type: ignore[arg-type]
    return {name: StepBatch(**tensors)}  # type: ignore[arg-type]


def _manager(case: gen.Case, backend: Backend) -> CanaryManager:
    mgr = CanaryManager([case.group], case.caps, CanaryConfig(mode=Mode.LOG), backend=backend)
    records = mgr.canaries[case.group.name].records
    for mine, theirs in ((records.tokens, case.records.tokens), (records.positions, case.records.positions),
                         (records.links, case.records.links)):  # fmt: skip
        mine.copy_(theirs)  # the case's warmed-up records: most verify entries pass
    mgr.canaries[case.group.name].workspace.epoch.copy_(case.ws.epoch)
    return mgr


def _state(mgr: CanaryManager) -> list[torch.Tensor | dict[str, int]]:
    canary = next(iter(mgr.canaries.values()))
    r = canary.records
    return [r.tokens.clone(), r.positions.clone(), r.links.clone(), canary.workspace.epoch.clone(),
            mgr._work.live.clone(), mgr._work.outbox.clone(), mgr.stats()]  # fmt: skip


def _same(a: list[torch.Tensor | dict[str, int]], b: list[torch.Tensor | dict[str, int]]) -> bool:
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


def _run(case: gen.Case, backend: Backend, how: str, field: str) -> tuple[str, Any]:
    """('refused', exception type) or ('ran', (stats, report counts)); asserts a refusal changed nothing."""
    mgr = _manager(case, backend)
    before = _state(mgr)
    try:
        batches = _batches(case, how, field)
        mgr.before_forward(batches)
    except (TypeError, ValueError) as exc:
        assert _same(before, _state(mgr)), f"a refused call changed the state: {exc}"
        mgr.close()
        return "refused", type(exc)
    mgr.after_forward()
    report = mgr.host_step([f"req-{i}" for i in range(case.batch.batch_size)])
    assert report is None  # the lagged pump reports step k at step k + 1
    report = mgr.flush()
    counts = None if report is None else dict(report.counts)
    stats = mgr.stats()
    mgr.close()
    return "ran", (stats, counts)


cases = st.builds(gen.random_case, st.integers(0, 2**32 - 1), corrupt=st.booleans())
# Half the examples run unmutated (gen's corruptions alone), the rest try one API-level mutation.
mutations = st.one_of(st.just("none"), st.sampled_from(MUTATIONS[1:]))
fields = st.sampled_from(FIELDS)


@FUZZ
@given(case=cases, how=mutations, field=fields)
def test_reference_path_never_crashes_and_refusals_change_nothing(case: gen.Case, how: str, field: str) -> None:
    outcome, detail = _run(case, Backend.REFERENCE, how, field)
    if how in ("missing_group", "extra_group", "float_dtype", "meta_device", "not_a_tensor"):
        assert outcome == "refused", f"{how} on {field} was accepted: {case.describe()}"
    if outcome == "ran":
        stats, _ = detail
        assert stats["steps"] == 1 and stats["forwards"] == 1


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="no triton")
@settings(FUZZ, max_examples=max(EXAMPLES // 4, 3))  # the interpreter is ~100x slower per case
@given(case=cases, how=mutations, field=fields)
def test_kernel_path_agrees_with_reference(case: gen.Case, how: str, field: str) -> None:
    pytest.importorskip("triton")
    expected = _run(case.clone(), Backend.REFERENCE, how, field)
    got = _run(case.clone(), Backend.TRITON, how, field)
    assert got == expected, case.describe()

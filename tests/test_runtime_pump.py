"""The lagged pump's timing on a device that runs behind the host (events emulated on the CPU).

On CUDA each host step's copy of the outbox lands when the device reaches it; the pump polls its event
and decodes at most two steps behind, waiting only for a step two host steps old.  Here a fake event
lands a set number of host steps after it was recorded, so the lag rules are checked without a GPU:
the clean path never waits, each step is decoded exactly once and in order, findings keep their step,
and the counts equal the CPU's (where every copy has landed when taken).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

import compiled_build
from kvcanary import Mode
from kvcanary.runtime import CanaryManager, StepReport
from kvcanary.runtime.buffers import Layout
from kvcanary.runtime.pump import MAX_LAG, HostBuffer, LaggedPump
from runtime_helpers import Workload, alias_first_slot, make_manager, run_step

# These tests record the decoded steps by replacing the decoder's method on its instance (lagged_manager).
RECORDS_DECODES = compiled_build.patches("kvcanary.runtime.decode")


class Device:
    """The emulated device clock: ``now`` is the host step being run; an event lands ``delay(step)`` host
    steps after the one that recorded it."""

    def __init__(self, delays: list[int]) -> None:
        self.now = 0
        self.delays = delays
        self.waits: list[int] = []  # steps whose event had to be waited on
        self.queries = 0
        self.synchronizes = 0  # calls to synchronize, waiting or not


class FakeTransfer:
    """The pump's transfer on the emulated device: the copy is made at once (on the CPU), its event lands by the
    device clock."""

    def __init__(self, device: Device, copy: Callable[[], object]) -> None:
        self.device = device
        self.copy = copy
        self.at = -1
        self.step = -1
        self.sent = False

    def send(self, nbytes: int) -> None:
        self.copy()
        self.at = self.step = self.device.now
        self.sent = True

    def landed(self) -> bool:
        self.device.queries += 1
        return self.device.now - self.at >= self.device.delays[self.step]

    def wait(self) -> None:
        self.device.synchronizes += 1
        if not self.landed():
            self.device.waits.append(self.step)


def lagged_manager(delays: list[int], mode: Mode = Mode.LOG) -> tuple[CanaryManager, Device, list[int]]:
    mgr = make_manager(mode)
    device = Device(delays)
    for buf in mgr._pump.buffers:
        buf.transfer = FakeTransfer(device, buf.copy)  # type: ignore[assignment]
    decoded: list[int] = []
    decode = mgr._decoder.decode

    def recording_decode(buf: HostBuffer, reported_at: int) -> object:
        decoded.append(buf.step)
        return decode(buf, reported_at)

    mgr._decoder.decode = recording_decode  # type: ignore[method-assign,assignment]
    return mgr, device, decoded


def run(mgr: CanaryManager, device: Device, steps: int, fault_at: int | None = None) -> list[StepReport | None]:
    """The runtime tests' workload (two rows, prefill then decode), one host step per device clock tick."""
    wl = Workload()
    out = []
    for k in range(steps):
        device.now = k
        if k == fault_at:
            alias_first_slot(wl, victim=2, owner=1)
        n = 4 if k == 0 else 1
        out.append(run_step(mgr, wl.batch([(1, n), (2, n)]), ["req-a", "req-b"]))
    device.now = steps
    return out


@RECORDS_DECODES
@pytest.mark.parametrize("delay", [0, 1])
def test_a_copy_landed_by_the_next_host_step_is_decoded_then(delay: int) -> None:
    mgr, device, decoded = lagged_manager([delay] * 8)
    reports = run(mgr, device, 6, fault_at=3)
    hits = [(k, r.step) for k, r in enumerate(reports) if r is not None]
    assert hits[0] == (4, 3)
    assert decoded[:5] == [0, 1, 2, 3, 4] and device.waits == []
    assert device.synchronizes == 0  # a copy seen landed by its query costs no second call to the device


@RECORDS_DECODES
def test_a_device_one_step_behind_is_reported_two_steps_late_without_a_wait() -> None:
    mgr, device, decoded = lagged_manager([2] * 10)
    reports = run(mgr, device, 8, fault_at=3)
    first = next(r for r in reports if r is not None)
    assert first.step == 3 and first.reported_at == 5 and reports[5] is first
    assert all(r is None for r in reports[:5])
    assert device.waits == [] and device.queries > 0  # polled, never waited on
    assert decoded == [0, 1, 2, 3, 4, 5]  # step k decoded by host step k + 2
    mgr.flush()
    assert decoded == list(range(8))


@RECORDS_DECODES
def test_a_device_further_behind_is_waited_on_two_steps_back_only() -> None:
    mgr, device, decoded = lagged_manager([4] * 10)
    reports = run(mgr, device, 7, fault_at=2)
    first = next(r for r in reports if r is not None)
    assert first.step == 2 and first.reported_at == 4
    assert device.waits == [0, 1, 2, 3, 4]  # host step k waits for step k - 2, never for k - 1
    mgr.flush()
    assert decoded == list(range(7))


@RECORDS_DECODES
def test_jittery_device_counts_and_findings_equal_the_cpu_run() -> None:
    rng = random.Random(14)
    steps = 26  # the workload table holds 4 + 27 tokens a row
    cpu = make_manager(Mode.LOG)
    cpu_reports = run(cpu, Device([0] * steps), steps, fault_at=11)
    cpu_reports.append(cpu.flush())
    mgr, device, decoded = lagged_manager([rng.choice([0, 1, 2, 2, 3, 5]) for _ in range(steps)])
    reports = run(mgr, device, steps, fault_at=11)
    reports.append(mgr.flush())
    assert decoded == list(range(steps))  # every step once, in order
    assert mgr.stats() == cpu.stats() and mgr.stats()["violations"] > 0
    assert mgr.health_failure_counts() == {"kernels_ran": 0, "phase": 0}

    def found(rs: list[StepReport | None]) -> list[tuple[int, tuple[object, ...], int]]:
        return [(r.step, r.affected_request_ids, r.total) for r in rs if r is not None]

    during = found(reports[:-1])  # flush may merge the last two steps' reports into one
    assert during == found(cpu_reports)[: len(during)]
    assert sum(t for _, _, t in found(reports)) == sum(t for _, _, t in found(cpu_reports))
    late = [r.reported_at - r.step for r in reports[:-1] if r is not None]
    assert late and all(1 <= d <= MAX_LAG for d in late)


@RECORDS_DECODES
def test_flush_decodes_both_pending_steps_and_merges_their_reports() -> None:
    mgr, device, decoded = lagged_manager([9] * 8)
    run(mgr, device, 4, fault_at=2)  # the fault persists: steps 2 and 3 both have violations
    assert decoded == [0, 1]
    report = mgr.flush()
    assert decoded == [0, 1, 2, 3]
    assert report is not None and report.step == 2 and report.reported_at == 4
    assert report.affected_request_ids == ("req-b",)
    assert mgr.flush() is None


@RECORDS_DECODES
def test_a_clean_lagged_run_is_silent_and_healthy() -> None:
    mgr, device, _ = lagged_manager([2] * 30, Mode.RAISE)
    assert run(mgr, device, 25) == [None] * 25
    assert mgr.flush() is None
    assert mgr.stats()["steps"] == 25 and mgr.health_failure_counts() == {"kernels_ran": 0, "phase": 0}


def test_staging_refuses_to_run_more_than_two_steps_ahead_of_decoding() -> None:
    layout = Layout([4])
    pump = LaggedPump(torch.zeros(layout.outbox_size, dtype=torch.int64), layout)
    pump.stage(0, None)
    pump.stage(1, None)
    with pytest.raises(RuntimeError, match="step 0 was not decoded before staging step 2"):
        pump.stage(2, None)
    taken = pump.take_due(2)
    assert taken is not None and taken.step == 0 and pump.pending_steps == (1,)
    pump.stage(2, None)
    assert [b.step for b in pump.take_all()] == [1, 2] and pump.take_due(3) is None


@RECORDS_DECODES
def test_the_copy_fence_claims_only_copies_that_landed_or_were_waited_for() -> None:
    """Another copy queued on the pump's stream before host step s's (the staging's) has run once the fence's
    ``landed`` reaches s: so every step up to it must have landed by the device clock, or been waited for."""
    rng = random.Random(3)
    steps = 26
    delays = [rng.choice([0, 1, 2, 3, 5]) for _ in range(steps)]
    mgr, device, _ = lagged_manager(delays)
    fence = mgr.copy_fence
    assert fence is not None and fence.landed == -1
    wl, claimed = Workload(), []
    for k in range(steps):
        device.now = k
        assert fence.next_step == k  # the host step whose copy is queued next
        n = 4 if k == 0 else 1
        run_step(mgr, wl.batch([(1, n), (2, n)]), ["req-a", "req-b"])
        assert all(k - s >= delays[s] or s in device.waits for s in range(fence.landed + 1)), (k, fence.landed)
        claimed.append(fence.landed)
    assert claimed == sorted(claimed) and all(c >= k - MAX_LAG for k, c in enumerate(claimed))
    assert any(c < k - 1 for k, c in enumerate(claimed))  # the device ran behind: the fence held back
    mgr.flush()
    assert fence.landed == steps - 1 and fence.next_step == steps

"""The outbox published by the step's device work (``runtime/publish.py``, ``ops/kernels/outbox_publish.py``).

The kernel against its torch spec, word for word (sizes below, at and past one program's block); a manager that
publishes against one that copies, on the same steps and faults: the same reports and counts, whether its steps
replay a graph that publishes or publish at the host step; a second forward in one host step publishes nothing more;
a publish that never lands is copied, counted and realigned.  On the CPU under Triton's interpreter; the ``gpu``
tests compile the kernel and write pinned host memory from real CUDA graphs.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from kvcanary import CanaryGroup, Mode, StepBatch
from kvcanary.config import CanaryConfig
from kvcanary.ops import Backend
from kvcanary.runtime import CanaryManager, StepReport
from kvcanary.runtime.buffers import Layout
from kvcanary.runtime.publish import NUM_BUFFERS, OutboxPublisher, publish_reference
from kvcanary.runtime.pump import MAX_LAG, LaggedPump
from kvcanary.runtime.step_graphs import StepGraphs
from runtime_helpers import CAPS, NUM_SLOTS, Workload, alias_first_slot
from test_runtime_step_graphs import FakeGraph, run, run_cuda, with_fake_graphs

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
# The managers below run the kernels on the CPU: Triton's interpreter (a GPU machine runs the kernel test compiled).
cpu_kernels = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("size", [1, 7, 1024, 1031, 3001])
def test_the_publish_kernel_does_what_its_torch_spec_does(size: int) -> None:
    dev = torch.device("cuda") if CUDA else torch.device("cpu")
    gen = torch.Generator().manual_seed(size)
    outbox = torch.randint(-(2**62), 2**62, (size,), generator=gen, dtype=torch.int64).to(dev)
    block = torch.zeros(NUM_BUFFERS, size, dtype=torch.int64, pin_memory=CUDA)
    flags = torch.zeros(NUM_BUFFERS, dtype=torch.int64, pin_memory=CUDA)
    want_block, want_flags, want_state = block.clone(), flags.clone(), torch.zeros(2, dtype=torch.int64)
    publisher = OutboxPublisher(outbox, block, flags)
    for _ in range(2 * NUM_BUFFERS + 1):  # every buffer written twice: the slot and the count wrap
        outbox.add_(7)
        publisher.launch()
        publish_reference(outbox.cpu(), want_block, want_flags, want_state)
        if CUDA:
            torch.cuda.synchronize()
        assert torch.equal(block, want_block) and torch.equal(flags, want_flags)
        assert torch.equal(publisher.state.cpu(), want_state)  # the ticket back at zero for the next launch


def manager(publish: bool, device: str = "cpu") -> CanaryManager:
    group = CanaryGroup(num_slots=NUM_SLOTS, name="full")
    config = CanaryConfig(mode=Mode.LOG)
    return CanaryManager([group], CAPS, config, device=device, backend=Backend.TRITON, publish_outbox=publish)


def _summary(reports: list[StepReport | None]) -> list[tuple[int, int, int, tuple[object, ...]]]:
    return [(r.step, r.reported_at, r.total, r.affected_request_ids) for r in reports if r is not None]


@cpu_kernels
@pytest.mark.parametrize("graphs", [True, False], ids=["published-by-the-step-graph", "published-at-the-host-step"])
def test_a_publishing_manager_reports_what_a_copying_one_reports(graphs: bool) -> None:
    copying = manager(publish=False)
    want = run(copying, 10, fault_at=6, static=True)
    mgr = manager(publish=True)
    pump = mgr._pump
    assert pump.publisher is not None and all(b.transfer is None for b in pump.buffers)
    log = with_fake_graphs(mgr) if graphs else []
    got = run(mgr, 10, fault_at=6, static=True)
    assert ("replay" in log) is graphs  # the graph's work, publish included, ran on the replays
    assert _summary(got) == _summary(want) and _summary(got)  # the fault found, at the same steps
    assert mgr.stats() == copying.stats()
    assert mgr.health_failure_counts() == {"kernels_ran": 0, "phase": 0}
    assert int(pump.publisher.state[0]) == 10 and pump.publish_misses == 0  # one publish a host step


@cpu_kernels
def test_a_second_forward_in_one_host_step_runs_eagerly_and_publishes_nothing_more() -> None:
    mgr = manager(publish=True)
    log: list[str] = []
    mgr._graphs = StepGraphs(lambda work: FakeGraph(work, log), first_sight=True)  # every eager step captured
    copying = manager(publish=False)
    for m in (mgr, copying):
        wl = Workload()
        for k in range(5):
            batch = wl.batch([(1, 4 if k == 0 else 1)], truth=True)
            m.forward_step({"full": batch})
            if k == 3:
                m.forward_step({"full": wl.batch([(2, 2)], truth=True)})  # a second forward in host step 3
            m.host_step(["req-a"])
        m.flush()
    assert mgr._pump.publisher is not None and int(mgr._pump.publisher.state[0]) == 5
    assert mgr._pump.publish_misses == 0 and log.count("capture") == 5  # host step 3: one
    assert mgr.stats() == copying.stats()


@cpu_kernels
def test_a_publish_that_never_lands_is_copied_counted_and_the_publishes_realigned() -> None:
    layout = Layout([4])
    outbox = torch.arange(layout.outbox_size, dtype=torch.int64)
    pump = LaggedPump(outbox, layout, publish=True)
    assert pump.publisher is not None
    pump.stage(0, None)
    pump.published_step = 1  # as if host step 1's graph had published: its stage launches nothing
    pump.stage(1, None)
    first = pump.take_due(2)
    assert first is not None and first.step == 0 and first.landed() and pump.take_due(2) is None  # 1 not landed
    outbox.add_(100)  # the outbox as it is when step 1 is waited for
    second = pump.take_due(1 + MAX_LAG)  # two steps old: taken, and waited for
    assert second is not None and second.step == 1
    second.wait()
    assert pump.publish_misses == 1 and torch.equal(second.tensor, outbox)  # copied instead
    assert int(pump.publisher.state[0]) == pump.fence.next_step == 2  # the next publish is host step 2's
    pump.stage(2, None)
    third = pump.take_due(3)
    assert third is not None and third.step == 2 and third.landed() and pump.publish_misses == 1


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_step_graphs_that_publish_report_what_copying_eager_launches_report() -> None:
    eager = manager(publish=False, device="cuda")
    eager._graphs = None
    want = run_cuda(eager, 20, fault_at=11)
    mgr = manager(publish=True, device="cuda")
    pump = mgr._pump
    assert pump.publisher is not None and all(b.transfer is None for b in pump.buffers)
    got = run_cuda(mgr, 20, fault_at=11)
    assert mgr.graph_stats()["graph_replays"] >= 15
    assert mgr.stats() == eager.stats() and mgr.stats()["violations"] > 0
    assert mgr.health_failure_counts() == {"kernels_ran": 0, "phase": 0}
    assert _summary(got) == _summary(want) and pump.publish_misses == 0
    assert int(pump.publisher.state[0]) == 20


class LaggingDevice:
    """The publishes of a device that runs behind, emulated on the CPU: each is queued with the outbox as the step's
    work left it, and runs (buffer, then flag) once the host is ``delays[seq]`` steps past the step that queued it,
    in order; a wait runs every one queued."""

    def __init__(self, mgr: CanaryManager, delays: list[int]) -> None:
        pump = mgr._pump
        assert pump.publisher is not None
        self.outbox, self.block, self.flags = mgr._work.outbox, pump.buffers, pump._flags
        self.delays, self.now, self.seq = delays, 0, 0
        self.queue: list[tuple[int, int, torch.Tensor]] = []
        pump.publisher.launch = self.launch
        for buf in pump.buffers:
            buf.catch_up = self.waiting(buf.catch_up)

    def launch(self) -> None:
        self.queue.append((self.now, self.seq, self.outbox.clone()))
        self.seq += 1

    def run_due(self, every: bool = False) -> None:
        while self.queue and (every or self.now - self.queue[0][0] >= self.delays[self.queue[0][1]]):
            _, seq, outbox = self.queue.pop(0)
            slot = seq % len(self.block)
            self.block[slot].tensor.copy_(outbox)
            self.flags[slot] = seq + 1

    def waiting(self, catch_up: Any) -> Any:
        def wait(buf: Any) -> None:
            self.run_due(every=True)
            catch_up(buf)

        return wait


def _lagged_run(mgr: CanaryManager, delays: list[int]) -> list[StepReport | None]:
    """Steps whose publishes run late by ``delays`` (host steps), the device catching up between a step's forward
    (which queues its publish) and its host step (which decodes the step two back when it must)."""
    device = LaggingDevice(mgr, delays) if mgr._pump.publisher is not None else None
    with_fake_graphs(mgr)
    wl, out = Workload(), []
    for k in range(len(delays)):
        if k == 9:
            alias_first_slot(wl, victim=2, owner=1)
        if device is not None:
            device.now = k
        mgr.forward_step({"full": wl.batch([(1, 4 if k == 0 else 1), (2, 4 if k == 0 else 1)], truth=True)})
        if device is not None:
            device.run_due()
        out.append(mgr.host_step(["req-a", "req-b"]))
    out.append(mgr.flush())
    return out


@cpu_kernels
@pytest.mark.parametrize("buffers", [4, 3])
def test_a_publish_queued_before_its_host_step_never_overwrites_totals_the_decoder_still_reads(
    monkeypatch: pytest.MonkeyPatch, buffers: int
) -> None:
    """A step's publish is queued by its forward, before its host step decodes the step two back.  When the device
    runs late and then catches up at once, step k's publish runs before host step k decodes step k - 2, whose
    deltas are taken against step k - 3's totals: with three buffers, step k's publish has just overwritten them."""
    delays = [0, 0, 0, 2, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0]
    copying = manager(publish=False)
    want = _lagged_run(copying, delays)
    monkeypatch.setattr("kvcanary.runtime.pump.PUBLISH_BUFFERS", buffers)
    monkeypatch.setattr("kvcanary.runtime.publish.NUM_BUFFERS", buffers)
    mgr = manager(publish=True)
    got = _lagged_run(mgr, delays)
    assert mgr.stats() == copying.stats()  # the running totals agree either way

    def found(reports: list[StepReport | None]) -> list[tuple[int, int, tuple[object, ...]]]:
        """Each step's findings, up to the last two (a late device leaves them for the flush, which merges them)."""
        return [(r.step, r.total, r.affected_request_ids) for r in reports if r is not None and r.step < 12]

    assert found(want) == [(k, 2, ("req-b",)) for k in (9, 10, 11)]
    assert (found(got) == found(want)) is (buffers == 4)  # three buffers: the steps decoded late lose their rows
    assert mgr._pump.publish_misses == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_host_step_waits_for_the_publish_two_steps_back_not_for_the_whole_device() -> None:
    """A device kept behind (a sleep queued before each step's work, every step's batch on the device beforehand):
    a host step waits for the step two back, and only for it, so the last steps' work is still queued when the
    run's last host step returns; the findings are the eager copying manager's."""
    wl, batches = Workload(), []
    for k in range(12):
        if k == 7:
            alias_first_slot(wl, victim=2, owner=1)
        batch = wl.batch([(1, 4 if k == 0 else 1), (2, 4 if k == 0 else 1)], truth=True)
        batches.append(StepBatch(**{n: None if t is None else t.cuda() for n, t in batch.tensors().items()}))
    torch.cuda.synchronize()
    results = {}
    for publish in (False, True):
        mgr = manager(publish=publish, device="cuda")
        reports, behind = [], False
        for batch in batches:
            torch.cuda._sleep(20_000_000)  # about 10 ms of GPU time before the step's work
            mgr.forward_step({"full": batch})
            reports.append(mgr.host_step(["req-a", "req-b"]))
        behind = not torch.cuda.current_stream().query()
        reports.append(mgr.flush())
        results[publish] = (mgr.stats(), [(r.step, r.total) for r in reports if r is not None], behind)
        if publish:
            assert mgr._pump.publish_misses == 0
    assert results[True][:2] == results[False][:2] and results[True][1]
    assert results[True][2]  # never a wait for the whole device

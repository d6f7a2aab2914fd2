"""The engine's block moves queued for the next step's work (``queued_moves``, ``move_entries`` and the record-move
kernel): the kernel against its torch spec, entry for entry; the queue's entries against the mirror at once, move for
move; and the queue on the demo's engine, which must change no detection."""

from __future__ import annotations

import array
import dataclasses
import functools
import importlib
import os
import types
from pathlib import Path

import pytest
import torch

import compiled_build
from kvcanary.adapters.transformers_cb import binding, bulk_moves, mirror, move_entries
from kvcanary.adapters.transformers_cb.byte_moves import BlockWrite, HostSave
from kvcanary.adapters.transformers_cb.queued_moves import (
    CAPACITY,
    ENTRY_WORDS,
    FROM_HOST,
    GROUP_SHIFT,
    MoveCounts,
    QueuedMoves,
    RecordMovesLaunch,
    apply_entries,
)
from kvcanary.adapters.transformers_cb.staging import HEAD_WORDS, NUM_SLOTS
from kvcanary.adapters.transformers_cb.translate import StepTranslator
from kvcanary.layout import RecordRows
from kvcanary.ops import Backend
from kvcanary.runtime.pump import CopyFence
from transformers_helpers import PAGE, demo_run, geometry

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda") if CUDA else torch.device("cpu")
NAMES = ("a", "b")
HOST_BLOCKS = 8


def random_rows(groups: int, slots: int, gen: torch.Generator) -> RecordRows:
    rows = RecordRows.allocate(slots, groups, DEV)
    rows.pairs.copy_(torch.randint(-(2**31), 2**31 - 1, tuple(rows.pairs.shape), generator=gen, dtype=torch.int32))
    rows.links.copy_(torch.randint(1, 2**62, tuple(rows.links.shape), generator=gen, dtype=torch.int64))
    return rows


def clone_rows(rows: RecordRows) -> RecordRows:
    out = RecordRows.allocate(rows.num_slots, len(rows.links), rows.device)
    out.pairs.copy_(rows.pairs)
    out.links.copy_(rows.links)
    return out


def same(a: RecordRows, b: RecordRows) -> bool:
    return torch.equal(a.pairs.cpu(), b.pairs.cpu()) and torch.equal(a.links.cpu(), b.links.cpu())


def a_fence(step: int = 0) -> CopyFence:
    fence = CopyFence()
    fence.seq = torch.tensor([step, 0], dtype=torch.int64, device=DEV)
    fence.next_step = step
    return fence


@pytest.mark.parametrize(("groups", "page", "n"), [(1, 1, 1), (1, 3, 13), (2, 8, 29), (3, 5, 0), (2, 16, 97)])
def test_the_record_move_kernel_does_what_its_torch_spec_does(groups: int, page: int, n: int) -> None:
    """Random entries (copies both ways and within each side, clears, blocks past either side, any group mask, chains
    over blocks an earlier entry wrote), each slot in turn with garbage in the others: the same records, word for
    word."""
    gen = torch.Generator().manual_seed(groups * 1000 + page * 10 + n)
    dev_blocks, host_blocks = 11, 7
    rows, host = random_rows(groups, dev_blocks * page + 2, gen), random_rows(groups, host_blocks * page, gen)
    want_rows, want_host = clone_rows(rows), clone_rows(host)
    slots = torch.randint(-50, 50, (NUM_SLOTS, HEAD_WORDS + CAPACITY * ENTRY_WORDS), generator=gen, dtype=torch.int64)
    slots = slots.pin_memory() if CUDA else slots
    seq = torch.zeros(2, dtype=torch.int64, device=DEV)
    launch = RecordMovesLaunch(slots, seq, rows, host, page)
    for step in range(NUM_SLOTS + 1):
        flags = torch.randint(0, 4, (n,), generator=gen) | (torch.randint(0, 1 << groups, (n,), generator=gen) << 8)
        entries = torch.stack([
            torch.randint(-1, 13, (n,), generator=gen), torch.randint(-2, 13, (n,), generator=gen), flags,
        ], dim=1).flatten()  # fmt: skip
        slot = step % NUM_SLOTS
        slots[slot, 0] = n
        slots[slot, HEAD_WORDS : HEAD_WORDS + entries.numel()] = entries
        seq[0] = step
        launch.run()
        apply_entries(entries.tolist(), want_rows, want_host, page)
        assert same(rows, want_rows) and same(host, want_host), step
    assert not same(rows, random_rows(groups, dev_blocks * page + 2, torch.Generator().manual_seed(0)))


@pytest.mark.skipif(not CUDA, reason="a CUDA graph")
def test_the_launch_captured_in_a_graph_applies_each_steps_entries_on_replay() -> None:
    """Captured once (as the step graph captures the prelude), each replay reads the slot of the step it runs for."""
    gen = torch.Generator().manual_seed(2)
    rows, host = random_rows(2, 12 * PAGE, gen), random_rows(2, 6 * PAGE, gen)
    want_rows, want_host = clone_rows(rows), clone_rows(host)
    slots = torch.zeros((NUM_SLOTS, HEAD_WORDS + CAPACITY * ENTRY_WORDS), dtype=torch.int64).pin_memory()
    seq = torch.zeros(2, dtype=torch.int64, device=DEV)
    launch = RecordMovesLaunch(slots, seq, rows, host, PAGE)
    launch.run()  # compiled before the capture (nothing queued: slot 0 is empty)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch.run()
    for step in range(2 * NUM_SLOTS):
        n = 1 + step % 5
        entries = torch.stack([
            torch.randint(-1, 12, (n,), generator=gen), torch.randint(0, 12, (n,), generator=gen),
            torch.randint(0, 4, (n,), generator=gen) | (3 << GROUP_SHIFT),
        ], dim=1).flatten()  # fmt: skip
        slots[step % NUM_SLOTS, 0] = n
        slots[step % NUM_SLOTS, HEAD_WORDS : HEAD_WORDS + entries.numel()] = entries
        seq[0] = step
        graph.replay()
        torch.cuda.synchronize()
        apply_entries(entries.tolist(), want_rows, want_host, PAGE)
        assert same(rows, want_rows) and same(host, want_host), step


def test_the_spec_moves_each_group_of_the_mask_and_skips_blocks_outside_their_side() -> None:
    gen = torch.Generator().manual_seed(3)
    rows, host = random_rows(2, 6 * PAGE, gen), random_rows(2, 4 * PAGE, gen)
    before = clone_rows(rows)
    b_only = 1 << (GROUP_SHIFT + 1)
    apply_entries([1, 2, b_only, 0, 3, FROM_HOST | b_only, 5, 6, b_only, -1, 4, 3 << GROUP_SHIFT], rows, host, PAGE)
    blocks, before_blocks, host_blocks = rows.blocks(PAGE), before.blocks(PAGE), host.blocks(PAGE)
    assert torch.equal(blocks[1][1, 2], before_blocks[1][1, 1]) and torch.equal(blocks[1][0, 2], before_blocks[1][0, 2])
    assert torch.equal(blocks[0][2:, 3], host_blocks[0][2:, 0]) and torch.equal(
        blocks[0][:2, 3], before_blocks[0][:2, 3]
    )
    assert (blocks[0][:, 4] == 0).all() and (blocks[1][:, 4] == 0).all()  # cleared in both groups
    assert torch.equal(blocks[1][:, 5], before_blocks[1][:, 5])  # block 6 is past the device's 6 blocks: skipped


def mirrored_at_once(rows: RecordRows, moves: list[tuple[str, object]]) -> mirror.HostRecords:
    """The moves mirrored as the bulk moves' fallbacks do, one by one (``rows``' stores, one host pool)."""
    g = {n: dataclasses.replace(geometry(), name=n) for n in NAMES}  # the host pool's records are keyed by group name
    host, stores = mirror.HostRecords(), dict(zip(NAMES, rows.stores(), strict=True))
    for kind, move in moves:
        if kind == "save":
            assert host.save_all_rows(NAMES, PAGE, rows, move, HOST_BLOCKS, mirror.MoveIndex())  # type: ignore[arg-type]
        elif kind == "restore":
            assert isinstance(move, BlockWrite)
            if move.groups == NAMES:
                assert host.restore_rows(NAMES, PAGE, rows, move, mirror.MoveIndex())
            else:
                for name in move.groups:
                    host.restore(g[name], stores[name], move)
        else:
            name, write = move  # type: ignore[misc]
            mirror.apply_block_write(g[name], stores[name], write)
    return host


def queued(rows: RecordRows, moves: list[tuple[str, object]], at_once: bool) -> QueuedMoves:
    """The same moves queued (one step's), then applied by the kernel (or at once, by the spec)."""
    host, q = mirror.HostRecords(), QueuedMoves(rows, NAMES, PAGE, a_fence(5))
    for kind, move in moves:
        if kind == "save":
            q.attach(host.joint_rows(NAMES, HOST_BLOCKS * PAGE, rows.device, create=True))  # type: ignore[arg-type]
            entries = move_entries.save_entries(q, move)  # type: ignore[arg-type]
        elif kind == "restore":
            entries = move_entries.restore_entries(q, [move])  # type: ignore[list-item]
        else:
            entries = move_entries.fork_entries(q, [move])  # type: ignore[list-item]
        assert q.push(entries), (kind, move)
    if at_once:
        q.apply_now()
    else:
        prelude = q.prelude(None)
        assert prelude is not None and prelude is q.prelude(None)  # one object a prelude: its graph key is found again
        prelude.run()
        q.taken()
    assert q.count == 0
    return q


def a_run_of_moves() -> list[tuple[str, object]]:
    """Offloads, restores and fork copies as the observer reports them, with what the mirror makes of each awkward
    case: a save of bytes from no gather, a restore from a host block never saved or past the pool, a copy into a block
    a later copy reads, a copy into one group only, a write of unknown origin."""
    t = torch.tensor
    return [
        ("save", [HostSave(NAMES, (5, 6), t([1, 2]), (1, 2)), HostSave(NAMES, (2,), None)]),
        ("fork", ("a", BlockWrite(("a",), t([9]), t([2]), None, (9,), (2,)))),
        ("restore", BlockWrite(NAMES, t([10, 11, 7]), None, (6, 5, 0), (10, 11, 7))),
        ("restore", BlockWrite(NAMES, t([3]), None, (HOST_BLOCKS,), (3,))),
        ("restore", BlockWrite(("b",), t([4]), None, (6,), (4,))),
        ("save", [HostSave(NAMES, (7,), t([10]), (10,))]),
        ("fork", ("b", BlockWrite(("b",), t([8]), t([10]), None, (8,), (10,)))),
        ("fork", ("b", BlockWrite(("b",), t([0]), t([8]), None, (0,), (8,)))),
        ("fork", ("a", BlockWrite(("a",), t([1]), None, None, (1,)))),
        ("restore", BlockWrite(NAMES, t([2, 11]), None, (7, -1), (2, 11))),
    ]


@pytest.mark.parametrize("at_once", [False, True], ids=["kernel", "at-once"])
def test_queued_moves_leave_the_records_as_the_mirror_at_once_leaves_them(at_once: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    eager_rows = random_rows(2, geometry().num_slots, gen)
    queued_rows = clone_rows(eager_rows)
    eager_host = mirrored_at_once(eager_rows, a_run_of_moves())
    q = queued(queued_rows, a_run_of_moves(), at_once)
    assert same(queued_rows, eager_rows)
    assert same(q.host, eager_host.joint_rows(NAMES, 0, DEV, create=False))  # type: ignore[arg-type]
    assert q.counts.queued_move_entries == 15 and q.counts.steps_with_queued_moves == int(not at_once)


def test_a_move_the_queue_cannot_express_or_hold_is_refused() -> None:
    gen = torch.Generator().manual_seed(5)
    rows = random_rows(2, geometry().num_slots, gen)
    fence = a_fence()
    q = QueuedMoves(rows, NAMES, PAGE, fence)
    unknown = BlockWrite(("a",), torch.tensor([3]), torch.tensor([1]), None, (3,), None)  # the source's values unknown
    assert move_entries.fork_entries(q, [("a", unknown)]) is None and not q.push(None)
    assert move_entries.fork_entries(q, [("c", unknown)]) is None  # not a group of the queue
    past = BlockWrite(("a",), torch.tensor([3]), torch.tensor([1]), None, (q.device_blocks,), (1,))
    assert move_entries.fork_entries(q, [("a", past)]) is None
    copy = array.array("q", (1, 2, 1 << GROUP_SHIFT))
    want = clone_rows(rows)
    for _ in range(CAPACITY):
        assert q.push(copy)
    assert not q.push(copy) and q.count == CAPACITY  # the slot is full: the caller applies the queue, then the move
    q.apply_now()
    apply_entries(list(copy) * CAPACITY, want, None, PAGE)
    assert same(rows, want) and q.count == 0 and q.counts.move_entries_applied_at_once == CAPACITY
    assert q.push(copy)
    fence.next_step += 1  # a host step ran without this queue's prelude (not expected): its entries come first
    assert not q.push(copy)
    q.apply_now()
    assert q.push(copy)
    fence.next_step += 1  # likewise, met by the next step's prelude: applied at once before it is handed out
    assert q.prelude(None) is not None and q.count == 0
    apply_entries(list(copy) * 2, want, None, PAGE)
    assert same(rows, want) and q.counts.move_entries_applied_at_once == CAPACITY + 2


def test_a_step_with_nothing_queued_applies_nothing_though_its_slot_held_an_earlier_steps_entries() -> None:
    """The record moves run in every step's prelude: a step with no moves must find its slot empty, also the step
    that reuses the slot of one that had moves (records scrambled in between, so re-applied entries would show)."""
    gen = torch.Generator().manual_seed(8)
    rows = random_rows(2, geometry().num_slots, gen)
    fence = a_fence(3)
    q = QueuedMoves(rows, NAMES, PAGE, fence)
    both = 3 << GROUP_SHIFT
    assert q.push(array.array("q", (1, 2, both, 2, 5, both, -1, 1, 1 << GROUP_SHIFT)))
    prelude = q.prelude(None)
    assert prelude is not None
    prelude.run()
    q.taken()
    for later in (1, NUM_SLOTS):  # the next step, and the one whose slot is step 3's
        fence.next_step = 3 + later
        fence.seq.fill_(3 + later)  # type: ignore[union-attr]
        scrambled = random_rows(2, rows.num_slots, gen)
        rows.pairs.copy_(scrambled.pairs)
        rows.links.copy_(scrambled.links)
        assert q.prelude(None) is prelude
        prelude.run()
        q.taken()
        assert same(rows, scrambled), later
    assert q.counts.steps_with_queued_moves == 1 and q.counts.queued_move_entries == 3


def test_the_adapters_option_is_checked_before_anything_is_installed() -> None:
    from kvcanary.adapters.transformers_cb import TransformersCBAdapter
    from kvcanary.demo import build_model

    with pytest.raises(TypeError, match="queue_moves must be a bool, got 'yes'"):
        TransformersCBAdapter(build_model("dense"), queue_moves="yes")  # type: ignore[arg-type]


def test_the_queue_refuses_what_it_cannot_serve() -> None:
    rows = RecordRows.allocate(geometry().num_slots, 1, DEV)
    with pytest.raises(ValueError, match="publishing fence"):
        QueuedMoves(rows, ("a",), PAGE, CopyFence())
    with pytest.raises(ValueError, match="group names"):
        QueuedMoves(rows, NAMES, PAGE, a_fence())
    with pytest.raises(ValueError, match="same groups"):
        QueuedMoves(rows, ("a",), PAGE, a_fence()).attach(RecordRows.allocate(4 * PAGE, 2, DEV))


@pytest.mark.skipif(not INTERPRETED, reason="the CUDA layout on the CPU demo engine runs Triton's interpreter")
@compiled_build.patches("kvcanary.adapters.transformers_cb.binding", "kvcanary.adapters.transformers_cb.queued_moves")
@pytest.mark.parametrize(
    ("kind", "fault", "requests", "with_binding"),
    [
        ("hybrid", None, 4, True),
        ("hybrid", None, 4, False),
        ("hybrid", "offload-restore-wrong-host-block", 8, True),
        ("dense", "offload-restore-wrong-host-block", 8, True),
    ],
)
def test_the_queue_on_the_demo_engine_changes_no_detection(
    kind: str, fault: str | None, requests: int, with_binding: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo's engine with the CUDA layout and the kernels (the layout the queue needs: a publishing manager), its
    moves queued for each step's work, against the CPU's layout mirroring them at once: the same steps, verified slots,
    stamps, violations and reports, with every move queued (the kernels match the reference path word for word).
    Queued, the moves make no device op (counted by the mirror-ops benchmark's windows: each op a launch of host time on
    CUDA; mirrored at once the hybrid's six requests made 90): the host records are made with the binding, so every
    step's prelude holds one record-move launch from the first step on (one built at the first offload instead took a
    second capture of each shape class's step graph on CUDA).  Without ``with_binding`` the binding is made before the
    offloading manager is seen (as where its first step's restore call is not the adapter's): the first offload then
    makes the host records, the one device op, and the launch is built a second time."""
    plain = demo_run(kind, fault=fault, requests=requests)
    layout = functools.partial(StepTranslator, static=True, kernel=True, bucket=True)
    monkeypatch.setattr(binding, "StepTranslator", layout)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    windows = importlib.import_module("mirror_ops").MirrorWindows()
    monkeypatch.setattr(bulk_moves, "time", types.SimpleNamespace(perf_counter_ns=windows.perf_counter_ns))
    handed: list[RecordMovesLaunch] = []  # the record-move launch of each step's prelude (held: ids stay unique)
    prelude = QueuedMoves.prelude

    def watched(q: QueuedMoves, step: object) -> object:
        out = prelude(q, step)  # type: ignore[arg-type]
        handed.append(out.launches[-1])  # type: ignore[union-attr]
        return out

    monkeypatch.setattr(QueuedMoves, "prelude", watched)
    if not with_binding:
        monkeypatch.setattr(bulk_moves.BulkMoveWrappers, "bound", lambda moves, b: None)
    queued = demo_run(kind, fault=fault, requests=requests, backend=Backend.TRITON, queue_moves=True)
    assert windows.windows > 0 and dict(windows.ops) == ({} if with_binding else {"aten.zeros.default": 2})
    assert len(handed) == queued.stats["steps"] and len({id(launch) for launch in handed}) == 2 - with_binding
    assert handed[-1].args[5] is not handed[-1].args[3]  # it addresses the host records, not the stand-in
    keys = [k for k in plain.stats if not k.endswith("_us") and k not in MoveCounts().as_dict()]
    assert {k: plain.stats[k] for k in keys} == {k: queued.stats[k] for k in keys}
    assert [(r.step, r.violations) for r in plain.reports] == [(r.step, r.violations) for r in queued.reports]
    assert plain.features["offloads"] > 0 and plain.features["fork_block_copies"] > 0
    assert plain.stats["queued_move_entries"] == 0 < queued.stats["queued_move_entries"]
    assert queued.stats["move_entries_applied_at_once"] == 0 < queued.stats["steps_with_queued_moves"]
    assert plain.detected if fault else plain.stats["violations"] == 0 < plain.stats["verified_slots"]

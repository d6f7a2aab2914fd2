"""The records follow the engine's block writes (byte_moves + mirror), not its bookkeeping: both sides."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import compiled_build
from kvcanary.adapters.transformers_cb import byte_moves, mirror
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.layout import RecordRows, RecordStore
from test_adapter_transformers_cost import sync_debug
from transformers_helpers import PAGE, geometry

BYTES_PER_BLOCK = 16
NAME = geometry().name


def allocator(g: GroupGeometry) -> types.SimpleNamespace:
    """Stands in for a transformers allocator: a typed cache tensor and the engine's byte view of it."""
    cache = torch.zeros(g.num_blocks * BYTES_PER_BLOCK // 2, dtype=torch.float16)
    a = types.SimpleNamespace(cache_tensor=cache, bytes_per_block=BYTES_PER_BLOCK)
    a._copy_view = cache.view(torch.uint8).view(-1, BYTES_PER_BLOCK)
    return a


def stamped(g: GroupGeometry, blocks: list[int]) -> RecordStore:
    rec = RecordStore.allocate(g.num_slots)
    for b in blocks:
        slots = g.block_slots(torch.tensor([b]))
        rec.links[slots] = torch.arange(1, 2 * PAGE, 2) + 100 * b  # odd, distinct per block
        rec.positions[slots] = torch.arange(PAGE, dtype=torch.int32) + PAGE * b
    return rec


def links(g: GroupGeometry, rec: RecordStore, block: int) -> list[int]:
    return [int(x) for x in rec.links[g.block_slots(torch.tensor([block]))]]


def engine_copy(view: torch.Tensor, src: list[int], dst: list[int]) -> None:
    view.index_copy_(0, torch.tensor(dst), view.index_select(0, torch.tensor(src)))


def test_a_copy_that_lands_moves_the_records_and_one_that_misses_the_cache_does_not() -> None:
    g = geometry()
    a = allocator(g)
    for lands in (True, False):
        rec = stamped(g, [4])
        view = a._copy_view if lands else a._copy_view.clone()  # the lost copy writes a buffer nobody reads
        with byte_moves.BlockWriteObserver(byte_moves.watch({NAME: byte_moves.block_view(a)})) as seen:
            engine_copy(view, [4], [7])
        for w in seen.writes:
            mirror.apply_block_write(g, rec, w)
        assert links(g, rec, 7) == (links(g, rec, 4) if lands else [0] * PAGE)
        assert len(seen.writes) == int(lands)


def test_a_write_of_unknown_origin_leaves_its_blocks_without_records() -> None:
    g = geometry()
    a = allocator(g)
    rec = stamped(g, [3, 5])
    with byte_moves.BlockWriteObserver(byte_moves.watch({NAME: byte_moves.block_view(a)})) as seen:
        a._copy_view.index_copy_(0, torch.tensor([5]), torch.ones(1, BYTES_PER_BLOCK, dtype=torch.uint8))
    for w in seen.writes:
        mirror.apply_block_write(g, rec, w)
    assert links(g, rec, 5) == [0] * PAGE and links(g, rec, 3) != [0] * PAGE


@pytest.mark.parametrize("form", ["methods", "keywords", "functions"])
def test_a_copy_is_seen_whichever_way_the_engine_spells_its_calls(form: str) -> None:
    """The observer sees a block copy however the engine spells it: positional, keyword and function forms."""
    g = geometry()
    a = allocator(g)
    rec = stamped(g, [2])
    view, src, dst = a._copy_view, torch.tensor([2]), torch.tensor([6])
    with byte_moves.BlockWriteObserver(byte_moves.watch({NAME: byte_moves.block_view(a)})) as seen:
        if form == "methods":
            engine_copy(view, [2], [6])
        elif form == "keywords":
            view.index_copy_(dim=0, index=dst, source=view.index_select(dim=0, index=src))
        else:
            view.index_copy_(0, dst, torch.index_select(view, 0, src))
    for w in seen.writes:
        mirror.apply_block_write(g, rec, w)
    assert len(seen.writes) == 1 and seen.writes[0].source_blocks is not None
    assert links(g, rec, 6) == links(g, rec, 2) != [0] * PAGE


def engine_offload(a: types.SimpleNamespace, pool: torch.Tensor, gpu: list[int], cpu: list[int]) -> None:
    """transformers' offload: one gather of device blocks, then copies of row runs into host rows."""
    gathered = a._copy_view.index_select(0, torch.tensor(gpu))
    host = pool.view(-1, BYTES_PER_BLOCK)
    for k, h in enumerate(cpu):  # one run per block: the pairing is positional
        host[h : h + 1].copy_(gathered[k : k + 1])


def engine_restore(a: types.SimpleNamespace, pool: torch.Tensor, cpu: list[int], gpu: list[int]) -> None:
    """transformers' restore: copies of host row runs into a staging tensor, one scatter into the cache."""
    host = pool.view(-1, BYTES_PER_BLOCK)
    staging = torch.empty(len(cpu), BYTES_PER_BLOCK, dtype=torch.uint8)
    for k, h in enumerate(cpu):
        staging[k : k + 1].copy_(host[h : h + 1])
    a._copy_view.index_copy_(0, torch.tensor(gpu), staging)


def offload_then_restore(read_from: list[int]) -> tuple[GroupGeometry, RecordStore]:
    """Offload device blocks [2, 3, 4] into host blocks [5, 6, 7], clear the device records, then restore
    the host blocks ``read_from`` into device blocks [8, 9, 10], mirrored from the observed copies only."""
    g = geometry()
    a = allocator(g)
    pool = torch.zeros(8 * BYTES_PER_BLOCK, dtype=torch.uint8)
    rec = stamped(g, [2, 3, 4])
    host = mirror.HostRecords()
    views = {NAME: byte_moves.block_view(a)}
    with byte_moves.BlockWriteObserver(byte_moves.watch(views), host_pool=pool) as seen:
        engine_offload(a, pool, [2, 3, 4], [5, 6, 7])
    host.save_all(g, rec, seen.host_saves, 8)
    rec.clear_slots(torch.arange(g.num_slots))
    with byte_moves.BlockWriteObserver(byte_moves.watch(views), host_pool=pool) as seen:
        engine_restore(a, pool, read_from, [8, 9, 10])
    for write in seen.writes:
        host.restore(g, rec, write)
    return g, rec


def test_a_restore_brings_the_records_of_the_host_blocks_it_reads() -> None:
    original = stamped(geometry(), [2, 3, 4])
    g, rec = offload_then_restore([5, 6, 7])  # the right host blocks
    assert [links(g, rec, b) for b in (8, 9, 10)] == [links(g, original, b) for b in (2, 3, 4)]
    g, rec = offload_then_restore([6, 7, 5])  # the right device blocks, read from the wrong host blocks
    assert [links(g, rec, b) for b in (8, 9, 10)] == [links(g, original, b) for b in (3, 4, 2)]


def test_a_restore_from_a_host_block_never_saved_restores_no_record() -> None:
    g, rec = offload_then_restore([5, 6, 0])  # host block 0 holds nothing the canary saw
    assert links(g, rec, 10) == [0] * PAGE and links(g, rec, 9) != [0] * PAGE


def offloaded_links(gpu: list[int], cpu: list[int]) -> tuple[list[list[int]], int]:
    """Offload device blocks ``gpu`` into host blocks ``cpu`` (one copy a block), mirrored with :meth:`save_all`;
    the links each host block then holds, and how many index writes the mirror made."""
    g = geometry()
    a = allocator(g)
    pool = torch.zeros(8 * BYTES_PER_BLOCK, dtype=torch.uint8)
    rec = stamped(g, sorted(set(gpu)))
    host = mirror.HostRecords()
    with byte_moves.BlockWriteObserver(byte_moves.watch({NAME: byte_moves.block_view(a)}), host_pool=pool) as seen:
        engine_offload(a, pool, gpu, cpu)
    with CountedOps() as counted:
        host.save_all(g, rec, seen.host_saves, 8)
    back = RecordStore.allocate(g.num_slots)
    host.restore(g, back, byte_moves.BlockWrite((NAME,), torch.tensor(sorted(set(cpu))), None, tuple(sorted(set(cpu)))))
    return [links(g, back, h) for h in sorted(set(cpu))], counted.index_puts


class CountedOps(torch.utils._python_dispatch.TorchDispatchMode):  # type: ignore[misc]
    """Counts the device ops made inside the block (views are none: they launch nothing), and among them the writes
    of records (by an index, or into a run of blocks: a copy into a slice)."""

    aten = torch.ops.aten
    WRITES = (aten.index_put_.default, aten.index_copy_.default, aten.index_fill_.int_Scalar, aten.copy_.default,
              aten.fill_.Scalar)  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.index_puts = 0
        self.ops = 0
        self.names: list[str] = []  # each op's name, in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view:
            self.index_puts += func in self.WRITES
            self.ops += 1
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_an_offload_of_many_runs_is_mirrored_in_one_write_a_view_and_a_repeated_host_block_keeps_the_last() -> None:
    g = geometry()
    original = stamped(g, [1, 2, 3, 4])
    got, writes = offloaded_links([1, 2, 3, 4], [4, 5, 6, 7])  # four runs, four distinct host blocks
    assert got == [links(g, original, b) for b in (1, 2, 3, 4)]
    fields = len(original.blocks(g.page_size))  # the tokens and positions share one view
    assert fields == len(original.fields()) - 1
    assert writes == fields  # one scatter a view, not one a run
    got, writes = offloaded_links([1, 2, 3], [5, 6, 5])  # host block 5 written twice: the later copy (block 3) wins
    assert got == [links(g, original, b) for b in (3, 2)]
    assert writes == 2 * fields


def test_a_restore_from_bytes_of_unknown_origin_restores_no_record() -> None:
    g = geometry()
    a = allocator(g)
    rec = stamped(g, [2])
    host = mirror.HostRecords()
    watched = byte_moves.watch({NAME: byte_moves.block_view(a)})
    with byte_moves.BlockWriteObserver(watched, host_pool=torch.zeros(8)) as seen:
        a._copy_view.index_copy_(0, torch.tensor([2]), torch.zeros(1, BYTES_PER_BLOCK, dtype=torch.uint8))
    assert seen.writes[0].source_host_blocks is None
    mirror.apply_block_write(g, rec, seen.writes[0])
    assert links(g, rec, 2) == [0] * PAGE and len(host) == 0


@pytest.mark.gpu
def test_an_offload_and_restore_mirrored_on_cuda_never_wait_for_the_device() -> None:
    """The host block numbers reach the device without a synchronous copy: the engine's forward queued before
    them keeps running while the host goes on (a wait here cost the GPU demo its CPU/GPU overlap)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = geometry()
    gpu = torch.device("cuda")
    rec = RecordStore.allocate(g.num_slots, gpu)
    for dst, src in zip(rec.fields(), stamped(g, [2, 3, 4]).fields(), strict=True):
        dst.copy_(src)
    want = [links(g, rec, b) for b in (3, 4, 2)]
    host = mirror.HostRecords()
    with sync_debug("error"):
        torch.cuda._sleep(50_000_000)  # the forward still running
        save = byte_moves.HostSave((NAME,), (5, 6, 7), torch.tensor([2, 3, 4]).pin_memory().to(gpu, non_blocking=True))
        host.save_all(g, rec, [save], 8)
        dest = torch.tensor([8, 9, 10]).pin_memory().to(gpu, non_blocking=True)
        host.restore(g, rec, byte_moves.BlockWrite((NAME,), dest, None, (6, 7, 5)))
        fork = byte_moves.BlockWrite((NAME,), torch.tensor([11]).pin_memory().to(gpu, non_blocking=True), dest[:1])
        mirror.apply_block_write(g, rec, fork)  # a fork copy of block 8
    assert [links(g, rec, b) for b in (8, 9, 10)] == want and links(g, rec, 11) == want[0]


class _Row:
    """A batch row whose offload flag may not be read (the wrapper must not scan rows when nothing is offloaded)."""

    def __init__(self, offloaded: bool, readable: bool) -> None:
        self._offloaded, self._readable = offloaded, readable

    @property
    def is_cpu_offloaded(self) -> bool:
        assert self._readable, "a row was scanned with no request in the swap pool"
        return self._offloaded


@compiled_build.patches("kvcanary.adapters.transformers_cb.bulk_moves")  # a stand-in binding
def test_the_restore_wrapper_scans_the_batch_only_when_the_swap_pool_holds_a_request() -> None:
    from kvcanary.adapters.transformers_cb.bulk_moves import BulkMoveWrappers
    from kvcanary.adapters.transformers_cb.features import FeatureCounters

    cache = types.SimpleNamespace(cache_allocators={})
    binding = types.SimpleNamespace(is_for=lambda c: c is cache, geometries={}, moves=None)
    features = FeatureCounters()
    calls: list[int] = []
    wrapped = BulkMoveWrappers(lambda: binding, features).restore(lambda om, batch: calls.append(len(batch)))  # type: ignore[arg-type]
    om = types.SimpleNamespace(
        cache=cache, _cpu_pool=object(), _cpu_tensor=torch.zeros(4), _compute_stream=None, _request_id_to_cpu_blocks={}
    )
    wrapped(om, [types.SimpleNamespace(state=_Row(False, readable=False)) for _ in range(3)])
    assert calls == [3] and features.restores == 0  # the engine's own restore ran; no row read
    om._request_id_to_cpu_blocks = {"a": {}}
    rows = [types.SimpleNamespace(state=_Row(i == 1, readable=True)) for i in range(3)]
    wrapped(om, rows)
    assert calls == [3, 3] and features.restores == 1  # one request came back: counted, its copies observed


def test_a_mirrored_move_is_one_gather_and_one_write_a_view() -> None:
    """Each op is a launch of host time on CUDA: a fork copy's or a restore's mirror stays at one gather and one
    write a block view of the records (the tokens and positions share one; the index of host block numbers built
    once), whatever the number of blocks."""
    g = geometry()
    a = allocator(g)
    fields = len(stamped(g, []).blocks(g.page_size))
    assert fields == 2
    for blocks in ([4], [4, 5, 6]):
        rec = stamped(g, blocks)
        with byte_moves.BlockWriteObserver(byte_moves.watch({NAME: byte_moves.block_view(a)})) as seen:
            engine_copy(a._copy_view, blocks, [b + 5 for b in blocks])
        mirror.apply_block_write(g, rec, seen.writes[0])  # the first move builds the records' block views
        with CountedOps() as counted:
            mirror.apply_block_write(g, rec, seen.writes[0])
        assert (counted.ops, counted.index_puts) == (2 * fields, fields)
        assert [links(g, rec, b + 5) for b in blocks] == [links(g, rec, b) for b in blocks]
    host = mirror.HostRecords()
    rec = stamped(g, [2, 3])
    host.save_all(g, rec, [byte_moves.HostSave((NAME,), (5, 6), torch.tensor([2, 3]))], 8)
    back = RecordStore.allocate(g.num_slots)
    # Host blocks out of order: gathered through an index (on the CPU its tensor is made from the list, no op; on
    # CUDA a pinned tensor and its copy).  A run of host blocks is a view of them: no index, no gather.
    for hosts, dest, ops in (((6, 5), (8, 9), 2 * fields), ((5, 6), (10, 11), fields)):
        restore = byte_moves.BlockWrite((NAME,), torch.tensor(dest), None, hosts)
        host.restore(g, back, restore)
        with CountedOps() as counted:
            host.restore(g, back, restore)
        assert (counted.ops, counted.index_puts) == (ops, fields)
        assert [links(g, back, b) for b in dest] == [links(g, rec, b - 3) for b in hosts]


def two_groups(g: GroupGeometry, blocks: list[int]) -> tuple[RecordRows, list[RecordStore]]:
    """Two groups' records stamped alike but distinct (the second's links offset), as rows and as separate stores."""
    rows, single = RecordRows.allocate(g.num_slots, 2), [stamped(g, blocks), stamped(g, blocks)]
    single[1].links[single[1].links != 0] += 1
    for dst, src in zip(rows.stores(), single, strict=True):
        for a, b in zip(dst.fields(), src.fields(), strict=True):
            a.copy_(b)
    return rows, single


def test_an_offload_and_restore_of_two_groups_laid_out_as_rows_are_mirrored_at_once_as_one_by_one() -> None:
    """Groups over one cache tensor see each move land in both (the hybrid model): as rows of one tensor pair their
    records take half the device ops, and end as mirroring the groups one by one leaves them."""
    g, names = geometry(), ("a", "b")
    rows, single = two_groups(g, [1, 2, 3])
    saves = [byte_moves.HostSave(names, (5, 6), torch.tensor([1, 2])), byte_moves.HostSave(names, (2,), None)]
    restore = byte_moves.BlockWrite(names, torch.tensor([8, 9, 10]), None, (6, 5, 2))
    joint_host, host = mirror.HostRecords(), mirror.HostRecords()
    with CountedOps() as joint_ops:
        assert joint_host.save_all_rows(names, PAGE, rows, saves, 8, mirror.MoveIndex())
        assert joint_host.restore_rows(names, PAGE, rows, restore, mirror.MoveIndex())
    with CountedOps() as one_by_one:
        for name, rec in zip(names, single, strict=True):
            geo = dataclasses.replace(g, name=name)
            host.save_all(geo, rec, saves, 8)
            host.restore(geo, rec, restore)
    got = [[links(g, rec, b) for b in (8, 9, 10)] for rec in rows.stores()]
    assert got == [[links(g, rec, b) for b in (8, 9, 10)] for rec in single]
    assert got[0][:2] == [links(g, single[0], 2), links(g, single[0], 1)] and got[0][2] == [0] * PAGE  # 2: no source
    assert got[0] != got[1] and joint_ops.index_puts * 2 == one_by_one.index_puts


def test_host_records_kept_group_by_group_are_not_joined_later() -> None:
    """A group whose host records were saved on their own (a move that did not land in both) keeps them: the joint
    path declines and the caller mirrors group by group, so no saved record is lost."""
    g, names = geometry(), ("a", "b")
    rows, _ = two_groups(g, [1])
    host = mirror.HostRecords()
    geo = dataclasses.replace(g, name="a")
    host.save_all(geo, rows.stores()[0], [byte_moves.HostSave(("a",), (3,), torch.tensor([1]))], 8)
    saves = [byte_moves.HostSave(names, (4,), torch.tensor([1]))]
    assert not host.save_all_rows(names, PAGE, rows, saves, 8, mirror.MoveIndex())
    restore = byte_moves.BlockWrite(names, torch.tensor([7]), None, (3,))
    assert not host.restore_rows(names, PAGE, rows, restore, mirror.MoveIndex())
    host.restore(geo, rows.stores()[0], restore)
    assert links(g, rows.stores()[0], 7) == links(g, rows.stores()[0], 1) != [0] * PAGE

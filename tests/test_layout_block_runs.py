"""Blocks of a move given as a run (a slice: a view, no index built, no gather) move the records exactly as the same
blocks given as an int64 index do, in a store and in rows of several groups."""

from __future__ import annotations

import pytest
import torch

from kvcanary.adapters.transformers_cb.mirror import MoveIndex
from kvcanary.layout import RecordRows, RecordStore, block_run

PAGE, BLOCKS, HOST_BLOCKS = 4, 13, 11
SLOTS = BLOCKS * PAGE + 3  # a partial block at the end (reserved slots)


def filled(store: RecordStore | RecordRows, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = store.fields() if isinstance(store, RecordStore) else (store.pairs, store.links)
    for t in tensors:
        t.copy_(torch.randint(1, 10_000, t.shape, generator=gen, dtype=t.dtype))


def values(store: RecordStore | RecordRows) -> list[list[int]]:
    tensors = store.fields() if isinstance(store, RecordStore) else (store.pairs, store.links)
    return [t.tolist() for t in tensors]


@pytest.mark.parametrize(
    ("blocks", "want"),
    [((3, 4, 5), slice(3, 6)), ((7,), slice(7, 8)), ((0, 1), slice(0, 2)), ((3, 5), None), ((5, 4), None),
     ((2, 3, 3), None), ((-1, 0), None), ((), None), ((1, 2, 4, 5), None)],
)  # fmt: skip
def test_a_run_is_consecutive_ascending_blocks(blocks: tuple[int, ...], want: slice | None) -> None:
    assert block_run(blocks) == want


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_moves_through_runs_equal_moves_through_indices(rows: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def make(slots: int, i: int) -> RecordStore | RecordRows:
        out = RecordRows.allocate(slots, 2) if rows else RecordStore.allocate(slots)
        filled(out, seed * 7 + i)
        return out

    by_run = {"dev": make(SLOTS, 0), "host": make(HOST_BLOCKS * PAGE, 1)}
    by_index = {"dev": make(SLOTS, 0), "host": make(HOST_BLOCKS * PAGE, 1)}
    n = int(torch.randint(1, 6, (1,), generator=gen))
    first = int(torch.randint(0, HOST_BLOCKS - n + 1, (1,), generator=gen))
    hosts = tuple(range(first, first + n))  # a run of host blocks, as an offload lands
    dev_src, dev_dst = (torch.randperm(BLOCKS, generator=gen)[:n] for _ in range(2))
    index, run = MoveIndex(), MoveIndex()
    assert isinstance(run.hosts(hosts, torch.device("cpu")), slice)
    for store, select in ((by_run, run.hosts), (by_index, lambda b, d: torch.tensor(b, dtype=torch.int64))):
        store["host"].copy_blocks(dev_src, select(hosts, torch.device("cpu")), PAGE, source=store["dev"])  # offload
        store["dev"].copy_blocks(select(hosts, torch.device("cpu")), dev_dst, PAGE, source=store["host"])  # restore
        store["host"].clear_blocks(select(hosts[:1], torch.device("cpu")), PAGE)  # a host block of no known source
    assert values(by_run["dev"]) == values(by_index["dev"]) and values(by_run["host"]) == values(by_index["host"])
    assert values(by_run["dev"]) != values(make(SLOTS, 0))  # the moves changed the records: a real comparison
    assert isinstance(index.hosts((first, first + 2) if first + 2 < HOST_BLOCKS else (0, 2), torch.device("cpu")),
                      torch.Tensor)  # fmt: skip


def test_a_run_past_the_records_end_is_refused_as_an_index_past_it_is() -> None:
    dev, host = RecordStore.allocate(SLOTS), RecordStore.allocate(HOST_BLOCKS * PAGE)
    with pytest.raises((RuntimeError, IndexError)):
        dev.copy_blocks(slice(HOST_BLOCKS - 1, HOST_BLOCKS + 1), torch.tensor([0, 1]), PAGE, source=host)
    with pytest.raises((RuntimeError, IndexError)):
        host.copy_blocks(torch.tensor([0, 1]), slice(HOST_BLOCKS - 1, HOST_BLOCKS + 1), PAGE, source=dev)
    with pytest.raises((RuntimeError, IndexError)):
        host.copy_blocks(torch.tensor([0, 1]), torch.tensor([HOST_BLOCKS - 1, HOST_BLOCKS]), PAGE, source=dev)

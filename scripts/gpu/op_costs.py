"""Host time of the small CUDA-side calls the transformers translation makes each step (microseconds, median of
2000): the numbers behind a change in its per-step host cost.  Then the calls a mirrored block move makes, each
timed with the GPU idle and behind queued work (a sleep kernel, as behind an engine's forward): a call that waits
for the device, or allocates pinned memory while the last ones are still in flight, shows there.
Usage: python scripts/gpu/op_costs.py"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kvcanary.layout import block_index


def samples(fn: Callable[[], object], n: int, busy: str = "idle") -> list[int]:
    """Host nanoseconds of ``n`` calls of ``fn``.  ``busy``: "idle" (nothing queued), "behind" (right after a sleep
    kernel was queued, the device caught up after each call) or "ahead" (a sleep queued before each call and never
    waited for: the host runs further ahead of the GPU with each call, the earlier calls' memory still in flight)."""
    out = []
    for _ in range(n):
        if busy != "idle":
            torch.cuda._sleep(200_000)  # about 0.1 ms of GPU time ahead of the call
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
        if busy == "behind":
            torch.cuda.synchronize()
    return out


def timed(fn: Callable[[], object], n: int = 2000) -> float:
    return round(statistics.median(samples(fn, n)) / 1000, 2)


def main() -> None:
    dev = torch.device("cuda")
    flat = torch.zeros(1 << 20, dtype=torch.int32, device=dev)
    cells = torch.arange(16, dtype=torch.int64, device=dev)
    toks = torch.ones(16, dtype=torch.int32, device=dev)
    ids = torch.zeros(4096, dtype=torch.int32, device=dev)[:7]
    event = torch.cuda.Event()
    host = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)
    dbuf = torch.empty(1 << 16, dtype=torch.uint8, device=dev)
    costs = {
        "index_copy_": timed(lambda: flat.index_copy_(0, cells, toks)),
        "untyped_storage().nbytes()": timed(lambda: ids.untyped_storage().nbytes()),
        "as_strided": timed(lambda: ids.as_strided((16,), (1,))),
        "event.record()": timed(lambda: event.record()),
        "event.query()": timed(lambda: event.query()),
        "torch.empty(pinned 64 KiB)": timed(lambda: torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)),
        "copy_ H2D 4 KiB": timed(lambda: dbuf[:4096].copy_(host[:4096], non_blocking=True)),
        "host.numpy()": timed(lambda: host.numpy()),
        "tensor slice": timed(lambda: flat[:17]),
    }
    torch.cuda.synchronize()
    for name, us in costs.items():
        print(f"{name:32s} {us:8.2f} us")
    mirror_calls(dev)


def behind(fn: Callable[[], object], busy: str, n: int = 400) -> str:
    """Median and largest host time of ``fn`` (us), with the GPU as ``busy`` says (see :func:`samples`)."""
    out = samples(fn, n, busy)
    torch.cuda.synchronize()  # the next mode starts with nothing of these queued
    return f"{statistics.median(out) / 1000:8.2f} {max(out) / 1000:8.1f}"


def mirror_calls(dev: torch.device) -> None:
    """The calls of one mirrored move (:mod:`kvcanary.adapters.transformers_cb.mirror`), GPU idle and busy."""
    blocks = [5, 9, 2, 31, 17, 4, 40, 11]
    pairs = torch.zeros(4, 48, 8, dtype=torch.int32, device=dev)
    engine_ids = torch.tensor(blocks, dtype=torch.int32, device=dev)
    index = block_index(blocks, dev)
    got = pairs.index_select(1, index)
    calls = {
        "block_index (pinned, 8 blocks)": lambda: block_index(blocks, dev),
        "tensor(list).to (pageable)": lambda: torch.tensor(blocks, dtype=torch.int64).to(dev, non_blocking=True),
        "cat of 2 + to(int64)": lambda: torch.cat([engine_ids, engine_ids]).to(dev, torch.int64, non_blocking=True),
        "ids.to(int64)": lambda: engine_ids.to(dev, torch.int64, non_blocking=True),
        "index_select (8 blocks)": lambda: pairs.index_select(1, index),
        "index_copy_ (8 blocks)": lambda: pairs.index_copy_(1, index, got),
    }
    modes = ("idle", "behind", "ahead")
    print("mirror calls, us (median, largest): " + ", ".join(modes) + " (see behind())")
    for name, call in calls.items():
        print(f"{name:32s} " + "  ".join(behind(call, mode) for mode in modes))


if __name__ == "__main__":
    main()

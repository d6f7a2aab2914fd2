"""Host time of the small CUDA-side calls the transformers translation makes each step (microseconds, median of
2000): the numbers behind a change in its per-step host cost.  Usage: python scripts/gpu/op_costs.py"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], n: int = 2000) -> float:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return round(statistics.median(out) / 1000, 2)


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


if __name__ == "__main__":
    main()

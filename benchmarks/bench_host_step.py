"""Host (Python) time of ``CanaryManager.host_step`` per step on the GPU path with CUDA graphs.

The canary's device work (before_forward + after_forward for a decode batch) is captured once in a
CUDA graph; each step replays it, synchronises (as a serving loop does on its sampled tokens) and
then times ``host_step(request_ids)`` alone: the asynchronous device-to-host copy of the outbox,
the event, and decoding the previous step (clean run: no violations).  Target: <= 15 us.

Writes ``{"scenario": "host_step_overhead", "median_us", "p20_us", "p80_us", ...}`` records into
``<results-dir>/<gpu>-<commit>-host.json`` (``{"meta": {...}, "records": [...]}``, through
``bench_common.save_records``; the meta carries the ``host_step`` breakdown).

Usage: ``PYTHONPATH=src python benchmarks/bench_host_step.py --commit <sha> [--results-dir DIR]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from bench_common import meta, save_records
from kvcanary import CanaryConfig, CanaryGroup, Capacities, Mode, StepBatch
from kvcanary.runtime import CanaryManager
from kvcanary.runtime.cuda_calls import CudaCalls


def decode_batch(batch: int, prefix: int, page: int, device: str) -> tuple[CanaryGroup, Capacities, StepBatch]:
    """A clean decode step: ``batch`` requests with ``prefix`` tokens each, one new token each."""
    width = -(-(prefix + 1) // page)  # table columns
    rows = torch.arange(1, batch + 1, dtype=torch.int32)
    table = torch.zeros(batch + 1, width, dtype=torch.int32)
    table[1:] = (1 + torch.arange(batch * width, dtype=torch.int32)).view(batch, width)
    pos = torch.full((batch,), prefix, dtype=torch.int32)
    loc = (table[1:, prefix // page].long() * page + prefix % page).to(torch.int32)
    group = CanaryGroup(num_slots=(1 + batch * width) * page, name=f"page{page}", page_size=page)
    caps = Capacities(
        max_batch=batch, max_tokens=batch * prefix, verify_entries=batch * (prefix + 1), max_context=prefix + 1
    )
    b = StepBatch(
        rows=rows.to(device),
        prefix_lens=pos.to(device),
        extend_lens=torch.ones(batch, dtype=torch.int32, device=device),
        table=table.to(device),
        input_ids=(rows * 1000 + pos).to(device),
        positions=pos.to(device),
        out_cache_loc=loc.to(device),
    )
    return group, caps, b


def prefill_batch(decode: StepBatch, page: int, prefix: int) -> StepBatch:
    """The prefill that writes each request's ``prefix`` tokens, so the decode step verifies clean."""
    n = decode.batch_size
    rows, table, dev = decode.rows.cpu(), decode.table.cpu(), decode.rows.device
    pos = torch.arange(prefix, dtype=torch.int32).repeat(n)
    req = rows.repeat_interleave(prefix)
    loc = (table[req.long(), (pos // page).long()].long() * page + pos % page).to(torch.int32)
    return StepBatch(
        rows=decode.rows,
        prefix_lens=torch.zeros(n, dtype=torch.int32, device=dev),
        extend_lens=torch.full((n,), prefix, dtype=torch.int32, device=dev),
        table=decode.table,
        input_ids=(req * 1000 + pos).to(dev),
        positions=pos.to(dev),
        out_cache_loc=loc.to(dev),
    )


def measure(groups: int, batch: int, prefix: int, steps: int, warmup: int, device: str) -> dict[str, object]:
    built = [decode_batch(batch, prefix, page, device) for page in (1, 16)[:groups]]
    mgr = CanaryManager(
        [g for g, _, _ in built],
        {g.name: c for g, c, _ in built},
        CanaryConfig(mode=Mode.LOG),
        device=device,
    )
    batches = {g.name: b for g, _, b in built}
    ids = [f"req-{i}" for i in range(batch)]
    mgr.before_forward({g.name: prefill_batch(b, g.page_size, prefix) for g, _, b in built})
    mgr.after_forward()
    mgr.host_step(ids)

    def step() -> None:
        mgr.before_forward(batches)
        mgr.after_forward()

    step()  # eager: compiles the kernels
    mgr.host_step(ids)
    cuda = device == "cuda"
    graph = torch.cuda.CUDAGraph() if cuda else None
    if graph is not None:
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            step()
    times: list[float] = []
    for i in range(warmup + steps):
        if graph is not None:
            graph.replay()
            torch.cuda.synchronize()
        else:
            step()  # CPU dry run: eager, reference path
        t0 = time.perf_counter_ns()
        report = mgr.host_step(ids)
        t1 = time.perf_counter_ns()
        if report is not None:
            raise RuntimeError(f"the benchmark workload is not clean: {report.block()}")
        if i >= warmup:
            times.append((t1 - t0) / 1000.0)
    if mgr.flush() is not None or mgr.stats()["health_failures"]:
        raise RuntimeError("the benchmark workload is not clean")
    q = statistics.quantiles(times, n=10)
    return {
        "scenario": "host_step_overhead" if groups == 1 else f"host_step_overhead_{groups}groups",
        "median_us": round(statistics.median(times), 3),
        "p20_us": round(q[1], 3),
        "p80_us": round(q[7], 3),
        "groups": groups,
        "batch": batch,
        "prefix": prefix,
        "steps": steps,
    }


def measure_launch(groups: int, batch: int, prefix: int, steps: int, device: str) -> dict[str, object]:
    """Host time of an eager before_forward + after_forward (what an engine without CUDA graphs pays per
    step: one validation per group, then each group's three Triton launches and the bookkeeping ops), of
    one bare verify launch (``checked=True``: no host checks at all), for comparison, and of the same pair
    through ``forward_step`` (one replay of the canary's own step graph)."""
    from kvcanary.ops import launchers

    built = [decode_batch(batch, prefix, page, device) for page in (1, 16)[:groups]]
    mgr = CanaryManager(
        [g for g, _, _ in built], {g.name: c for g, c, _ in built}, CanaryConfig(mode=Mode.LOG), device=device
    )
    batches = {g.name: b for g, _, b in built}
    canary = mgr.canaries[built[0][0].name]
    log = mgr._work.logs[0]

    def step() -> None:
        mgr.before_forward(batches)
        mgr.after_forward()

    def verify() -> None:
        launchers.verify(canary.state(log), built[0][2], canary.caps.verify_entries, checked=True)

    def forward_step() -> None:  # the same pair through forward_step: on CUDA, replays the canary's own graph
        mgr.forward_step(batches)

    out: dict[str, object] = {"scenario": "launch_eager" if groups == 1 else f"launch_eager_{groups}groups"}
    for name, fn in (("step", step), ("verify_launch", verify), ("forward_step", forward_step)):
        fn()  # compile (forward_step: seen once)
        fn()  # forward_step: captured (the tensors keep their addresses)
        times = []
        for i in range(steps):
            t0 = time.perf_counter_ns()
            fn()
            times.append((time.perf_counter_ns() - t0) / 1000.0)
            if i % 64 == 63 and device == "cuda":
                torch.cuda.synchronize()  # keep the launch queue short
        q = statistics.quantiles(times, n=10)
        out |= {f"{name}_median_us": round(statistics.median(times), 3), f"{name}_p20_us": round(q[1], 3),
                f"{name}_p80_us": round(q[7], 3)}  # fmt: skip
    out["median_us"] = out["step_median_us"]
    return out | {"groups": groups, "batch": batch, "prefix": prefix, "steps": steps}


def breakdown(iters: int = 2000) -> dict[str, object]:
    """Median host time of host_step's pieces (printed, not stored): where the microseconds go."""
    group, caps, _ = decode_batch(8, 16, 1, "cuda")
    mgr = CanaryManager([group], {group.name: caps}, CanaryConfig(mode=Mode.LOG), device="cuda")
    outbox, host = mgr._work.outbox, mgr._pump.buffers[0].tensor
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    stream = torch.cuda.current_stream()

    def timed(fn: Callable[[], object]) -> float:
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            fn()
            ts.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        return round(statistics.median(ts) / 1000.0, 3)

    calls = CudaCalls(torch.cuda.current_device())
    fallback = CudaCalls(torch.cuda.current_device(), bindings=False)
    fallback_transfer = fallback.download(host, outbox)
    out: dict[str, object] = {
        "copy_non_blocking_us": timed(lambda: host.copy_(outbox, non_blocking=True)),
        "event_record_us": timed(lambda: event.record(stream)),
        "event_synchronize_done_us": timed(event.synchronize),
        "is_capturing_us": timed(torch.cuda.is_current_stream_capturing),
        "outbox_bytes": float(outbox.numel() * 8),
        "pump_send_torch_us": timed(lambda: fallback_transfer.send(outbox.nbytes)),
        "pump_landed_torch_us": timed(fallback_transfer.landed),
    }
    for path in ("bindings", "cudart"):  # the pump's direct paths, where there: the copy and its record
        direct = CudaCalls(torch.cuda.current_device(), runtime=path)
        if direct.through_bindings:
            transfer = direct.download(host, outbox)
            out |= {
                f"pump_send_{path}_us": timed(functools.partial(transfer.send, outbox.nbytes)),
                f"pump_landed_{path}_us": timed(transfer.landed),
            }
    out["calls_path"] = calls.path  # the path the canary takes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=os.environ.get("KVCANARY_COMMIT", "unknown"))
    ap.add_argument("--results-dir", default=None, help="default: benchmarks/results")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--cpu-dry-run", action="store_true", help="check the script on CPU (eager, no graphs)")
    args = ap.parse_args()
    device = "cpu" if args.cpu_dry_run else "cuda"
    measure(1, args.batch, args.prefix, args.warmup, args.warmup, device)  # warm the process (first run read high)
    records = [measure(g, args.batch, args.prefix, args.steps, args.warmup, device) for g in (1, 2)]
    if not args.cpu_dry_run:  # the kernel path only (the CPU dry run uses the reference)
        records += [measure_launch(g, args.batch, args.prefix, min(args.steps, 2000), device) for g in (1, 2)]
    for r in records:
        print(json.dumps(r))
    m = meta(args.commit, torch.device(device))
    if not args.cpu_dry_run:
        m["breakdown_us"] = breakdown()
        print(json.dumps({"breakdown": m["breakdown_us"]}))
    save_records(args.results_dir, m, args.commit, "-host.json", records)


if __name__ == "__main__":
    main()

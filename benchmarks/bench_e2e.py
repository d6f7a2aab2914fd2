"""The canary's added time inside a CUDA-graphed decode step of a Qwen3-0.6B-shaped model.

The model is transformers' own Qwen3 modelling code with random bf16 weights (hidden 1024, 28 layers,
16 heads, 8 KV heads, head dim 128, vocab 151936, ``sdpa``) and a static KV cache sized for the point.
Three graphs are captured per point and their replays timed with CUDA events, interleaved:

* ``step``: the model's forward alone (one decode token per request, or one prefill chunk);
* ``step+canary``: ``before_forward`` (plan/verify/stamp), the same forward, ``after_forward``;
* ``canary``: the canary's before/after alone.

The canary's tables are laid out as a paged engine's: 16-slot pages handed out in shuffled order, every
request's prefix stamped and clean, the ground truth passed.  ``host_step`` runs outside the graphs
after each canary replay and is timed on the host.

Per point: ``added_us`` = median(step+canary) - median(step); ``share_pct`` = added / step;
``roofline_us`` = (weight bytes + KV bytes attention reads) / the copy bandwidth measured in this run
(for the prefill chunk, the larger of that and its matrix FLOPs / the bf16 matmul rate measured in
this run); ``roofline_share_pct`` = the canary's own time (``canary_us``, its graph alone) / roofline.

Writes ``benchmarks/results/<gpu>-<commit>-e2e.json`` ({"meta", "records"}, scenarios ``e2e_*``) after
every point, so a run cut short keeps what it finished.
Usage: PYTHONPATH=src python benchmarks/bench_e2e.py --commit <sha> [--points decode_b1_p512,...]
       [--dry-run]  (a 2-layer toy on the CPU, eager: checks the harness only)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import bf16_matmul_rate, copy_bandwidth, meta, pct, result_path
from kvcanary.batch import StepBatch
from kvcanary.config import CanaryConfig, Mode
from kvcanary.layout import CanaryGroup
from kvcanary.ops import reference as ref
from kvcanary.runtime import CanaryManager
from kvcanary.workspace import Capacities, GroupState, PlanWorkspace, ViolationLog
from qwen3_model import (
    QWEN3_06B,
    TOY,
    build_model,
    kv_bytes_per_token,
    matmul_flops,
    transformers_version,
    weight_bytes,
)

PAGE = 16
KV_BUDGET_BYTES = 64 << 30  # points whose static cache would exceed this are left out (recorded as such)


@dataclasses.dataclass(frozen=True)
class Point:
    batch: int
    prefix: int
    query: int  # tokens per request this step: 1 (decode) or the chunk

    @property
    def name(self) -> str:
        tag = {512: "512", 4096: "4k", 16384: "16k"}.get(self.prefix, str(self.prefix))
        if self.query > 1:
            return f"e2e_prefill_{self.query // 1024}k" if self.query % 1024 == 0 else f"e2e_prefill_{self.query}"
        return f"e2e_decode_b{self.batch}_p{tag}"


def all_points(dry_run: bool) -> list[Point]:
    if dry_run:
        return [Point(1, 40, 1), Point(3, 24, 1), Point(1, 0, 64)]
    out = [Point(b, p, 1) for b in (1, 32, 128, 256) for p in (512, 4096, 16384)]
    return [*out, Point(1, 0, 16384)]


# --------------------------------------------------------------------------- the model


# --------------------------------------------------------------------------- the canary, laid out as a paged engine


@dataclasses.dataclass
class CanaryWorld:
    manager: CanaryManager
    batch: StepBatch
    request_ids: list[str]


def build_canary(pt: Point, dev: torch.device, gen: torch.Generator) -> CanaryWorld:
    span = pt.prefix + pt.query
    pages_per_row = -(-span // PAGE)
    n_pages = pt.batch * pages_per_row
    num_slots = (1 + n_pages) * PAGE  # page 0 reserved (padding)
    group = CanaryGroup(num_slots=num_slots, page_size=PAGE, reserved_slots=(0,))  # page 0: never in a table
    pages = (1 + torch.randperm(n_pages, generator=gen)).to(torch.int32)
    table = torch.zeros(pt.batch + 1, pages_per_row, dtype=torch.int32)
    table[1:] = pages.view(pt.batch, pages_per_row)
    tokens = torch.randint(0, 150_000, (pt.batch, span), generator=gen, dtype=torch.int32)
    pos = torch.arange(span)
    slots = (table[1:, pos // PAGE].long() * PAGE + pos % PAGE).to(dev)  # [batch, span]
    table, tokens = table.to(dev), tokens.to(dev)
    truth = torch.zeros(pt.batch + 1, span, dtype=torch.int32, device=dev)
    truth[1:] = tokens
    rows = torch.arange(1, pt.batch + 1, dtype=torch.int32, device=dev)
    full = torch.full((pt.batch,), 1, dtype=torch.int32, device=dev)
    caps = Capacities(
        max_batch=pt.batch, max_tokens=pt.batch * pt.query, verify_entries=max(span, pt.batch * pt.prefix),
        max_context=span,
    )  # fmt: skip
    manager = CanaryManager([group], caps, CanaryConfig(mode=Mode.LOG), device=dev)
    records = manager.canaries[group.name].records
    if pt.prefix:  # stamp every prefix with the reference (set-up only)
        pre = StepBatch(
            rows=rows, prefix_lens=torch.zeros_like(full), extend_lens=full * pt.prefix, table=table,
            input_ids=tokens[:, : pt.prefix].flatten(), positions=pos[: pt.prefix].repeat(pt.batch).to(dev),
            out_cache_loc=slots[:, : pt.prefix].flatten(),
        )  # fmt: skip
        setup = Capacities(max_batch=pt.batch, max_tokens=pt.batch * pt.prefix, verify_entries=1)
        ws = PlanWorkspace.allocate(setup, dev, num_slots=num_slots)
        log = ViolationLog.allocate(4, dev)
        ref.plan(GroupState(group, records, ws, log), pre)
        ref.stamp(GroupState(group, records, ws, log), pre)
        if log.total():
            raise RuntimeError(f"{pt.name}: stamping the prefixes raised violations")
    batch = StepBatch(
        rows=rows, prefix_lens=full * pt.prefix, extend_lens=full * pt.query, table=table,
        input_ids=tokens[:, pt.prefix :].flatten().contiguous(),
        positions=pos[pt.prefix :].repeat(pt.batch).to(dev), out_cache_loc=slots[:, pt.prefix :].flatten().contiguous(),
        truth=truth, truth_lens=full * span,
    )  # fmt: skip
    return CanaryWorld(manager, batch, [f"req{i}" for i in range(pt.batch)])


# --------------------------------------------------------------------------- timing


class Graphs:
    """The three captured regions of one point, replayed interleaved and timed with CUDA events."""

    def __init__(self, regions: dict[str, Callable[[], None]], dev: torch.device) -> None:
        self.regions = regions
        self.cuda = dev.type == "cuda"
        self.graphs: dict[str, Any] = {}
        if self.cuda:
            for name, fn in regions.items():
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                self.graphs[name] = g

    def run(self, name: str) -> float:
        """One replay (eager call on the CPU dry run); its microseconds."""
        if not self.cuda:
            t0 = time.perf_counter()
            self.regions[name]()
            return (time.perf_counter() - t0) * 1e6
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graphs[name].replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0


def decode_inputs(pt: Point, cfg: Any, dev: torch.device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, cfg.vocab_size, (pt.batch, pt.query), generator=gen).to(dev)
    pos = torch.arange(pt.prefix, pt.prefix + pt.query, device=dev)
    return {"input_ids": ids, "position_ids": pos.expand(pt.batch, -1).contiguous()}


def rewind(cache: Any, length: int) -> None:
    """Set every static layer's fill level back to ``length`` (a device tensor the captured step reads and
    advances), outside the timed replay, so each replay writes the same position."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            layer.cumulative_length.fill_(length)


def _summary(pt: Point, times: dict[str, list[float]], host: list[float]) -> dict[str, Any]:
    """A point's record: medians and p20/p80 of the step alone, with the canary and the canary alone."""
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "step_us": round(med["step"], 2),
        "step_p20_us": round(pct(times["step"], 0.2), 2),
        "step_p80_us": round(pct(times["step"], 0.8), 2),
        "step_with_canary_us": round(med["step+canary"], 2),
        "added_us": round(med["step+canary"] - med["step"], 2),
        "canary_us": round(med["canary"], 2),
        "canary_p20_us": round(pct(times["canary"], 0.2), 2),
        "canary_p80_us": round(pct(times["canary"], 0.8), 2),
        "host_step_us": round(statistics.median(host), 2),
        "verified_per_step": pt.batch * pt.prefix,
        "stamped_per_step": pt.batch * pt.query,
    }


def measure_point(pt: Point, model: Any, dev: torch.device, gen: torch.Generator, replays: int) -> dict[str, Any]:
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=pt.prefix + pt.query)
    inputs = decode_inputs(pt, model.config, dev, gen)
    world = build_canary(pt, dev, gen)
    mgr = world.manager

    def step() -> None:
        model(**inputs, cache=cache, use_cache=True, logits_to_keep=1)

    def canary_before() -> None:
        mgr.before_forward({"full": world.batch})

    def step_with_canary() -> None:
        canary_before()
        step()
        mgr.after_forward()

    def canary_alone() -> None:
        canary_before()
        mgr.after_forward()

    with torch.inference_mode():
        for _ in range(2):  # warm-up: the cache's lazy allocation, kernel compilation, cuBLAS handles
            rewind(cache, pt.prefix)
            step_with_canary()
            mgr.host_step(world.request_ids)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        rewind(cache, pt.prefix)
        graphs = Graphs({"step": step, "step+canary": step_with_canary, "canary": canary_alone}, dev)
        times: dict[str, list[float]] = {k: [] for k in graphs.regions}
        host: list[float] = []
        for i in range(replays + 2):
            for name in graphs.regions:
                rewind(cache, pt.prefix)
                us = graphs.run(name)
                if name != "step":
                    t0 = time.perf_counter()
                    mgr.host_step(world.request_ids)
                    if i >= 2:
                        host.append((time.perf_counter() - t0) * 1e6)
                if i >= 2:
                    times[name].append(us)
    mgr.flush()
    stats = mgr.stats()
    expected = (2 + 2 * (replays + 2)) * pt.batch * pt.prefix  # warm-ups + canary replays, every prefix entry
    if stats["violations"] or stats["health_failures"] or stats["verified_slots"] != expected:
        raise RuntimeError(f"{pt.name}: canary not clean or incomplete: {stats} (expected {expected} verified)")
    return _summary(pt, times, host)


def run(args: argparse.Namespace, dev: torch.device) -> int:
    gen = torch.Generator().manual_seed(0)
    model = build_model(TOY if args.dry_run else QWEN3_06B, dev)
    elem = 2 if dev.type == "cuda" else 4
    per_token = kv_bytes_per_token(model.config, elem)
    wbytes = weight_bytes(model)
    bw, rate = copy_bandwidth(dev), bf16_matmul_rate(dev)
    print(f"weights {wbytes / 1e9:.3f} GB; KV {per_token} B/token; copy {bw / 1e12:.2f} TB/s; "
          f"bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip
    m = meta(args.commit, dev) | {
        "copy_bandwidth_tb_s": round(bw / 1e12, 3), "bf16_matmul_tflop_s": round(rate / 1e12, 1),
        "model": "Qwen3-0.6B-shaped (random bf16 weights, sdpa, static cache)" if not args.dry_run else "toy",
        "weight_bytes": wbytes, "kv_bytes_per_token": per_token, "replays": args.replays,
        "transformers": transformers_version(),
    }  # fmt: skip
    out = result_path(args.out, m["gpu"], args.commit, "-e2e.json")
    wanted = set(args.points.split(",")) if args.points else None
    records: list[dict[str, Any]] = []
    print(f"{'scenario':24} {'step us':>9} {'added':>7} {'canary':>7} {'host':>6} {'share%':>7} {'roof%':>6}")
    for pt in all_points(args.dry_run):
        if wanted is not None and pt.name not in wanted:
            continue
        kv = pt.batch * (pt.prefix + pt.query) * per_token
        if kv > KV_BUDGET_BYTES:
            print(f"{pt.name:24} skipped: its KV cache needs {kv / 2**30:.0f} GiB", flush=True)
            continue
        try:
            rec = measure_point(pt, model, dev, gen, args.replays)
        except torch.OutOfMemoryError as exc:
            print(f"{pt.name:24} out of memory: {exc}", flush=True)
            continue
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        mem_roof = (wbytes + pt.batch * pt.prefix * per_token) / bw * 1e6
        flop_roof = matmul_flops(model, pt.batch * pt.query) / rate * 1e6
        roof = max(mem_roof, flop_roof)
        rec = {"scenario": pt.name, "batch": pt.batch, "prefix": pt.prefix, "query": pt.query} | rec
        rec |= {
            "roofline_us": round(roof, 2), "roofline_bound": "memory" if mem_roof >= flop_roof else "compute",
            "share_pct": round(100 * max(rec["added_us"], 0.0) / rec["step_us"], 3),
            "roofline_share_pct": round(100 * rec["canary_us"] / roof, 3),
        }  # fmt: skip
        records.append(rec)
        out.write_text(json.dumps({"meta": m, "records": records}, indent=1) + "\n")
        print(
            f"{pt.name:24} {rec['step_us']:>9.1f} {rec['added_us']:>7.1f} {rec['canary_us']:>7.1f} "
            f"{rec['host_step_us']:>6.1f} {rec['share_pct']:>7.3f} {rec['roofline_share_pct']:>6.2f}",
            flush=True,
        )
    print(f"wrote {out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--commit", default="unknown")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--points", default=None, help="comma-separated scenario names (default: all that fit)")
    p.add_argument("--dry-run", action="store_true", help="a 2-layer toy on the CPU, eager (harness check)")
    p.add_argument(
        "--out", default=None, help="results folder (default benchmarks/results; a temporary one for --dry-run)"
    )
    args = p.parse_args()
    if args.dry_run:  # a harness check: its toy numbers never land beside the real results
        if args.out is None:
            with tempfile.TemporaryDirectory(prefix="bench-e2e-dry-") as tmp:
                args.out = tmp
                return run(args, torch.device("cpu"))
        return run(args, torch.device("cpu"))
    if not torch.cuda.is_available():
        print("bench_e2e needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    return run(args, torch.device("cuda"))


if __name__ == "__main__":
    sys.exit(main())

"""Per-step cost of plan -> verify -> stamp for one group on a CUDA GPU, under CUDA-graph replay.

Each scenario builds R independent input sets (own table, own slots, own tokens) over one record pool,
stamps their prefixes, checks that a kernel step on each is clean, then captures one graph of
``STEPS_PER_GRAPH`` steps cycling through the sets, and times its replays with CUDA events (per-step
time = replay time / steps).  Slots are handed out in 64-slot runs in shuffled order, as a paged
allocator does.  The reference path runs eagerly on the same GPU as the baseline (it reads totals on
the host, so it cannot be captured).

``floor_us`` = max(bytes the step must move / measured copy bandwidth, one graph-replayed kernel),
where the bytes are: per verified entry its table entry (and lookup entry), its 16-byte record and its
8-byte read mark read and written back (the same-step check's mark, ``mark_bytes``); per written token its
token id, position and write slot (and lookup entry) read, its record written, and its write mark swapped
and its read mark read; per batch row its three lengths read and the plan's row outputs written.  Records
without ``mark_bytes`` (older results) left the marks out of ``bytes``.

Writes ``benchmarks/results/<gpu>-<commit>.json`` ({"meta", "records"}); ``kernel_sweep.py`` times the
goal scenarios under several tunings.
``--breakdown`` times plan + verify alone, the step and the three-launch form side by side;
``--eager-steps N`` only runs N eager steps per scenario (the program to profile with ncu).  ``--page N`` lays
every table out as a paged engine's block table (N slots a block, names ``<scenario>_page<N>``): the kernels then
page each position (a division by the page size), which token tables skip.
Usage: PYTHONPATH=src python benchmarks/bench_kernels.py --commit <sha> [--quick] [--breakdown] [--page N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench_common import copy_bandwidth, graph_kernel_us, meta, pct, save_records, time_graph
from kvcanary.batch import StepBatch
from kvcanary.layout import CanaryGroup, GroupKind, RecordStore
from kvcanary.ops import launchers
from kvcanary.ops import reference as ref
from kvcanary.workspace import Capacities, GroupState, PlanWorkspace, ViolationLog

RUN = 64  # slots per allocator run
STEPS_PER_GRAPH = 16


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    batch: int
    prefix: int
    extend: int
    window: int = 0
    page: int = 1  # > 1: the table holds blocks of this many slots, as paged engines' tables do

    @property
    def verified(self) -> int:
        span = min(self.prefix, self.window) if self.window else self.prefix
        return self.batch * span

    @property
    def tokens(self) -> int:
        return self.batch * self.extend


def scenarios(quick: bool, tiny: bool = False, page: int = 1) -> list[Scenario]:
    """The scenarios; with ``page`` > 1 each with a block table of that page size, named ``<name>_page<page>``."""
    return [s if page == 1 else dataclasses.replace(s, name=f"{s.name}_page{page}", page=page) for s in
            _scenarios(quick, tiny)]  # fmt: skip


def _scenarios(quick: bool, tiny: bool) -> list[Scenario]:
    if tiny:  # --dry-run: the same kinds of scenario at toy sizes, for the CPU interpreter
        return [Scenario("decode_b2_p64", 2, 64, 1), Scenario("prefill_300", 1, 0, 300),
                Scenario("window8_b2_p64", 2, 64, 1, 8)]  # fmt: skip
    out = []
    for b in (1, 32, 128, 256):
        for p, tag in ((512, "512"), (4096, "4k"), (16384, "16k")):
            out.append(Scenario(f"decode_b{b}_p{tag}", b, p, 1))
    out += [Scenario("prefill_4k", 1, 0, 4096), Scenario("prefill_16k", 1, 0, 16384)]
    out += [Scenario("window128_b128_p16k", 128, 16384, 1, 128), Scenario("window4k_b128_p16k", 128, 16384, 1, 4096)]
    if quick:
        keep = {"decode_b1_p512", "decode_b32_p4k", "decode_b256_p16k", "prefill_16k", "window128_b128_p16k"}
        out = [s for s in out if s.name in keep]
    return out


# --------------------------------------------------------------------------- a world on the GPU


@dataclasses.dataclass
class World:
    group: CanaryGroup
    caps: Capacities
    records: RecordStore
    ws: PlanWorkspace
    log: ViolationLog
    batches: list[StepBatch]
    bytes_per_step: int


def _mark_bytes(s: Scenario) -> int:
    """The same-step marks' traffic: each verified entry's int64 read mark read and written back (an atomic
    max), each written token's int32 write mark read and written (a swap) and its read mark read."""
    return s.verified * (8 + 8) + s.tokens * (4 + 4 + 8)


def _batch_bytes(s: Scenario, lookup: bool) -> int:
    look = 4 if lookup else 0
    verify = s.verified * (look + 16) + s.verified * 4 // s.page  # a block table: one entry a page
    stamp = s.tokens * (8 + 8 + 8 + look + 16)
    plan = s.batch * (3 * 4 + 4 + look + 8 + 5 * 8 + 4)  # lengths, seed gather, row outputs
    return verify + stamp + plan + _mark_bytes(s)


def _stamp_prefix(
    s: Scenario, group: CanaryGroup, records: RecordStore, rows: torch.Tensor, table: torch.Tensor,
    slot_table: torch.Tensor, seqs: torch.Tensor, lut: torch.Tensor | None,
) -> None:  # fmt: skip
    """Stamp every row's prefix with the reference (one big step, setup only); ``slot_table``: each row's slot
    per position."""
    dev = table.device
    setup_caps = Capacities(max_batch=s.batch, max_tokens=s.batch * s.prefix, verify_entries=1)
    sws = PlanWorkspace.allocate(setup_caps, dev, num_slots=group.num_slots)
    pre = StepBatch(
        rows=rows,
        prefix_lens=torch.zeros(s.batch, dtype=torch.int32, device=dev),
        extend_lens=torch.full((s.batch,), s.prefix, dtype=torch.int32, device=dev),
        table=table,
        input_ids=seqs[:, : s.prefix].flatten(),
        positions=torch.arange(s.prefix, device=dev).repeat(s.batch),
        out_cache_loc=slot_table[:, : s.prefix].flatten().long().contiguous(),
        lookup=lut,
    )
    slog = ViolationLog.allocate(4, dev)
    ref.plan(GroupState(group, records, sws, slog), pre)
    ref.stamp(GroupState(group, records, sws, slog), pre)
    if slog.total():
        raise RuntimeError(f"{s.name}: prefix stamping raised violations")


def build(s: Scenario, rotations: int, dev: torch.device, gen: torch.Generator) -> World:
    """Input sets, a record pool with every prefix stamped, and a canary state sized for the scenario."""
    lookup = s.window > 0
    span = s.prefix + s.extend
    if RUN % s.page:
        raise ValueError(f"{s.name}: page {s.page} does not divide the allocator's {RUN}-slot runs")
    cols = -(-span // s.page)  # table columns: positions, or blocks of page positions
    per_set = s.batch * cols * s.page
    n_runs = -(-(rotations * per_set) // RUN)
    first = s.page  # slot 0 reserved (padding); with pages, the rest of its page left unused
    num_slots = first + n_runs * RUN
    group = CanaryGroup(
        num_slots=num_slots,
        page_size=s.page,
        kind=GroupKind.SLIDING_WINDOW if s.window else GroupKind.FULL,
        window=s.window,
        uses_lookup=lookup,
        reserved_slots=(0,),
    )
    runs = torch.randperm(n_runs, generator=gen, device="cpu").to(dev)
    slots = (first + runs[:, None] * RUN + torch.arange(RUN, device=dev)).flatten()
    lut = None
    if lookup:  # full index -> window pool slot: another permutation, 0 kept on 0
        lut = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(num_slots - 1, generator=gen)])
        lut = lut.to(dev, torch.int32)
    records = RecordStore.allocate(num_slots, dev)
    caps = Capacities(
        max_batch=s.batch, max_tokens=max(1, s.tokens), verify_entries=max(1, s.verified), max_context=span
    )
    batches = []
    for k in range(rotations):
        row_slots = slots[k * per_set : (k + 1) * per_set].view(s.batch, cols * s.page)
        table = torch.zeros(s.batch + 1, cols, dtype=torch.int32, device=dev)
        table[1:] = (row_slots[:, :: s.page] // s.page).to(torch.int32)  # page-aligned: runs hold whole pages
        slot_table = row_slots[:, :span]
        seqs = torch.randint(0, 150_000, (s.batch, span), generator=gen).to(dev)
        rows = torch.arange(1, s.batch + 1, dtype=torch.int32, device=dev)
        if s.prefix:
            _stamp_prefix(s, group, records, rows, table, slot_table, seqs, lut)
        batches.append(
            StepBatch(
                rows=rows,
                prefix_lens=torch.full((s.batch,), s.prefix, dtype=torch.int32, device=dev),
                extend_lens=torch.full((s.batch,), s.extend, dtype=torch.int32, device=dev),
                table=table,
                input_ids=seqs[:, s.prefix :].flatten().contiguous(),
                positions=torch.arange(s.prefix, span, device=dev).repeat(s.batch),
                out_cache_loc=slot_table[:, s.prefix :].flatten().long().contiguous(),
                lookup=lut,
            )
        )
    ws = PlanWorkspace.allocate(caps, dev, num_slots=num_slots)
    log = ViolationLog.allocate(caps.log_rows, dev)
    return World(group, caps, records, ws, log, batches, _batch_bytes(s, lookup))


# --------------------------------------------------------------------------- timing


def kernel_step(w: World, batch: StepBatch, tuning: launchers.KernelTuning, parts: str = "step") -> None:
    """GroupCanary.step's launches (``step``: plan + verify in one launch, then stamp); for the breakdown
    also ``plan_verify`` alone and ``unfused`` (plan, verify, stamp as three launches)."""
    state = GroupState(w.group, w.records, w.ws, w.log)
    if parts == "unfused":
        launchers.plan(state, batch, tuning=tuning)
        launchers.verify(state, batch, w.caps.verify_entries, tuning=tuning)
    else:
        launchers.plan_verify(state, batch, w.caps.verify_entries, tuning=tuning)
    if parts != "plan_verify":
        launchers.stamp(state, batch, tuning=tuning)


def time_kernels(w: World, tuning: launchers.KernelTuning, replays: int, parts: str = "step") -> list[float]:
    for b in w.batches:  # compile, and check that a step on every set is clean
        kernel_step(w, b, tuning)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if w.log.total():
        raise RuntimeError(f"kernel steps raised violations: {w.log.rows()[:4].tolist()}")

    def record() -> None:
        for i in range(STEPS_PER_GRAPH):
            kernel_step(w, w.batches[i % len(w.batches)], tuning, parts)

    samples = time_graph(record, STEPS_PER_GRAPH, replays)
    if w.log.total():
        raise RuntimeError("graph replays raised violations")
    return samples


def time_reference(w: World, iters: int) -> list[float]:
    log = ViolationLog.allocate(w.caps.log_rows, w.records.device)
    out = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for i in range(iters + 2):
        b = w.batches[i % len(w.batches)]
        sync()
        t0 = time.perf_counter()
        ref.plan(GroupState(w.group, w.records, w.ws, log), b)
        ref.verify(GroupState(w.group, w.records, w.ws, log), b, w.caps.verify_entries)
        ref.stamp(GroupState(w.group, w.records, w.ws, log), b)
        sync()
        if i >= 2:
            out.append((time.perf_counter() - t0) * 1e6)
    if log.total():
        raise RuntimeError("reference steps raised violations")
    return out


# --------------------------------------------------------------------------- main


def run_main(args: argparse.Namespace, dev: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    tuning = launchers.DEFAULT_TUNING
    if args.tuning_json and Path(args.tuning_json).exists():
        tuning = launchers.KernelTuning(**json.loads(Path(args.tuning_json).read_text()))
    print(f"tuning {tuning}", flush=True)
    bw = copy_bandwidth(dev)
    kernel_us = graph_kernel_us(dev)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; one graph-replayed kernel {kernel_us:.2f} us", flush=True)
    records = []
    cols = ("entries", 9), ("median", 8), ("p20", 8), ("p80", 8), ("floor", 7), ("x floor", 7), ("ref", 9)
    print(f"{'scenario':24} " + " ".join(f"{c:>{w}}" for c, w in cols), flush=True)
    for s in scenarios(args.quick, tiny=args.dry_run, page=args.page):
        w = build(s, args.rotations, dev, gen)
        samples = time_kernels(w, tuning, args.replays)
        ref_samples = time_reference(w, args.ref_iters)
        floor = max(w.bytes_per_step / bw * 1e6, kernel_us)
        rec = {
            "scenario": s.name,
            "median_us": round(statistics.median(samples), 2),
            "p20_us": round(pct(samples, 0.2), 2),
            "p80_us": round(pct(samples, 0.8), 2),
            "entries": s.verified,
            "bytes": w.bytes_per_step,
            "mark_bytes": _mark_bytes(s),
            "floor_us": round(floor, 2),
            "reference_median_us": round(statistics.median(ref_samples), 1),
        }
        records.append(rec)
        print(
            f"{s.name:24} {s.verified:>9} {rec['median_us']:>8} {rec['p20_us']:>8} {rec['p80_us']:>8} "
            f"{rec['floor_us']:>7} {rec['median_us'] / floor:>7.2f} {rec['reference_median_us']:>9}",
            flush=True,
        )
        del w
        torch.cuda.empty_cache()
    m = meta(args.commit, dev)
    m |= {
        "copy_bandwidth_tb_s": round(bw / 1e12, 3),
        "graph_kernel_us": round(kernel_us, 3),
        "steps_per_graph": STEPS_PER_GRAPH,
        "rotations": args.rotations,
        "tuning": dataclasses.asdict(tuning),
    }
    save_records(args.out, m, args.commit, ".json", records)


BREAKDOWN = ("decode_b1_p512", "decode_b32_p4k", "decode_b256_p16k", "prefill_16k", "window4k_b128_p16k")


def _picked(s: Scenario, names: Sequence[str], args: argparse.Namespace) -> bool:
    """Whether ``--scenarios`` (or the breakdown's default) names ``s``, by its name with or without the page."""
    return args.dry_run or s.name in names or s.name.removesuffix(f"_page{args.page}") in names


def goal_scenarios(page: int = 1) -> list[Scenario]:
    """The scenarios that stand for the kernel goals (:data:`BREAKDOWN`), as :func:`scenarios` builds them:
    what the sweeps time."""
    return [s for s in scenarios(False, page=page) if s.name.removesuffix(f"_page{page}") in BREAKDOWN]


def run_breakdown(args: argparse.Namespace, dev: torch.device) -> None:
    """Per-step time of the launches apart: plan + verify alone, the step, and the three-launch form."""
    gen = torch.Generator().manual_seed(2)
    names = args.scenarios.split(",") if args.scenarios else BREAKDOWN
    picks = [s for s in scenarios(False, tiny=args.dry_run, page=args.page) if _picked(s, names, args)]
    parts = ("plan_verify", "step", "unfused")
    print(f"{'scenario':24} " + " ".join(f"{p:>12}" for p in parts), flush=True)
    for s in picks:
        w = build(s, args.rotations, dev, gen)
        row = [statistics.median(time_kernels(w, launchers.DEFAULT_TUNING, args.replays, p)) for p in parts]
        print(f"{s.name:24} " + " ".join(f"{v:>12.2f}" for v in row), flush=True)
        del w
        torch.cuda.empty_cache()


def run_eager(args: argparse.Namespace, dev: torch.device) -> None:
    """A few eager steps per scenario and nothing else: the program to put under a profiler (ncu)."""
    gen = torch.Generator().manual_seed(3)
    names = args.scenarios.split(",") if args.scenarios else BREAKDOWN
    for s in (s for s in scenarios(False, tiny=args.dry_run, page=args.page) if _picked(s, names, args)):
        w = build(s, args.rotations, dev, gen)
        for i in range(args.eager_steps):
            kernel_step(w, w.batches[i % len(w.batches)], launchers.DEFAULT_TUNING)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        print(f"{s.name}: {args.eager_steps} eager steps, {w.log.total()} violations", flush=True)
        del w


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--commit", default="unknown")
    p.add_argument("--rotations", type=int, default=4)
    p.add_argument("--replays", type=int, default=40)
    p.add_argument("--ref-iters", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="five scenarios only")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU interpreter (harness check)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--tuning-json", default=None, help="kernel tuning to time (default: the launchers' default)")
    p.add_argument("--breakdown", action="store_true", help="time plan+verify alone, the step, and three launches")
    p.add_argument("--eager-steps", type=int, default=0, help="only run this many eager steps (for a profiler)")
    p.add_argument("--scenarios", default=None, help="comma-separated scenario names (--breakdown, --eager-steps)")
    p.add_argument("--page", type=int, default=1, help="block tables of this page size (names get _page<N>)")
    args = p.parse_args()
    if args.dry_run:
        dev = torch.device("cpu")  # needs TRITON_INTERPRET=1: checks the harness, times nothing real
    elif not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda")
    if args.eager_steps:
        run_eager(args, dev)
    elif args.breakdown:
        run_breakdown(args, dev)
    else:
        run_main(args, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())

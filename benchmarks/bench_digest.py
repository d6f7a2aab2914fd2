"""KV digest throughput and per-step cost on a CUDA GPU, for a Qwen3-0.6B-shaped KV pool.

The pool: 28 layers, K and V each ``[blocks, 16, 8 heads, 128]`` bf16 per layer (114,688 bytes a slot),
``POOL_SLOTS`` slots of random bytes.  Every time is the median of CUDA-graph replays (CUDA events).

* ``digest_stamp_*`` / ``digest_verify_*``: one list call over N slots (contiguous runs or scattered);
  ``gbps`` = bytes digested / time, beside ``copy_gbps``, the device-to-device copy's bytes read +
  written per second measured in the same run (``pct_of_copy`` = gbps / copy_gbps).
* ``digest_step_*``: one engine step's digest work with the default ``DigestConfig``: the budgeted
  verify of the step's read spans (decode batches at prefix 4k) and the stamp of the tokens it writes
  (one per row, or a 16k prefill chunk); ``verify_us`` and ``stamp_us`` time the two calls apart.
  Two references for the step: ``attention_us``, the same step's attention measured here (PyTorch SDPA,
  bf16, 16 query heads over the 8 KV heads, contiguous KV: no paging, so faster than an engine's paged
  kernel and the share it gives is the stricter one), all 28 layers, each its own KV tensors (cycled once
  they exceed the L2 cache many times over), graph-replayed; and ``kv_read_us``, the step's KV bytes read
  once at ``copy_gbps`` (the DRAM traffic rate the copy sustains).  ``pct_of_attention`` and
  ``pct_of_kv_read`` are the digest's shares of each.  Rows of large batches share blocks of the pool
  (the pool is smaller than their KV): the digest's work per slot does not depend on it, and the pool
  is far larger than the L2 cache.

Writes ``benchmarks/results/<gpu>-<commit>-digest.json`` ({"meta", "records"}).
Usage: PYTHONPATH=src python benchmarks/bench_digest.py --commit <sha> [--out DIR] [--dry-run]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

from bench_common import copy_bandwidth, meta, save_records, time_graph
from kvcanary import digest as D
from kvcanary.batch import StepBatch
from kvcanary.canary import GroupCanary
from kvcanary.config import DigestConfig
from kvcanary.digest_canary import GroupDigest
from kvcanary.layout import CanaryGroup
from kvcanary.ops import digest_launchers as dl
from kvcanary.workspace import Capacities, ViolationLog

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS, HEADS, DIM, PAGE = 28, 8, 128, 16
STEPS_PER_GRAPH = 8


class Pool:
    def __init__(self, slots: int, dev: torch.device, layers: int = LAYERS) -> None:
        blocks = slots // PAGE
        self.tensors = [
            torch.empty(blocks, PAGE, HEADS, DIM, dtype=torch.bfloat16, device=dev).view(torch.int16).random_()
            .view(torch.bfloat16)
            for _ in range(2 * layers)
        ]  # fmt: skip
        self.layout = D.DigestLayout(tuple(D.paged_token_major(t) for t in self.tensors))
        self.slots = blocks * PAGE
        self.bytes_per_slot = self.layout.bytes_per_slot


def _median_us(record, replays: int) -> float:  # type: ignore[no-untyped-def]
    return statistics.median(time_graph(record, STEPS_PER_GRAPH, replays))


TUNINGS = [  # the default and its neighbours (digest_sweep.py sweeps the whole grid)
    dl.DEFAULT_TUNING,
    dl.DigestTuning(block_words=64, warps=4, programs_per_sm=16),
    dl.DigestTuning(block_words=64, warps=8, programs_per_sm=8),
    dl.DigestTuning(block_words=128, warps=4, programs_per_sm=8),
]


def list_throughput(
    pool: Pool, n: int, scattered: bool, stamp: bool, replays: int, dev: torch.device,
    tuning: dl.DigestTuning = dl.DEFAULT_TUNING,
) -> dict:  # fmt: skip
    group = CanaryGroup(num_slots=pool.slots, reserved_slots=())
    layout = dl.DeviceLayout.build(pool.layout)
    digests = torch.zeros(pool.slots, dtype=torch.int64, device=dev)
    ws = D.DigestWorkspace.allocate(n, dev)
    log = ViolationLog.allocate(4, dev)
    gen = torch.Generator(device="cpu").manual_seed(n)
    slots = (torch.randperm(pool.slots, generator=gen)[:n] if scattered else torch.arange(n)).to(dev)
    dl.stamp_list(group, layout, digests, ws, log, slots, tuning=tuning)
    call = dl.stamp_list if stamp else dl.verify_list

    def record() -> None:
        for _ in range(STEPS_PER_GRAPH):
            call(group, layout, digests, ws, log, slots, tuning=tuning)

    us = _median_us(record, replays)
    if log.total():
        raise RuntimeError(f"clean pool reported violations: {log.rows()[:2].tolist()}")
    nbytes = n * pool.bytes_per_slot
    return {"us": round(us, 2), "bytes": nbytes, "gbps": round(nbytes / us / 1e3, 1)}


def decode_step(pool: Pool, batch: int, prefix: int, extend: int, dev: torch.device) -> tuple[GroupCanary, StepBatch]:
    """A planned step: ``batch`` rows reading ``prefix`` positions and writing ``extend`` tokens each."""
    group = CanaryGroup(num_slots=pool.slots, page_size=PAGE, reserved_slots=(0,))
    pages = -(-(prefix + extend) // PAGE)
    gen = torch.Generator().manual_seed(batch * 7 + prefix)
    table = torch.randint(1, pool.slots // PAGE, (batch + 1, pages), generator=gen)
    rows = torch.arange(1, batch + 1)
    pos = prefix + torch.arange(extend).repeat(batch)
    r = rows.repeat_interleave(extend)
    loc = table[r, pos // PAGE] * PAGE + pos % PAGE
    b = StepBatch(
        rows=rows, prefix_lens=torch.full((batch,), prefix), extend_lens=torch.full((batch,), extend), table=table,
        input_ids=torch.zeros(batch * extend, dtype=torch.int64), positions=pos, out_cache_loc=loc,
    )  # fmt: skip
    b = b.to(dev)
    caps = Capacities(max_batch=batch, max_tokens=batch * extend, verify_entries=batch * (prefix + extend),
                      max_context=prefix + extend)  # fmt: skip
    canary = GroupCanary(group, caps, dev)
    return canary, b


Q_HEADS = 16  # Qwen3-0.6B's query heads (GQA over the 8 KV heads)
L2_MULTIPLE = 256 << 20  # distinct layer tensors until their KV is this large (the H200's L2 is 50 MB)


def attention_us(batch: int, prefix: int, extend: int, replays: int, dev: torch.device) -> tuple[float, str]:
    """(per-step microseconds, SDPA backend) of the step's attention over all layers, graph-replayed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    span = prefix + extend
    per_layer = 2 * batch * HEADS * span * DIM * 2
    distinct = min(LAYERS, max(2, -(-L2_MULTIPLE // per_layer)))
    q = torch.randn(batch, Q_HEADS, extend, DIM, dtype=torch.bfloat16, device=dev)
    kv = [torch.randn(2, batch, HEADS, span, DIM, dtype=torch.bfloat16, device=dev) for _ in range(distinct)]
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, is_causal=extend > 1, enable_gqa=True)

    def record() -> None:
        for _ in range(STEPS_PER_GRAPH):
            for layer in range(LAYERS):
                sdpa(q, kv[layer % distinct][0], kv[layer % distinct][1])

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                sdpa(q, kv[0][0], kv[0][1])  # raises here if this backend cannot run the shapes
                return _median_us(record, replays), backend.name
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend ran the step's attention")


def step_cost(pool: Pool, batch: int, prefix: int, extend: int, copy_gbps: float, replays: int, dev: torch.device,
              config: DigestConfig, tuning: dl.DigestTuning, attention: tuple[float, str] | None = None,
              ) -> dict:  # fmt: skip
    canary, b = decode_step(pool, batch, prefix, extend, dev)
    digest = GroupDigest(canary, pool.layout, config, tuning=tuning)
    log = canary.new_log()
    canary.plan(b, log)  # the plan the digest's verify selects from (the link canary's own cost, not timed)
    digest.stamp(b, log)

    def steps(*calls):  # type: ignore[no-untyped-def]
        def record() -> None:
            for _ in range(STEPS_PER_GRAPH):
                for call in calls:
                    call(b, log)

        return record

    digest.workspace.stats.zero_()
    us = _median_us(steps(digest.verify_and_stamp), replays)  # one call after the forward (transformers, sglang)
    stats = digest.workspace.stats.tolist()  # verify and stamp calls in pairs
    split_us = _median_us(steps(digest.verify, digest.stamp), replays)  # verify, then stamp (vLLM)
    verify_us = _median_us(steps(digest.verify), replays)
    stamp_us = _median_us(steps(digest.stamp), replays)
    if int(log.counters[16]):
        raise RuntimeError("clean step reported digest mismatches")
    calls = max(stats[D.DigestWorkspace.STAT_CALLS] // 2, 1)
    verified = stats[D.DigestWorkspace.STAT_VERIFIED] / calls
    read_bytes = batch * (prefix + extend) * pool.bytes_per_slot
    kv_read_us = read_bytes / copy_gbps / 1e3
    digested = (verified + batch * extend) * pool.bytes_per_slot
    rec = {
        "us": round(us, 2), "split_us": round(split_us, 2), "verify_us": round(verify_us, 2),
        "stamp_us": round(stamp_us, 2),
        "budget": config.budget, "period": config.period,
        "verified_slots_per_step": round(verified, 1), "stamped_slots_per_step": batch * extend,
        "bytes": int(digested), "gbps": round(digested / us / 1e3, 1),
        "kv_read_bytes": read_bytes, "kv_read_us": round(kv_read_us, 2),
        "pct_of_kv_read": round(100 * us / kv_read_us, 2),
    }  # fmt: skip
    if attention is not None:  # the step's measured attention (the sweeps and dry runs have none)
        rec |= {"attention_us": round(attention[0], 2), "attention_backend": attention[1],
                "pct_of_attention": round(100 * us / attention[0], 2)}  # fmt: skip
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default=None)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--pool-slots", type=int, default=1 << 16)
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU interpreter (format check only)")
    args = p.parse_args()
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cpu" and not args.dry_run:
        print("no CUDA device: use --dry-run", file=sys.stderr)
        return 2
    dry = args.dry_run
    pool = Pool(256 if dry else args.pool_slots, dev, layers=2 if dry else LAYERS)
    copy_gbps = copy_bandwidth(dev) / 1e9
    print(f"copy {copy_gbps:.0f} GB/s (read + written); {pool.bytes_per_slot} bytes a slot", flush=True)
    records = []
    n = 32 if dry else 16384
    sweep = {}
    for t in TUNINGS[:2] if dry else TUNINGS:  # pick the tile shape on this GPU, then use it throughout
        sweep[str(dataclasses.astuple(t))] = list_throughput(pool, n, True, True, args.replays, dev, t)["gbps"]
        print(f"tuning {t}: {sweep[str(dataclasses.astuple(t))]} GB/s", flush=True)
    best = max(TUNINGS[: len(sweep)], key=lambda t: sweep[str(dataclasses.astuple(t))])
    print(f"best {best}", flush=True)
    for stamp in (True, False):
        for scattered in (False, True):
            name = f"digest_{'stamp' if stamp else 'verify'}_{'scattered' if scattered else 'runs'}_{n}"
            rec = {"scenario": name} | list_throughput(pool, n, scattered, stamp, args.replays, dev, best)
            rec |= {"copy_gbps": round(copy_gbps, 1), "pct_of_copy": round(100 * rec["gbps"] / copy_gbps, 1)}
            records.append(rec)
            print(json.dumps(rec), flush=True)
    steps = [(1, 4096, 1), (32, 4096, 1), (256, 4096, 1), (1, 0, 16384)]
    if dry:
        steps = [(1, 40, 1), (3, 40, 1), (1, 0, 48)]
    for batch, prefix, extend in steps:
        attention = None
        if dev.type == "cuda":
            attention = attention_us(batch, prefix, extend, args.replays, dev)
            print(f"attention b{batch} p{prefix} e{extend}: {attention[0]:.1f} us ({attention[1]})", flush=True)
            torch.cuda.empty_cache()
        for config in (DigestConfig(), DigestConfig(budget=1.0)):
            if config.budget == 1.0 and batch == 256:
                continue  # 1M verified slots a step: the throughput rows above already show that rate
            tag = f"b{batch}_p{prefix // 1024}k" if extend == 1 else f"prefill_{extend // 1024 or extend}k"
            name = f"digest_step_{tag}_budget{config.budget:g}"
            rec = {"scenario": name, "copy_gbps": round(copy_gbps, 1)}
            rec |= step_cost(pool, batch, prefix, extend, copy_gbps, args.replays, dev, config, best, attention)
            records.append(rec)
            print(json.dumps(rec), flush=True)
    m = meta(args.commit, dev) | {"copy_bandwidth_tb_s": round(copy_gbps / 1e3, 3), "pool_slots": pool.slots,
                                  "layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "page": PAGE,
                                  "tuning": dataclasses.asdict(best), "sweep_stamp_scattered_gbps": sweep,
                                  "kernel_path": [dataclasses.asdict(c) | dict(zip(("heads_per_step", "words_per_step",
                                                  "exact", "two_word_loads"), c.path(best), strict=True))
                                                  for c in dl.DeviceLayout.build(pool.layout).classes]}  # fmt: skip
    save_records(args.out, m, args.commit, "-digest.json", records)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host time of the transformers adapter's per-step translation (forward kwargs -> StepBatch), by batch shape.

A full-attention group, ``batch`` requests decoding one token each after ``past`` tokens, their blocks
shuffled over the cache as a paged allocator hands them out; the index lists are built the way
transformers builds them (``read_index`` per request: every past token then the new one).  Each timed step
advances every request by one token (new histories, new write slots), so whatever the translator keeps
between steps is exercised as in serving.  The time is the host's: ``translate`` issues its device work
asynchronously (CUDA) and nothing waits for it.

``--cold``: between two steps, other work evicts the CPU caches, as a serving engine's forward does between two
taps.  That is the canary's real cost model: measured in a loop, a step's code stays cached and looks several
times cheaper than in the engine (on the H200 host the graph workload's tap read 760 us at batch 1, this loop
150 us).  Cold, each distinct numpy function or torch call a step touches costs tens of microseconds.

``--buffer-sets N``: the engine's tensors as views of N sets of fixed buffers used in turn (transformers' static
tensors; its async batching alternates two), so a decode step is steady and reuses the last translation of its set.

Usage: PYTHONPATH=src python benchmarks/bench_translate.py [--device cuda] [--shapes 32x576,256x4096] [--kernel-path]
       [--cold] [--buffer-sets 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench_common import meta, save_records
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.host_batch import History, HostBatch
from kvcanary.adapters.transformers_cb.translate import StepTranslator

PAGE, LAYERS = 16, 28


class Requests:
    """``batch`` requests of ``past`` tokens; block tables drawn from a shuffled pool."""

    def __init__(self, batch: int, past: int, steps: int, device: str) -> None:
        self.stride = 2 * PAGE * LAYERS
        pages = -(-(past + steps + 1) // PAGE)
        rng = np.random.default_rng(0)
        self.blocks = (2 + rng.permutation(batch * pages)).reshape(batch, pages)  # blocks 0, 1: trash sectors
        self.geometry = GroupGeometry(
            "full_attention", 0, 0, PAGE, self.stride, int(self.blocks.max()) + 1, 0, 1, self.stride
        )
        self.ids = [f"req{i}" for i in range(batch)]
        self.prompts = [rng.integers(1, 150_000, past).tolist() for _ in range(batch)]
        self.generated: list[list[int]] = [[] for _ in range(batch)]
        self.past = past
        self.last_past = past + steps  # the longest a request gets: what the buffer sets must hold
        self.device = device
        self.buffer_sets: list[dict[str, torch.Tensor]] = []

    def use_buffer_sets(self, n: int) -> None:
        """Hand the index tensors as views of ``n`` sets of fixed buffers used in turn, as transformers does (its
        static tensors; async batching alternates two sets): what lets the translator reuse a steady step's."""
        size = 2 * len(self.ids) * (self.last_past + 64)
        self.buffer_sets = [{} for _ in range(n)]
        for bufs in self.buffer_sets:
            for name in ("input_ids", "position_ids", "cu_seq_lens_k", "read_index", "write_index"):
                bufs[name] = torch.zeros(size, dtype=torch.int64, device=self.device)

    @staticmethod
    def _in_buffers(kwargs: dict[str, Any], bufs: dict[str, torch.Tensor]) -> dict[str, Any]:
        def put(name: str, t: torch.Tensor) -> torch.Tensor:
            view = bufs[name][: t.numel()].view(t.shape)
            return view.copy_(t)

        out = dict(kwargs)
        out["input_ids"], out["position_ids"] = (
            put("input_ids", kwargs["input_ids"]),
            put("position_ids", kwargs["position_ids"]),
        )
        out["cu_seq_lens_k"] = {k: put("cu_seq_lens_k", t) for k, t in kwargs["cu_seq_lens_k"].items()}
        out["read_index"] = [put("read_index", kwargs["read_index"][0])]
        out["write_index"] = [put("write_index", kwargs["write_index"][0])]
        return out

    def phys(self, r: int, pos: np.ndarray) -> np.ndarray:
        return self.blocks[r, pos // PAGE] * self.stride + pos % PAGE

    def step(self) -> tuple[dict[str, Any], HostBatch]:
        b, p = len(self.ids), self.past
        read = np.concatenate([self.phys(r, np.arange(p + 1)) for r in range(b)])
        write = np.concatenate([self.phys(r, np.array([p])) for r in range(b)])
        toks = [(self.prompts[r] + self.generated[r])[p] if p < len(self.prompts[r]) else 7 for r in range(b)]
        dev = self.device
        kwargs = {
            "input_ids": torch.tensor([toks], device=dev),
            "position_ids": torch.full((1, b), p, device=dev),
            "cu_seq_lens_q": torch.arange(b + 1, dtype=torch.int32, device=dev),
            "cu_seq_lens_k": {"full_attention": torch.arange(b + 1, dtype=torch.int32, device=dev) * (p + 1)},
            "read_index": [torch.from_numpy(read).to(dev)],
            "write_index": [torch.from_numpy(write).to(dev)],
        }
        if self.buffer_sets:
            kwargs = self._in_buffers(kwargs, self.buffer_sets[self.past % len(self.buffer_sets)])
        # The engine's histories, as the adapter captures them (History: read without copying).
        truth = tuple(History(self.prompts[r], self.generated[r]) for r in range(b))
        host = HostBatch(tuple(self.ids), (p,) * b, (1,) * b, truth, histories=True)
        for g in self.generated:
            g.append(7)
        self.past += 1
        return kwargs, host


class CacheChurn:
    """Work that evicts the CPU caches between two steps: small torch ops, a 64 MB numpy pass, dict lookups."""

    def __init__(self) -> None:
        self.layers = [torch.nn.Linear(64, 64) for _ in range(40)]
        self.x = torch.randn(4, 64)
        self.big = np.random.default_rng(0).random(8 << 20)
        self.table = {i: str(i) for i in range(200_000)}

    def __call__(self) -> None:
        with torch.no_grad():
            y = self.x
            for layer in self.layers:
                y = torch.nn.functional.gelu(layer(y)).softmax(-1).contiguous()
        self.big.sum()
        sum(len(self.table[k]) for k in range(0, 200_000, 7))


def measure(
    batch: int, past: int, steps: int, device: str, kernel_path: bool = False, cold: bool = False, buffer_sets: int = 0
) -> dict[str, Any]:
    """Median host time of one step's translation.  ``kernel_path``: what the step tap does on the GPU path
    (the one-launch translation, its launches deferred to the canary's step graph).  On the CPU the device
    work is host work too (the truth gather copies every row), so only CUDA times the tap's host cost.
    The kernel path is laid out as on CUDA (static outputs) on any device.  ``buffer_sets``: the engine's tensors in
    that many sets of fixed buffers, so steady steps reuse a translation (0: fresh tensors every step, never steady)."""
    reqs = Requests(batch, past, steps + 2, device)
    if buffer_sets:
        reqs.use_buffer_sets(buffer_sets)
    tr = StepTranslator(
        [reqs.geometry],
        max_batch=batch,
        max_context=past + steps + 8,
        device=device,
        kernel=kernel_path or None,
        static=True if kernel_path or buffer_sets else None,  # the GPU path's layout
    )
    times = []
    churn = CacheChurn() if cold else None
    handed: list[object] = []  # every translation handed out (held, so identities stay theirs)
    steady = 0
    for i in range(steps + 2):
        kwargs, host = reqs.step()
        if churn is not None:
            churn()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        got = tr.translate(kwargs, host, defer=kernel_path)
        if i >= 2:
            times.append((time.perf_counter_ns() - t0) / 1000.0)
            steady += any(got is t for t in handed)
        handed.append(got)
    median = round(statistics.median(times), 1)
    shape = {"batch": batch, "past": past, "device": device, "kernel_path": kernel_path, "static": tr.static}
    return {**shape, "cold": cold, "buffer_sets": buffer_sets, "steady_steps": steady, "median_us": median}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shapes", default="1x512,32x576,64x2048,256x4096")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kernel-path", action="store_true", help="the GPU path's host work (launches deferred, not run)")
    p.add_argument("--cold", action="store_true", help="evict the CPU caches between steps (as a forward does)")
    p.add_argument(
        "--buffer-sets", type=int, default=0, help="engine tensors in N sets of fixed buffers (steady steps; 2: async)"
    )
    p.add_argument("--commit", default="unknown", help="the commit of the code measured (with --out)")
    p.add_argument("--out", default=None, help="also store the records here, as <machine>-<commit>-translate.json")
    args = p.parse_args()
    records = []
    for shape in args.shapes.split(","):
        b, past = (int(x) for x in shape.split("x"))
        records.append(measure(b, past, args.steps, args.device, args.kernel_path, args.cold, args.buffer_sets))
        print(json.dumps(records[-1]), flush=True)
    if args.out:
        m = meta(args.commit, torch.device(args.device))
        m |= {"numpy": np.__version__, "python": platform.python_version(), "cpu": _cpu_model()}
        if args.device == "cpu":
            m["gpu"] = "cpu"  # a host-time benchmark: the machine is the CPU
        save_records(args.out, m, args.commit, "-translate.json", records)
    return 0


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown")


if __name__ == "__main__":
    sys.exit(main())

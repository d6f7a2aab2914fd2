"""Added host time per step of the ranks' verdict exchange on the clean path (issue 16).

    python scripts/gpu/distributed_verdict_cost.py --backend nccl --world 2 --out $OUT/verdict_cost.json
    python scripts/gpu/distributed_verdict_cost.py --backend gloo --world 2      # the CPU counterpart

Spawns ``--world`` ranks on one host (NCCL: one GPU each).  Each step simulates the engine's forward
(a GPU sleep kernel then the engine's own synchronisation on its sampled tokens; on CPU an idle sleep)
and then times what :class:`~kvcanary.runtime.distributed.DistributedCanary` adds to a clean
``host_step`` on top of the rank's manager:

- ``exchange``: finish the exchange started at the previous step, start this step's (the collective);
- ``wrapper``: the same through the wrapper's own bookkeeping (its finish/start/act of a clean step), with
  ``--exchange-every N`` one exchange per N steps (the median is then per step, amortized in the mean).

Reports median/p90/p99/mean in microseconds per rank; goal on 2 H200s with NCCL: median < 10 us.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvcanary import CanaryConfig, CanaryGroup, Capacities, Mode
from kvcanary.runtime.distributed import DistributedCanary
from kvcanary.runtime.exchange import VerdictExchange


def summary(ns: list[int]) -> dict[str, float]:
    us = sorted(x / 1000 for x in ns)

    def pick(q: float) -> float:
        return us[min(len(us) - 1, int(q * len(us)))]

    return {"median_us": pick(0.5), "p90_us": pick(0.9), "p99_us": pick(0.99), "mean_us": statistics.fmean(us)}


def simulate_forward(cuda: bool, forward_us: float) -> None:
    if cuda:
        # About one cycle per ns on an H200: the forward's length is an order of magnitude only.
        torch.cuda._sleep(int(forward_us * 1000))  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()  # the engine waits for its sampled tokens anyway
        return
    time.sleep(forward_us / 1e6)  # an idle host, as while a GPU runs the forward (a busy wait starves gloo)


def time_exchange(ex: VerdictExchange, args: argparse.Namespace, cuda: bool) -> list[int]:
    out = []
    for step in range(args.warmup + args.steps):
        simulate_forward(cuda, args.forward_us)
        t0 = time.perf_counter_ns()
        if ex.pending:
            ex.finish()
        ex.start(step, 0)
        if step >= args.warmup:
            out.append(time.perf_counter_ns() - t0)
    ex.finish()
    return out


def time_wrapper(canary: DistributedCanary, args: argparse.Namespace, cuda: bool) -> list[int]:
    out = []
    for step in range(args.warmup + args.steps):
        simulate_forward(cuda, args.forward_us)
        t0 = time.perf_counter_ns()
        # What host_step adds to the manager's own host step on a clean step (private on purpose).
        canary._collect(None)
        if canary._window_calls >= canary.exchange_every:
            canary._act(canary._finish() if canary.in_flight == canary.lag else None)
            canary._start()
        if step >= args.warmup:
            out.append(time.perf_counter_ns() - t0)
    canary._finish()
    return out


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    cuda = args.backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        args.backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=60),
    )
    group = dist.group.WORLD
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    ex = VerdictExchange(group, device, timeout_s=30.0)  # type: ignore[arg-type]
    exchange_ns = time_exchange(ex, args, cuda)
    groups = [CanaryGroup(num_slots=1024, name="full")]
    caps = Capacities(max_batch=8, max_tokens=64, verify_entries=512, max_context=64)
    canary = DistributedCanary.create(
        groups,
        caps,
        CanaryConfig(mode=Mode.LOG),
        group,
        device,
        exchange_every=args.exchange_every,  # type: ignore[arg-type]
    )
    wrapper_ns = time_wrapper(canary, args, cuda)
    result: dict[str, Any] = {"rank": rank, "exchange": summary(exchange_ns), "wrapper": summary(wrapper_ns)}
    gathered: list[Any] = [None] * args.world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        env = {
            "backend": args.backend,
            "world": args.world,
            "steps": args.steps,
            "forward_us": args.forward_us,
            "exchange_every": args.exchange_every,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        }
        text = json.dumps({"env": env, "ranks": gathered}, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--forward-us", type=float, default=1000.0, help="simulated forward per step")
    parser.add_argument("--exchange-every", type=int, default=1, help="host steps per exchange (the wrapper)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.backend == "nccl" and torch.cuda.device_count() < args.world:
        raise SystemExit(f"--backend nccl needs {args.world} GPUs, this host has {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(rank_main, args=(args, port), nprocs=args.world, join=True)  # type: ignore[attr-defined,no-untyped-call]


if __name__ == "__main__":
    main()

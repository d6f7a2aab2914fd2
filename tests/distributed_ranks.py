"""One rank of the multi-process canary tests (run as a script by tests/test_distributed.py).

    python distributed_ranks.py RANK WORLD PORT OUT_DIR SCENARIO[,SCENARIO...]

Joins a gloo world on localhost, runs each scenario with a fresh :class:`DistributedCanary` over a
real :class:`CanaryManager` (reference path, real StepBatches from the manager tests' workload), and
writes what it saw to ``OUT_DIR/rank<RANK>.json``.  Every rank builds the same batches (tensor
parallel: the same tables on every rank); a fault edits only the faulty rank's own table copy.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcanary import CanaryConfig, CanaryGroup, Mode
from kvcanary import digest as D
from kvcanary.config import DigestConfig
from kvcanary.runtime import ranked
from kvcanary.runtime.distributed import CanaryPeerError, DistributedCanary, RankedHealthError, RankedViolation
from log_capture import Messages
from runtime_helpers import CAPS, NUM_SLOTS, Workload, alias_first_slot

STEPS = 6
FAULT_AT = 2
PEER_TIMEOUT_S = 2.0
IDS = ["req-a", "req-b"]


def make(mode: Mode, calls: list[Any], lag: int = 1, every: int = 1) -> DistributedCanary:
    def on_fail(ids: list[object], verdict: object) -> None:
        calls.append(ids)

    callback = on_fail if mode is Mode.FAIL_REQUEST else None
    config = CanaryConfig(mode=mode, health_every=0)
    groups = [CanaryGroup(num_slots=NUM_SLOTS, name="full")]
    world = dist.group.WORLD
    assert world is not None
    return DistributedCanary.create(
        groups, CAPS, config, world, on_fail_request=callback, timeout_s=PEER_TIMEOUT_S, lag=lag, exchange_every=every
    )


def verdict_json(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    return {"step": v.step, "ranks": list(v.ranks), "ids": v.affected_request_ids, "health": v.health}


def drive(
    canary: DistributedCanary, faulty: bool, exit_at: int | None = None, stall: bool = False, unhealthy: bool = False
) -> dict[str, Any]:
    """Prefill then decode two requests; returns per call the verdict seen (or the error raised).

    ``faulty``: a corrupt table from FAULT_AT on; ``unhealthy``: at FAULT_AT the step's device work is left
    out, as by a CUDA graph replayed without the canary's work (the phase check fails once)."""
    wl = Workload()
    seen: list[Any] = []
    for k in range(STEPS):
        if faulty and k == FAULT_AT:
            alias_first_slot(wl, victim=2, owner=1)
        if exit_at == k:
            if stall:  # a stuck peer: alive, connected, silent past the others' timeout
                time.sleep(PEER_TIMEOUT_S + 1.5)
            os._exit(17)  # a killed peer: no goodbye to the others
        n = 4 if k == 0 else 1
        if unhealthy and k == FAULT_AT:
            canary.manager._graph_captured = True  # what a capture leaves; this "replay" lacks the canary's work
        else:
            canary.before_forward({"full": wl.batch([(1, n), (2, n)])})
            canary.after_forward()
        t0 = time.monotonic()
        try:
            v = canary.host_step(IDS)
        except RankedViolation as exc:
            return {"seen": seen, "raised_at": k, "ranks": list(exc.verdict.ranks), "step": exc.verdict.step}
        except RankedHealthError as exc:
            v = exc.verdict
            return {"seen": seen, "health_raised_at": k, "health": v.health, "step": v.step, "message": str(exc)}
        except CanaryPeerError as exc:
            return {"seen": seen, "peer_error_at": k, "message": str(exc), "waited_s": time.monotonic() - t0}
        seen.append(verdict_json(v))
    flushed = [verdict_json(v) for v in canary.flush()]
    return {"seen": seen, "flushed": flushed}


def digest_shards(rank: int, world: int) -> dict[str, Any]:
    """An adapter's manager through ``ranked.build_manager`` with the KV digest on each rank's own shard
    (its heads' bytes differ per rank); the faulty rank's shard has one byte flipped under a live slot."""
    group = ranked.EngineGroup(dist.group.WORLD, "tp", world, lag=1)  # type: ignore[arg-type]
    config = CanaryConfig(mode=Mode.LOG, health_every=0, digest=DigestConfig(1.0))
    groups = [CanaryGroup(num_slots=NUM_SLOTS, name="full")]
    manager = ranked.build_manager(groups, CAPS, config, group=group, timeout_s=PEER_TIMEOUT_S)
    shard = torch.zeros(NUM_SLOTS, 2, 4, dtype=torch.bfloat16)
    manager.attach_digests({"full": D.DigestLayout((D.token_major(shard),))})
    wl, seen = Workload(), []
    for k in range(STEPS):
        if rank == world - 1 and k == FAULT_AT:
            shard.view(torch.int16)[int(wl.table[2, 0]), 1, 3] ^= 1  # req-b's first token, this shard only
        batch = wl.batch([(1, 4 if k == 0 else 1), (2, 4 if k == 0 else 1)])
        manager.before_forward({"full": batch})
        for loc, tok in zip(batch.out_cache_loc.tolist(), batch.input_ids.tolist(), strict=True):
            shard[loc] = torch.full((2, 4), float(tok % 97 + rank), dtype=torch.bfloat16)  # "this rank's heads"
        manager.after_forward()
        report = manager.host_step(IDS)
        seen.append(None if report is None else {"step": report.step, "lines": report.lines(), "block": report.block()})
    return {"seen": seen, "flushed": manager.flush() is not None, "kind": type(manager).__name__}


def scenario(name: str, rank: int, world: int) -> dict[str, Any]:
    handler = Messages()
    logging.getLogger("kvcanary").addHandler(handler)
    calls: list[Any] = []
    mode = {
        "clean": Mode.RAISE, "log": Mode.LOG, "fail": Mode.FAIL_REQUEST, "raise": Mode.RAISE,
        "health-fail": Mode.FAIL_REQUEST, "health-raise": Mode.RAISE,
    }  # fmt: skip
    if name == "digest":
        out = digest_shards(rank, world)
    else:
        out = run_scenario(name, rank, world, mode.get(name, Mode.LOG), calls)
    logging.getLogger("kvcanary").removeHandler(handler)
    out.update(callbacks=calls, warnings=handler.messages)
    return out


def run_scenario(name: str, rank: int, world: int, mode: Mode, calls: list[Any]) -> dict[str, Any]:
    faulty_rank = world - 1 if name != "raise" else 0
    canary = make(mode, calls, lag=2 if name == "lag2" else 1, every=3 if name == "every3" else 1)
    if name in ("kill", "stall"):
        return drive(canary, faulty=False, exit_at=FAULT_AT if rank == world - 1 else None, stall=name == "stall")
    if name.startswith("health"):
        return drive(canary, faulty=False, unhealthy=rank == faulty_rank)
    return drive(canary, faulty=name != "clean" and rank == faulty_rank)


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out_dir, names = Path(sys.argv[4]), sys.argv[5].split(",")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=20),
    )
    results = {name: scenario(name, rank, world) for name in names}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown: a killed peer would make it wait


if __name__ == "__main__":
    main()

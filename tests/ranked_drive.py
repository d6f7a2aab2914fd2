"""One rank's run of an adapter's ranked manager, for the engines' multi-process tests (imported by their workers).

An engine's worker builds the engine's own distributed state (its ``init_distributed_environment`` and
``initialize_model_parallel`` on gloo), then hands :func:`run` ``ranked.build_manager`` on the adapter's group and
``ranks.<engine>_group``.  Each scenario builds a fresh manager through the adapter, drives the runtime
workload of tests/runtime_helpers.py (the same tables on every rank, as tensor parallelism has them; a fault
edits one rank's own copy) and records what every call returned or raised; results are rewritten to
``OUT_DIR/rank<RANK>.json`` after each scenario, so a rank killed in the last scenario keeps the others.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcanary import CanaryConfig, CanaryGroup, Mode
from kvcanary.runtime import CanaryViolation
from kvcanary.runtime.distributed import CanaryPeerError
from log_capture import Messages
from runtime_helpers import CAPS, NUM_SLOTS, Workload, alias_first_slot

STEPS = 6
FAULT_AT = 2
PEER_TIMEOUT_S = 3.0  # KVCANARY_PEER_TIMEOUT_S for the workers
IDS = ["req-a", "req-b"]
MODES = {"clean": Mode.RAISE, "log": Mode.LOG, "fail": Mode.FAIL_REQUEST, "raise": Mode.RAISE, "kill": Mode.RAISE}

Build = Callable[..., Any]  # ranked.build_manager on the engine's group


def drive(manager: Any, faulty: bool, die: bool) -> dict[str, Any]:
    """Prefill rows 1 and 2, then decode; per host step the common report (or the error that stopped the run)."""
    wl, seen = Workload(), []
    for k in range(STEPS):
        if faulty and k == FAULT_AT:
            alias_first_slot(wl, victim=2, owner=1)
        n = 4 if k == 0 else 1
        manager.before_forward({"full": wl.batch([(1, n), (2, n)])})
        manager.after_forward()
        if die and k == FAULT_AT:
            os._exit(17)  # a killed peer: after its forward, before its exchange, no goodbye
        t0 = time.monotonic()
        try:
            report = manager.host_step(IDS)
        except CanaryViolation as exc:
            return {"seen": seen, "raised_at": k, "type": type(exc).__name__, "step": exc.report.step}
        except CanaryPeerError as exc:
            return {"seen": seen, "peer_error_at": k, "message": str(exc), "waited_s": time.monotonic() - t0}
        seen.append(None if report is None else {"step": report.step, "ids": report.affected_request_ids,
                                                 "lines": report.lines()})  # fmt: skip
    return {"seen": seen, "flushed": manager.flush() is not None}


def scenario(name: str, build: Build, rank: int, world: int) -> dict[str, Any]:
    handler = Messages()
    logging.getLogger("kvcanary").addHandler(handler)
    calls: list[list[object]] = []
    mode = MODES[name]
    callback = (lambda ids, report: calls.append(list(ids))) if mode is Mode.FAIL_REQUEST else None
    groups = [CanaryGroup(num_slots=NUM_SLOTS, name="full")]
    manager = build(groups, CAPS, CanaryConfig(mode=mode, health_every=0), on_fail_request=callback)
    faulty = 0 if name == "raise" else world - 1
    out = drive(manager, faulty=name in ("log", "fail", "raise") and rank == faulty,
                die=name == "kill" and rank == world - 1)  # fmt: skip
    logging.getLogger("kvcanary").removeHandler(handler)
    out.update(callbacks=calls, warnings=handler.messages, kind=type(manager).__name__)
    return out


def run(build: Build, group: dict[str, Any], rank: int, world: int, names: list[str], out_dir: Path) -> None:
    """``group``: what the worker found out about the engine group the adapter picked (written as is)."""
    results: dict[str, Any] = {"group": group}
    for name in names:
        results[name] = scenario(name, build, rank, world)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_world(worker: Path, world: int, args: list[str], out: Path, limit_s: float) -> dict[int, dict[str, Any]]:
    """Run ``worker RANK WORLD PORT OUT *args`` once per rank (this interpreter, localhost, time-limited); each
    rank's ``OUT/rank<R>.json``, or ``{"missing": outputs}`` for a rank that wrote none.

    Each rank's output goes to ``OUT/rank<R>.log``, not a pipe: a rank blocked on a full pipe would hold up its
    peers' collectives."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [(out / f"rank{r}.log").open("wb") for r in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), str(world), str(port), str(out), *args],
            env=env,
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + limit_s
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    results = {}
    for r in range(world):
        path = out / f"rank{r}.json"
        outputs = [(out / f"rank{q}.log").read_bytes().decode(errors="replace")[-6000:] for q in range(world)]
        results[r] = json.loads(path.read_text()) if path.exists() else {"missing": outputs}
    return results


def check(results: dict[int, dict[str, Any]]) -> None:
    """The assertions every engine's test makes on its world's results (see the engines' test_ranks.py)."""
    world = len(results)
    last = world - 1
    for rank, res in results.items():
        assert res["group"]["ranked"] and not res["group"]["is_default_world"], res["group"]
        assert res["clean"]["seen"] == [None] * STEPS and res["clean"]["warnings"] == []
        seen = res["log"]["seen"]
        hits = [k for k, v in enumerate(seen) if v is not None]
        # decoded at FAULT_AT + 1 by the faulty rank's manager, agreed on one exchange later by every rank
        assert hits and hits[0] == FAULT_AT + 2, seen
        first = seen[hits[0]]
        assert first["step"] == FAULT_AT and first["ids"] == ["req-b"]
        assert first["lines"] and all(line.endswith(f" rank={last}") for line in first["lines"])
        assert res["fail"]["callbacks"] and all(c == ["req-b"] for c in res["fail"]["callbacks"])
        assert res["raise"].get("raised_at") == FAULT_AT + 2 and res["raise"]["type"] == "RankedViolation"
        assert res["log"]["kind"] == "RankedManager"
        if rank != last:
            lost = res["kill"]
            assert lost.get("peer_error_at") in (FAULT_AT, FAULT_AT + 1), lost
            assert "dead or stuck" in lost["message"] and lost["waited_s"] < PEER_TIMEOUT_S + 2.0
    for name in ("log", "fail"):
        assert len({json.dumps([res[name]["seen"], res[name]["callbacks"]]) for res in results.values()}) == 1
    assert "kill" not in results[last]  # the killed rank never finished it

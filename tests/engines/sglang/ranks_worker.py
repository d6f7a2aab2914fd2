"""One rank of tests/engines/sglang/test_ranks.py, run as a script in the sglang venv:

    python ranks_worker.py RANK WORLD PORT OUT_DIR MODEL_DIR SCENARIO[,SCENARIO...]

sglang's own ``Scheduler`` at ``tp_size=WORLD`` in this process (``SchedulerLoop``, this rank's
``tp_rank``): sglang builds its world and its TP group itself (gloo on the CPU) and its Llama runs tensor
parallel, its all-reduces on that world.  The canary is installed as a server installs it, so the adapter
ranks its manager on sglang's TP group.  Each scenario resets the loop, installs the canary in its mode and
serves three requests; a fault aliases one request's first KV slot in this rank's own ``req_to_token`` at a
decode step.  Results are rewritten to ``OUT_DIR/rank<RANK>.json`` after each scenario.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

FAULT_FORWARD = 4  # the decode forward whose batch gets the fault (forwards 1-2: prefill of 3 requests)
PEER_TIMEOUT_S = 3.0
PROMPTS = {"r0": [5, 9, 14, 3, 7, 22, 31, 8], "r1": [11, 4, 19, 27, 6, 13], "r2": [40, 41, 42, 43, 44, 45, 46]}
MODES = {"clean": "raise", "log": "log", "fail": "fail-request", "raise": "raise", "kill": "log"}


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def alias_first_slot(loop: Any, batch: Any) -> None:
    """The fault: the last request's position 0 now points at the first one's slot (this rank's table only)."""
    if loop.forwards_started != FAULT_FORWARD or not batch.forward_mode.is_decode() or len(batch.reqs) < 2:
        return
    table = loop.runner.req_to_token_pool.req_to_token
    rows = [int(r) for r in batch.req_pool_indices.tolist()]  # the batch's table rows, in batch order
    table[rows[-1], 0] = table[rows[0], 0]
    loop.features["fault_" + batch.reqs[-1].rid] += 1


def die_in_host_step(loop: Any, manager: Any) -> None:
    """A killed peer: this rank exits inside its host step of FAULT_FORWARD (after the forward, no goodbye)."""
    step = manager.host_step

    def host_step(ids: Any = None) -> Any:
        if loop.forwards_started == FAULT_FORWARD:
            os._exit(17)
        return step(ids)

    manager.host_step = host_step


def time_host_steps(manager: Any, done: list[float]) -> None:
    """Keep the time the last host step returned: a peer's loss is noticed that long after it."""
    step = manager.host_step

    def host_step(ids: Any = None) -> Any:
        out = step(ids)
        done[0] = time.monotonic()
        return out

    manager.host_step = host_step


def scenario(loop: Any, name: str, rank: int, world: int) -> dict[str, Any]:
    loop.reset()
    handler = Warnings()
    logging.getLogger("kvcanary").addHandler(handler)
    canary = loop.install(MODES[name])
    faulty = 0 if name == "raise" else world - 1
    hook = functools.partial(alias_first_slot, loop) if name in ("log", "fail", "raise") and rank == faulty else None
    last_step_done = [time.monotonic()]
    if name == "kill" and rank == world - 1:
        die_in_host_step(loop, canary.manager)
    elif name == "kill":
        time_host_steps(canary.manager, last_step_done)
    for rid, prompt in PROMPTS.items():
        loop.submit(rid, prompt, max_new_tokens=6)
    out: dict[str, Any] = {"kind": type(canary.manager).__name__}
    try:
        loop.run(max_steps=40, before_forward=hook)
    except Exception as exc:  # recorded and checked by the test
        out.update(error=type(exc).__name__, message=str(exc)[:400], at_forward=loop.forwards_started)
        out["error_after_s"] = time.monotonic() - last_step_done[0]  # since the last host step returned
    reports = list(canary.recent_reports)
    out.update(
        reports=[
            {
                "step": r.step,
                "reported_at": r.reported_at,
                "ids": [str(i) for i in r.affected_request_ids],
                "lines": r.lines(),
            }
            for r in reports
        ],
        failed=list(loop.failed_requests),
        faults=sorted(k for k in loop.features if k.startswith("fault_")),
        forwards=loop.forwards_started,
        stats=canary.stats(),
        warnings=handler.messages[:8],
    )
    logging.getLogger("kvcanary").removeHandler(handler)
    return out


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out_dir, model_dir, names = Path(sys.argv[4]), sys.argv[5], sys.argv[6].split(",")
    os.environ["SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"] = f"tcp://127.0.0.1:{port}"
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(world))
    os.environ["KVCANARY_PEER_TIMEOUT_S"] = str(PEER_TIMEOUT_S)
    from kvcanary.adapters.sglang.selftest.scheduler_loop import LoopConfig, SchedulerLoop, prepare_environment

    prepare_environment()
    with warnings.catch_warnings():  # sglang's import-time notices (CUDA-only quantisation and the like)
        warnings.simplefilter("ignore")
        loop = SchedulerLoop(LoopConfig(tp_size=world), model_dir, tp_rank=rank)
        import torch.distributed as dist
        from sglang.srt.distributed import parallel_state

        from kvcanary.adapters.sglang import ranks

    group = ranks.sglang_group()
    results: dict[str, Any] = {
        "group": {
            "name": None if group is None else group.name,
            "is_tp_cpu_group": group is not None and group.process_group is parallel_state.get_tp_group().cpu_group,
            "is_default_world": group is not None and group.process_group is dist.group.WORLD,
        }
    }
    for name in names:
        results[name] = scenario(loop, name, rank, world)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown: a killed peer would make it wait


if __name__ == "__main__":
    main()

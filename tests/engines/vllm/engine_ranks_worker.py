"""One rank of the opt-in full-engine test in tests/engines/vllm/test_ranks.py, run as a script in the vLLM venv:

    python engine_ranks_worker.py RANK WORLD PORT OUT_DIR MODEL_DIR SCENARIO[,SCENARIO...]

A real vLLM V1 engine at ``tensor_parallel_size=WORLD`` in this process: ``distributed_executor_backend=
"external_launcher"`` makes vLLM build its world and groups from RANK/WORLD_SIZE/MASTER_* (gloo on the CPU) and
run its model tensor parallel, every rank with its own in-process engine core.  The canary is installed with
``attach.install``; a fault (the self-test's ``block_table_cross_request``) edits one rank's block table only.
"""

from __future__ import annotations

import json
import os
import random
import sys
import warnings
from pathlib import Path
from typing import Any

TARGET_STEP = 6  # the engine step whose block table the fault edits
PEER_TIMEOUT_S = 10.0
MODES = {"clean": "raise", "log": "log", "fail": "fail-request", "raise": "raise"}


def scenario(llm: Any, name: str, rank: int, world: int) -> dict[str, Any]:
    from kvcanary.adapters.vllm import install
    from kvcanary.adapters.vllm.selftest.context import VllmInjector
    from kvcanary.adapters.vllm.selftest.faults import BlockTableCrossRequest
    from kvcanary.adapters.vllm.workload import make_workload
    from kvcanary.runtime import CanaryViolation
    from kvcanary.selftest.protocol import InjectMode

    failed: list[str] = []
    canary = install(llm, MODES[name], on_fail_request=lambda ids, report: failed.extend(map(str, ids)))
    assert canary is not None
    ctx = None
    if name != "clean" and rank == (0 if name == "raise" else world - 1):
        target = (BlockTableCrossRequest.spec.name, TARGET_STEP)
        ctx = VllmInjector(InjectMode.INJECT, rng=random.Random(7), target=target, llm=llm, canary=canary)
        BlockTableCrossRequest().install(ctx)
    workload = make_workload(seed=3, num_requests=4)
    llm.reset_prefix_cache()
    out: dict[str, Any] = {"kind": type(canary.manager).__name__}
    try:
        outs = llm.generate(workload.requests(), workload.sampling(), use_tqdm=False)
        out["finish"] = {o.request_id: o.outputs[0].finish_reason for o in outs}
    except CanaryViolation as exc:
        out.update(error=type(exc).__name__, step=exc.report.step)
    finally:
        if ctx is not None:
            ctx.patches.restore()
        canary.uninstall()
    out.update(
        reports=[[r.step, r.reported_at, [str(i) for i in r.affected_request_ids], r.lines()] for r in canary.reports],
        failed=failed,
        injected=None if ctx is None or ctx.injection is None else list(ctx.injection.requests),
        stats=canary.stats(),
    )
    return out


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out_dir, model_dir, names = Path(sys.argv[4]), sys.argv[5], sys.argv[6].split(",")
    from kvcanary.adapters.vllm import tiny

    os.environ.update(tiny.ENGINE_ENV)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        KVCANARY_PEER_TIMEOUT_S=str(PEER_TIMEOUT_S),
        VLLM_DIST_IDENT=f"kvcanary-tp-test-{port}",  # names vLLM's CPU all-reduce segments: unique per run
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = tiny.start_engine(model_dir, tensor_parallel_size=world, distributed_executor_backend="external_launcher")
        from vllm.distributed import parallel_state

    from kvcanary.adapters.vllm import ranks

    group = ranks.vllm_group()
    tp_cpu_group = parallel_state.get_tp_group().cpu_group
    results: dict[str, Any] = {
        "group": {
            "name": None if group is None else group.name,
            "is_tp_cpu_group": group is not None and group.process_group is tp_cpu_group,
        }
    }
    for name in names:
        results[name] = scenario(llm, name, rank, world)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

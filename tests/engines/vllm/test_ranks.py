"""Several vLLM ranks, one verdict: the adapter's manager on vLLM's own tensor-parallel group (2 processes, gloo).

Each rank builds vLLM's distributed state as its CPU workers do (``init_distributed_environment`` and
``initialize_model_parallel``, tensor parallel 2, backend gloo; tests/engines/vllm/ranks_worker.py) and
drives the manager that ``kvcanary.adapters.vllm.ranks`` builds for a runner (the one ``VllmCanary`` uses)
through the runtime workload of tests/ranked_drive.py.  A full tensor-parallel engine forward is not
driven here: vLLM's engine start at TP 2 costs minutes on 2 shared cores (see docs in the issue report).
"""

from __future__ import annotations

from pathlib import Path

from ranked_drive import check, spawn_world

WORKER = Path(__file__).resolve().parent / "ranks_worker.py"
SCENARIOS = "clean,log,fail,raise,kill"  # kill last: it ends the last rank
LIMIT_S = 300.0  # two processes importing vLLM: about 30 s on 2 idle cores


def test_the_adapter_ranks_its_manager_on_vllms_tp_group_and_every_rank_agrees(tmp_path: Path) -> None:
    results = spawn_world(WORKER, 2, [SCENARIOS], tmp_path, LIMIT_S)
    for r, res in results.items():
        assert "missing" not in res, f"rank {r} wrote no result; output:\n{res['missing']}"
        assert res["group"]["name"] == "tp" and res["group"]["is_tp_cpu_group"], res["group"]
    # clean silent; a fault on rank 1 reported by both at the same step naming rank 1; fail-request on both;
    # raise on both at the same step; rank 1 killed: rank 0 stops with CanaryPeerError within the timeout
    check(results)

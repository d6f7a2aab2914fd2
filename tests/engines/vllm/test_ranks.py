"""Several vLLM ranks, one verdict: the adapter's manager on vLLM's own tensor-parallel group (2 processes, gloo).

Each rank builds vLLM's distributed state as its CPU workers do (``init_distributed_environment`` and
``initialize_model_parallel``, tensor parallel 2, backend gloo; tests/engines/vllm/ranks_worker.py) and
drives the manager that ``kvcanary.adapters.vllm.ranks`` builds for a runner (the one ``VllmCanary`` uses)
through the runtime workload of tests/ranked_drive.py.  Two full engines at TP 2, their model forward tensor
parallel, run only on request (``KVCANARY_VLLM_TP_ENGINE=1``): vLLM's engine start costs minutes on 2 cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


ENGINE_WORKER = Path(__file__).resolve().parent / "engine_ranks_worker.py"
ENGINE_OPT_IN = "KVCANARY_VLLM_TP_ENGINE"


@pytest.mark.skipif(
    os.environ.get(ENGINE_OPT_IN) != "1",
    reason=f"{ENGINE_OPT_IN}=1 runs two full vLLM engines at tensor parallel 2 (minutes on 2 cores)",
)
def test_two_full_engines_at_tensor_parallel_two_agree(tmp_path: Path) -> None:
    """vLLM's own engine at TP 2 (external launcher, gloo), its model forward tensor parallel, the canary
    installed with attach.install: the fault on one rank's block table is reported by both at the same step."""
    from kvcanary.adapters.vllm import tiny

    model = tiny.build_model(tmp_path / "tiny-llama")
    results = spawn_world(ENGINE_WORKER, 2, [str(model), "clean,log,fail,raise"], tmp_path, 1500.0)
    for r, res in results.items():
        assert "missing" not in res, f"rank {r} wrote no result; output:\n{res['missing']}"
        assert res["group"] == {"name": "tp", "is_tp_cpu_group": True}
        assert res["clean"]["reports"] == [] and set(res["clean"]["finish"].values()) == {"length"}
        assert res["clean"]["stats"]["verified_slots"] > 0
    assert results[1]["log"]["injected"] and results[0]["log"]["injected"] is None
    assert results[0]["log"]["reports"] and results[0]["log"]["reports"] == results[1]["log"]["reports"]
    assert all(line.endswith(" rank=1") for line in results[0]["log"]["reports"][0][3])
    # fail-request: both ranks' canaries fail the same ids, the finding rank's.  With the external launcher each
    # rank runs its own engine core, which gives a request its own random id suffix, so only the finding rank's
    # scheduler knows those ids (one scheduler serves every worker in a TP deployment: the ids agree there).
    victim = results[1]["fail"]["injected"][0]
    assert results[0]["fail"]["failed"] == results[1]["fail"]["failed"] and victim in results[0]["fail"]["failed"]
    assert results[1]["fail"]["finish"][victim.rsplit("-", 1)[0]] == "error"
    raised = [(res["raise"].get("error"), res["raise"].get("step")) for res in results.values()]
    assert raised[0][0] == "RankedViolation" and raised[0] == raised[1], raised

"""One rank of tests/engines/vllm/test_ranks.py, run as a script in the vLLM venv:

    python ranks_worker.py RANK WORLD PORT OUT_DIR SCENARIO[,SCENARIO...]

Builds vLLM's own distributed state as its CPU workers do (``init_distributed_environment`` and
``initialize_model_parallel`` with tensor parallelism WORLD, backend gloo), then runs the scenarios of
tests/ranked_drive.py on the manager the vLLM adapter builds (``ranked.build_manager`` on
``kvcanary.adapters.vllm.ranks.vllm_group()``).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: ranked_drive, runtime_helpers


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out_dir, names = Path(sys.argv[4]), sys.argv[5].split(",")
    import torch.distributed as dist

    with warnings.catch_warnings():  # vLLM's import-time deprecation notices
        warnings.simplefilter("ignore")
        from vllm.distributed import parallel_state

    import ranked_drive
    from kvcanary.adapters.vllm import ranks
    from kvcanary.runtime import ranked

    os.environ["KVCANARY_PEER_TIMEOUT_S"] = str(ranked_drive.PEER_TIMEOUT_S)
    parallel_state.init_distributed_environment(
        world_size=world, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank,
        backend="gloo",
    )  # fmt: skip
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # vLLM's group builders read the current config
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, backend="gloo")
    group = ranks.vllm_group()
    tp = parallel_state.get_tp_group()
    found = {
        "ranked": group is not None,
        "name": None if group is None else group.name,
        "is_tp_cpu_group": group is not None and group.process_group is tp.cpu_group,
        "is_default_world": group is not None and group.process_group is dist.group.WORLD,
    }
    ranked_drive.run(functools.partial(ranked.build_manager, group=group), found, rank, world, names, out_dir)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown: a killed peer would make it wait


if __name__ == "__main__":
    main()

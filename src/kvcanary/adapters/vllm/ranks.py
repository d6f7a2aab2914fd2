"""Several vLLM ranks, one verdict: each model runner's manager on the process groups vLLM built itself.

With tensor or pipeline parallelism, the runner's manager (``ranked.build_manager(..., group=vllm_group())``)
is a :class:`~kvcanary.runtime.ranked.RankedManager` on vLLM's own group (``vllm.distributed.parallel_state``:
``get_tp_group()`` with tensor parallelism, ``get_pp_group()`` with pipeline parallelism, the world group
when it is exactly TP x PP; its ``cpu_group``, see :mod:`kvcanary.runtime.ranked`), so every worker reports
the same verdict and acts on it at the same step.  The canary creates no group.  With one rank, or before
vLLM has built its groups, the manager is a plain one.  A peer that does not answer within
``KVCANARY_PEER_TIMEOUT_S`` seconds (default 60) stops the waiting worker with ``CanaryPeerError``.
"""

from __future__ import annotations

from kvcanary.runtime import ranked
from kvcanary.runtime.ranked import EngineGroup


def vllm_group() -> EngineGroup | None:
    """vLLM's group over this replica's TP x PP ranks (None: one rank, or no groups built yet)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return ranked.engine_group(
        parallel_state.get_tp_group(), parallel_state.get_pp_group(), parallel_state.get_world_group()
    )

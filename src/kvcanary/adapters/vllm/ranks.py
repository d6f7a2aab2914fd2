"""Several vLLM ranks, one verdict: each model runner's manager on the process groups vLLM built itself.

With tensor or pipeline parallelism, :func:`build_manager` wraps the runner's manager in a
:class:`~kvcanary.runtime.ranked.RankedManager` on vLLM's own group (``vllm.distributed.parallel_state``:
``get_tp_group()`` with tensor parallelism, ``get_pp_group()`` with pipeline parallelism, the world group
when it is exactly TP x PP; its ``cpu_group``, see :mod:`kvcanary.runtime.ranked`), so every worker reports
the same verdict and acts on it at the same step.  The canary creates no group.  With one rank, or before
vLLM has built its groups, the manager is a plain one.  A peer that does not answer within
``KVCANARY_PEER_TIMEOUT_S`` seconds (default 60) stops the waiting worker with ``CanaryPeerError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvcanary.config import CanaryConfig
from kvcanary.layout import CanaryGroup
from kvcanary.ops import Backend
from kvcanary.runtime import CanaryManager, FailRequestCallback, ranked
from kvcanary.runtime.ranked import EngineGroup, RankedManager
from kvcanary.workspace import Capacities


def vllm_group() -> EngineGroup | None:
    """vLLM's group over this replica's TP x PP ranks (None: one rank, or no groups built yet)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return ranked.engine_group(
        parallel_state.get_tp_group(), parallel_state.get_pp_group(), parallel_state.get_world_group()
    )


def build_manager(
    groups: Sequence[CanaryGroup],
    caps: Capacities | Mapping[str, Capacities],
    config: CanaryConfig,
    device: torch.device | str = "cpu",
    backend: Backend = Backend.AUTO,
    on_fail_request: FailRequestCallback | None = None,
) -> CanaryManager | RankedManager:
    """The runner's manager: ``CanaryManager``'s arguments, ranked on vLLM's group when there are several ranks."""
    return ranked.build_manager(
        groups, caps, config, device, backend, on_fail_request, group=vllm_group(), timeout_s=ranked.peer_timeout_s()
    )

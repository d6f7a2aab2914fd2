"""Several sglang ranks, one verdict: each runner's manager on the process groups sglang built itself.

With ``--tp-size`` or ``--pp-size`` above 1, :func:`build_manager` wraps the runner's manager in a
:class:`~kvcanary.runtime.ranked.RankedManager` on sglang's own group (``sglang.srt.distributed.
parallel_state``: the TP group with tensor parallelism, the PP group with pipeline parallelism, the
world group when it is exactly TP x PP; its gloo side, see :mod:`kvcanary.runtime.ranked`), so every
rank reports the same verdict and acts on it at the same step.  The canary creates no group.  With one
rank, or before sglang has built its groups, the manager is a plain one.  A peer that does not answer
within ``KVCANARY_PEER_TIMEOUT_S`` seconds (default 60) stops the waiting rank with ``CanaryPeerError``.
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


def sglang_group() -> EngineGroup | None:
    """sglang's group over this replica's TP x PP ranks (None: one rank, or no groups built yet).

    The groups come from ``runtime_context.get_parallel()``: sglang 0.5.23 deprecates the module-level
    ``get_tp_group()`` family for callers outside its own package (a ``DeprecationWarning`` on first use)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import get_parallel

    if not parallel_state.model_parallel_is_initialized():
        return None
    groups = get_parallel()
    return ranked.engine_group(groups.tp_group, groups.pp_group, groups.world_group)


def build_manager(
    groups: Sequence[CanaryGroup],
    caps: Capacities | Mapping[str, Capacities],
    config: CanaryConfig,
    device: torch.device | str = "cpu",
    backend: Backend = Backend.AUTO,
    on_fail_request: FailRequestCallback | None = None,
) -> CanaryManager | RankedManager:
    """The runner's manager: ``CanaryManager``'s arguments, ranked on sglang's group when there are several ranks."""
    return ranked.build_manager(
        groups, caps, config, device, backend, on_fail_request, group=sglang_group(), timeout_s=ranked.peer_timeout_s()
    )

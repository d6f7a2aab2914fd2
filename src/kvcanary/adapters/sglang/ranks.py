"""Several sglang ranks, one verdict: each runner's manager on the process groups sglang built itself.

With ``--tp-size`` or ``--pp-size`` above 1, the runner's manager
(``ranked.build_manager(..., group=sglang_group())``) is a :class:`~kvcanary.runtime.ranked.RankedManager`
on sglang's own group (``runtime_context.get_parallel()``: the TP group with tensor parallelism, the PP
group with pipeline parallelism, the world group when it is exactly TP x PP; its gloo side, see
:mod:`kvcanary.runtime.ranked`), so every rank reports the same verdict and acts on it at the same step.
The canary creates no group.  With one rank, or before sglang has built its groups, the manager is a plain
one.  A peer that does not answer within ``KVCANARY_PEER_TIMEOUT_S`` seconds (default 60) stops the
waiting rank with ``CanaryPeerError``.
"""

from __future__ import annotations

from kvcanary.runtime import ranked
from kvcanary.runtime.ranked import EngineGroup


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

"""Per-group capacities derived from the engine's limits (never from one batch).

* ``max_batch``: rows of ``req_to_token`` in use at once (the pool's ``size``, which bounds
  ``max_running_requests``), or the largest CUDA-graph batch when that is larger (padding rows are
  batch rows too).
* ``max_tokens``: the prefill budget (``chunked_prefill_size``, else ``max_prefill_tokens``, and at
  least one whole context when chunking is off) plus one decode token per running request (a mixed
  batch), and at least ``max_batch x speculative_num_draft_tokens`` (EAGLE target-verify).
* ``verify_entries``: the sum over a batch of each request's prefix (or window).  Radix sharing lets it
  exceed the pool, so the default is four times the group's slots, at least one whole context (or
  window), at most ``max_batch`` of them; beyond it verification is partial and counted as skipped.
"""

from __future__ import annotations

from kvcanary.layout import CanaryGroup
from kvcanary.workspace import Capacities

DEFAULT_MAX_PREFILL_TOKENS = 16384  # sglang's ServerArgs default
VERIFY_SLOTS_FACTOR = 4
GRAPH_BATCH_OPTIONS = ("cuda_graph_max_bs", "cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill")


def _opt_int(obj: object, name: str) -> int | None:
    """An optional positive int setting; None, 0 and negatives (sglang's "off") read as unset."""
    value = getattr(obj, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"server_args.{name} must be an int or None, got {value!r}")
    return value if value > 0 else None


def engine_limits(server_args: object, pool_rows: int, max_context: int) -> tuple[int, int]:
    """(max_batch, max_tokens) for one forward, from sglang's server arguments and the table shape."""
    # Padded CUDA-graph batches can exceed the running requests (older and newer spellings).
    graph_bs = max(_opt_int(server_args, n) or 0 for n in GRAPH_BATCH_OPTIONS)
    max_batch = max(pool_rows, graph_bs, 1)
    chunk = _opt_int(server_args, "chunked_prefill_size")
    prefill = _opt_int(server_args, "max_prefill_tokens") or DEFAULT_MAX_PREFILL_TOKENS
    budget = chunk if chunk is not None else max(prefill, max_context)
    draft = _opt_int(server_args, "speculative_num_draft_tokens") or 1
    max_tokens = max(budget + max_batch, max_batch * draft)
    return max_batch, max_tokens


def group_capacities(
    group: CanaryGroup,
    *,
    max_batch: int,
    max_tokens: int,
    max_context: int,
    log_rows: int,
    verify_entries: int = 0,
) -> Capacities:
    """Capacities of one group; ``verify_entries`` > 0 overrides the derived verify bound."""
    span = min(group.window, max_context) if group.window > 0 else max_context
    if verify_entries <= 0:
        verify_entries = max(span, min(VERIFY_SLOTS_FACTOR * group.num_slots, max_batch * span))
    return Capacities(
        max_batch=max_batch,
        max_tokens=max_tokens,
        verify_entries=max(verify_entries, 1),
        max_context=max_context,
        log_rows=log_rows,
    )

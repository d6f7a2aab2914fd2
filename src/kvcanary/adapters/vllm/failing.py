"""``fail-request`` on vLLM: the affected requests end through the scheduler's own finish path.

The canary runs in the model runner (the worker); requests live in the scheduler (the engine core).  The
worker hands the step's affected request ids over on the step's ``ModelRunnerOutput`` (attribute
:data:`FAILED_ATTR`: the object reaches ``Scheduler.update_from_output`` as is with the in-process executor;
it also survives pickling), and the scheduler wrapper finishes each live one with
``Scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)`` (what ``abort_requests`` uses, with the
error status vLLM gives a request that failed inside the engine): its blocks are freed, the client gets a
final output with ``finish_reason="error"`` and no tokens of this step, and every other request continues.
A request that finished in this very step is re-finished as an error (its last tokens dropped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger("kvcanary")

FAILED_ATTR = "kvcanary_failed_requests"


def attach(output: Any, failed: Mapping[str, str]) -> bool:
    """Put ``failed`` (request id -> violation summary) on a runner output; False if it cannot carry it."""
    if output is None or not hasattr(output, "req_ids"):
        return False
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    if output is EMPTY_MODEL_RUNNER_OUTPUT:  # a shared singleton: keep the ids for the next real output
        return False
    setattr(output, FAILED_ATTR, dict(failed))
    return True


def wrap_update_from_output(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrapper factory for ``Scheduler.update_from_output`` (class-level, patched by the plugin/install)."""

    def update_from_output(scheduler: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = original(scheduler, scheduler_output, model_runner_output)
        failed = getattr(model_runner_output, FAILED_ATTR, None)
        if failed:
            fail_requests(scheduler, outputs, failed)
        return outputs

    return update_from_output


def fail_requests(scheduler: Any, outputs: dict[int, Any], failed: Mapping[str, str]) -> list[str]:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus

    done_now = {o.request_id: (c, o) for c, eco in outputs.items() for o in eco.outputs if o.finish_reason is not None}
    live = [rid for rid in failed if rid in scheduler.requests]
    finished = scheduler.finish_requests(live, RequestStatus.FINISHED_ERROR)
    ends = [(r.client_index, r.request_id, r.take_events(), r.trace_headers) for r in finished]
    ends += [(c, rid, None, None) for rid, (c, _) in done_now.items() if rid in failed]
    for client, rid, events, trace in ends:
        eco = outputs.get(client)
        if eco is None:
            eco = outputs[client] = EngineCoreOutputs()
        eco.outputs = [o for o in eco.outputs if o.request_id != rid]
        eco.outputs.append(
            EngineCoreOutput(
                request_id=rid, new_token_ids=[], finish_reason=FinishReason.ERROR, events=events, trace_headers=trace
            )
        )
        logger.warning("kvcanary: request %r failed (fail-request mode): %s", rid, failed[rid])
    return [rid for _, rid, _, _ in ends]

"""sglang's own scheduling loop, in this process, on the CPU, with the canary installed as a server does.

What runs is sglang 0.5.23's real ``Scheduler`` (built from ``ServerArgs``/``PortArgs`` as its scheduler
process builds it): its ``TpModelWorker`` and ``ModelRunner`` (``init_memory_pool``: ``ReqToTokenPool``,
``MHATokenToKVPool``, ``TokenToKVPoolAllocator``), its radix cache (``UnifiedRadixCache``), its schedule
policy, ``ScheduleBatch.prepare_for_extend`` / ``prepare_for_decode`` / ``mix_with_running`` /
``retract_decode``, ``ModelWorkerBatch`` -> ``ForwardBatch.init_new``, its ``LlamaForCausalLM`` on the
``torch_native`` attention backend, and ``process_batch_result`` (finish, radix insert, frees).
:meth:`SchedulerLoop.step` is one iteration of ``Scheduler.event_loop_normal`` with the zmq receive
replaced by direct ``process_input_requests`` calls (requests and aborts) and the detokenizer's socket
by a list.

Three environment shims, each because this CPU has no accelerator and no sglang CPU kernels:

* ``TRITON_INTERPRET=1`` (set before sglang is imported): sglang's Triton kernels on the scheduling
  path (``assign_req_to_token_pool`` in decode allocation) run under Triton's interpreter;
* ``sglang.srt.layers.rotary_embedding.base._is_cpu = True``: on a platform that is neither CUDA nor
  sglang's CPU engine, the rotary embedding's constructor imports a vLLM CUDA kernel it never calls
  (the op dispatches to ``forward_native`` here);
* the ground-truth snapshot that ``ForwardBatch.init_new`` takes under
  ``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT=1`` (each request's ``origin_input_ids + output_ids``) is
  built unpinned (:func:`unpinned_req_all_ids`): sglang's ``compute_req_all_ids_info`` pins it, which a
  CPU-only torch refuses.

sglang builds its process groups once per process, so there is one scheduler per process:
:meth:`SchedulerLoop.reset` drops every request and flushes the pools and the radix cache (sglang's
``flush_cache``) between runs.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

from kvcanary.adapters.sglang.install import SglangCanary, install_canary

BatchHook = Callable[[Any], None]  # called with the ScheduleBatch between scheduling and its forward


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The scheduler's limits: small, so that chunking, mixing and retraction all happen."""

    max_total_tokens: int = 96
    chunked_prefill_size: int = 16
    max_running_requests: int = 4
    context_length: int = 64  # sglang sizes its req_to_token rows from max_total_tokens / context_length
    page_size: int = 1
    enable_mixed_chunk: bool = True
    # sglang's admission reserves max_new_tokens x this (x 0.7) per running request: low, so that the pool
    # runs out during decode and ``retract_decode`` frees requests (as an optimistic server does).
    schedule_conservativeness: float = 0.05
    # Tensor parallel ranks: one SchedulerLoop per process, each given its tp_rank; sglang builds its groups on
    # gloo from SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE (tcp://host:port, the same in every rank's process).
    tp_size: int = 1


def prepare_environment() -> None:
    """Settings sglang reads at import or per forward; call before importing any sglang module."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT"] = "1"


def _cpu_shims() -> None:
    import sglang.srt.layers.rotary_embedding.base as rope
    import sglang.srt.model_executor.forward_batch_info as forward_batch_info

    rope._is_cpu = True
    forward_batch_info.compute_req_all_ids_info = unpinned_req_all_ids


def unpinned_req_all_ids(reqs: list[Any]) -> tuple[Any, Any]:
    """sglang's ``compute_req_all_ids_info`` (each request's ``origin_input_ids + output_ids``), unpinned."""
    import torch

    ids = [t for req in reqs for part in (req.origin_input_ids, req.output_ids) for t in part]
    lens = [len(req.origin_input_ids) + len(req.output_ids) for req in reqs]
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64)


def build_scheduler(model_dir: str, config: LoopConfig, tp_rank: int = 0) -> Any:
    """sglang's Scheduler, constructed as ``run_scheduler_process`` constructs it (no overlap)."""
    prepare_environment()
    import torch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import PortArgs, ServerArgs

    _cpu_shims()
    server_args = ServerArgs(
        model_path=model_dir,
        device="cpu",
        attention_backend="torch_native",
        disable_cuda_graph=True,
        disable_overlap_schedule=True,
        skip_tokenizer_init=True,
        dtype="float32",
        mem_fraction_static=0.05,
        max_total_tokens=config.max_total_tokens,
        chunked_prefill_size=config.chunked_prefill_size,
        max_running_requests=config.max_running_requests,
        page_size=config.page_size,
        enable_mixed_chunk=config.enable_mixed_chunk,
        schedule_conservativeness=config.schedule_conservativeness,
        context_length=config.context_length,
        log_level="warning",
        random_seed=0,
        tp_size=config.tp_size,
    )
    port_args = PortArgs.init_new(server_args)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank, dp_rank=None, gpu_id=tp_rank))
    scheduler = Scheduler(server_args, port_args)
    # One thread: the tiny model's ops take microseconds; on a shared CPU more threads only contend (10x).
    torch.set_num_threads(1)
    return scheduler


def canary_args(mode: str, **extra: object) -> Any:
    """Our ``--kv-canary*`` options for :func:`install_canary`.  sglang 0.5.23's own ``ServerArgs.kv_canary``
    (its built-in canary, CUDA kernels) stays ``none``; the engine limits still come from the runner's
    real ``server_args``."""
    import types

    return types.SimpleNamespace(kv_canary=mode, **extra)


class SchedulerLoop:
    """One in-process sglang scheduler; requests in, one ``event_loop_normal`` iteration per :meth:`step`."""

    def __init__(self, config: LoopConfig | None = None, model_dir: str | None = None, tp_rank: int = 0) -> None:
        from kvcanary.adapters.sglang.selftest.tiny_model import build_tiny_llama

        self.config = config or LoopConfig()
        if model_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvcanary-sglang-model-")
            model_dir = str(build_tiny_llama(self._tmp.name))
        self.scheduler = build_scheduler(model_dir, self.config, tp_rank)
        self.runner = self.scheduler.tp_worker.model_runner
        self.outputs: list[Any] = []
        self.scheduler.ipc_channels.send_to_detokenizer.send_output = self._collect
        self.canary: SglangCanary | None = None
        self.failed_requests: list[str] = []
        self.features: collections.Counter[str] = collections.Counter()
        self.requests: dict[str, Any] = {}  # rid -> sglang Req, as seen in batches
        self._extended: set[tuple[str, int]] = set()
        self._slots_seen: set[int] = set()
        self._forgotten_retractions = 0  # of the requests :meth:`forget` dropped
        self.forwards_started = 0  # forwards begun since the last reset: the canary's step label of the next
        self.in_forward = False  # between a batch's scheduling and its result (hooks and forward)
        self.pending_arrivals = 0  # requests a workload has yet to submit (set by workload.run_workload)

    def _collect(self, output: Any, recv: Any = None) -> None:
        self.outputs.append(output)

    # ------------------------------------------------------------------ the canary, as a server installs it

    def install(self, mode: str = "raise", **options: object) -> SglangCanary:
        """``install_canary(model_runner)`` then ``mark_init_finished()`` (no warm-up runs in process)."""
        if self.canary is not None:
            raise RuntimeError("a canary is already installed on this loop; uninstall it first")
        canary = install_canary(self.runner, canary_args(mode, **options), on_fail_request=self._on_fail)
        if canary is None:
            raise ValueError(f"--kv-canary {mode} installs nothing")
        canary.mark_init_finished()
        self.canary = canary
        return canary

    def _on_fail(self, request_ids: list[object], report: object) -> None:
        self.failed_requests.extend(str(r) for r in request_ids)

    def uninstall(self) -> None:
        if self.canary is not None:
            self.canary.uninstall()
            self.canary = None

    # ------------------------------------------------------------------ requests

    def submit(self, rid: str, input_ids: list[int], max_new_tokens: int) -> None:
        from array import array

        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        # ignore_eos=False: sglang reserves a full max_new_tokens per ignore_eos request, which would never
        # let the pool run short; the model has no end-of-sequence token, so requests still run to the end.
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        params.normalize(None)
        request = TokenizedGenerateReqInput(
            rid=rid,
            input_text=None,
            input_ids=array("q", input_ids),
            input_embeds=None,
            mm_inputs=None,
            token_type_ids=None,
            sampling_params=params,
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
        )
        self.scheduler.process_input_requests([request])

    def abort(self, rid: str) -> None:
        """sglang's abort path (``AbortReq``), as the tokenizer manager sends it."""
        from sglang.srt.managers.io_struct import AbortReq

        running = any(r.rid == rid for r in self.scheduler.running_batch.reqs)
        self.features["aborted_running" if running else "aborted_waiting"] += 1
        self.scheduler.process_input_requests([AbortReq(rid=rid)])

    # ------------------------------------------------------------------ the loop

    def step(self, before_forward: BatchHook | None = None) -> Any:
        """One ``event_loop_normal`` iteration; returns the batch run, None when there was none."""
        s = self.scheduler
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        s.cur_batch_for_debug = batch
        if batch:
            self._observe(batch)
            self.forwards_started += 1
            self.in_forward = True
            try:
                if before_forward is not None:
                    before_forward(batch)
                result = s.run_batch(batch)
                s.process_batch_result(batch, result)
            finally:
                self.in_forward = False
            live = sum(r.retraction_count for r in self.requests.values())
            self.features["retractions"] = self._forgotten_retractions + live
        s.last_batch = batch
        return batch if batch else None

    def forget(self, rids: Iterable[str]) -> None:
        """Drop finished requests' bookkeeping (a long run's memory stays flat); their retractions stay counted."""
        for rid in rids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self._forgotten_retractions += req.retraction_count
                self._extended.difference_update((rid, n) for n in range(req.retraction_count + 1))

    @property
    def idle(self) -> bool:
        s = self.scheduler
        return not s.waiting_queue and s.running_batch.is_empty() and s.chunked_req is None

    def run(self, max_steps: int = 400, before_forward: BatchHook | None = None) -> int:
        """Step until idle; returns the number of forwards run.  Flushes the canary's last report."""
        forwards = 0
        for _ in range(max_steps):
            if self.step(before_forward) is not None:
                forwards += 1
            elif self.idle:
                break
        if self.canary is not None:
            self.canary.flush()
        return forwards

    def reset(self) -> None:
        """Drop every request, free the pools and the radix cache (``flush_cache``); keep the canary off."""
        self.uninstall()
        s = self.scheduler
        s.waiting_queue.clear()
        s.running_batch.reqs = []
        s.running_batch.batch_is_full = False
        s.chunked_req = None
        s.last_batch = None
        s.new_token_ratio_tracker.reset()
        s.forward_ct = 0
        if not s.flush_cache():
            raise RuntimeError("sglang refused to flush its cache: requests are still pending")
        self.outputs.clear()
        self.failed_requests.clear()
        self.features.clear()
        self.requests.clear()
        self._extended.clear()
        self._slots_seen.clear()
        self._forgotten_retractions = 0
        self.forwards_started = 0
        self.in_forward = False

    # ------------------------------------------------------------------ what the loop did

    def _observe(self, batch: Any) -> None:
        """Count the scheduling features this batch shows (host values of the ScheduleBatch only)."""
        f = self.features
        mode = batch.forward_mode
        f["forwards"] += 1
        kind = (
            "mixed" if mode.is_mixed() else "extend" if mode.is_extend() else "decode" if mode.is_decode() else "other"
        )
        f[kind] += 1
        for req in batch.reqs:
            self.requests[req.rid] = req
        if mode.is_extend():
            self._observe_extend(batch)
        loc = getattr(batch, "out_cache_loc", None)
        if loc is not None:
            slots = set(loc.tolist())
            f["reused_slots"] += len(slots & self._slots_seen)
            self._slots_seen |= slots

    def _observe_extend(self, batch: Any) -> None:
        f = self.features
        prefix_lens = list(batch.prefix_lens)
        extend_lens = list(batch.extend_lens)
        for req, prefix, extend in zip(batch.reqs, prefix_lens, extend_lens, strict=False):
            total = len(req.origin_input_ids) + len(req.output_ids)
            key = (req.rid, req.retraction_count)  # a resumed request starts its prefill again
            if key not in self._extended:
                if req.retraction_count > 0:
                    f["resumed_after_retraction"] += 1
                elif prefix > 0:
                    f["radix_hits"] += 1
                    f["radix_hit_tokens"] += prefix
            elif prefix > 0:
                f["chunk_continuations"] += 1
            if prefix + extend < total:
                f["chunked_rows"] += 1
            self._extended.add(key)

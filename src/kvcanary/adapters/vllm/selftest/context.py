"""What the vLLM faults act through: the engine's own objects for one run, and the read oracle's tap.

``step`` is the engine step the next (or current) forward gets: the canary's count of checked forwards.
Engine objects: the model runner (worker side: persistent batch, block tables, ``_update_states``,
``_prepare_inputs``), the scheduler and its block pool (engine-core side; the same process here).

The oracle tap wraps ``CPUAttentionBackendImpl.forward`` for the run: each layer hands the read oracle the
fresh K/V of the step's tokens and the K/V it receives from the paged cache, gathered through the step's
block table from vLLM's own cache tensor (V token-major, K transposed per block: ``[heads, head_size,
block_size]``).  It shares no code with the canary.
"""

from __future__ import annotations

import abc
import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from kvcanary.adapters.patching import PatchSet
from kvcanary.selftest.protocol import Fault, InjectMode, Injector
from kvcanary.selftest.read_oracle import HostView, ReadOracle


class VllmInjector(Injector):
    def __init__(
        self, mode: InjectMode, *, rng: random.Random, target: tuple[str, int] | None, llm: Any, canary: Any
    ) -> None:
        super().__init__(mode, rng=rng, target=target)
        core = llm.llm_engine.engine_core.engine_core
        self.llm = llm
        self.canary = canary
        self.runner = canary.runner
        self.scheduler = core.scheduler
        self.block_pool = self.scheduler.kv_cache_manager.block_pool
        self.block_size = int(canary.groups[0].block_size)
        self.cow_filters: list[Any] = []  # (ctx, request id, (src, dst)) -> keep the copy?
        self.relocations = 0
        self.oracle: ReadOracle | None = None

    def injected(self, detail: str, requests: Sequence[str] = ()) -> None:
        super().injected(detail, requests)
        if self.oracle is not None:
            self.oracle.check_from = self.step  # reads from this step's forward on are checked

    @property
    def step(self) -> int:
        return int(self.canary.features_.counts["steps"])

    def request_blocks(self, request_id: str) -> list[Any]:
        """The scheduler's block list of a request (full-attention group)."""
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        blocks: list[Any] = manager.req_to_blocks[request_id]
        return blocks


def decode_rows(ctx: VllmInjector, so: Any) -> list[tuple[int, str]]:
    """(row, request) of rows that decode one token this step and hold at least one full block."""
    r = ctx.runner
    ids = list(r.input_batch.req_ids[: r.input_batch.num_reqs])
    out = []
    for row, rid in enumerate(ids):
        state = r.requests.get(rid)
        if state is None or so.num_scheduled_tokens.get(rid) != 1:
            continue
        if state.num_computed_tokens >= ctx.block_size and state.num_computed_tokens >= len(state.prompt_token_ids):
            out.append((row, rid))
    return out


def on_runner(
    ctx: VllmInjector, method: str, corrupt: Callable[[VllmInjector, Any], None], *, after: bool = False
) -> None:
    """Run ``corrupt(ctx, scheduler_output)`` (guarded) before, or ``after``, the model runner's ``method``."""

    def make(original: Any) -> Any:
        def wrapped(so: Any, *a: Any, **k: Any) -> Any:
            if not after:
                ctx.guard(corrupt)(ctx, so)
            out = original(so, *a, **k)
            if after:
                ctx.guard(corrupt)(ctx, so)
            return out

        return wrapped

    ctx.wrap(ctx.runner, method, make)


class RunnerFault(Fault[VllmInjector]):
    """A fault on the model runner's state, at its ``method`` (before it, or ``after`` it: :func:`on_runner`).

    Each call, ``_eligible(ctx, scheduler_output)`` finds what could be corrupted now (empty or None: nothing);
    when it found something and the injector takes the opportunity, ``_corrupt(ctx, scheduler_output, found)``
    corrupts it.  ``_eligible`` runs at every opportunity (its draws from ``ctx.rng`` too), ``_corrupt`` at the
    one taken.
    """

    method: ClassVar[str]
    after: ClassVar[bool] = False

    def install(self, ctx: VllmInjector) -> None:
        on_runner(ctx, self.method, self._at_method, after=self.after)

    def _at_method(self, ctx: VllmInjector, so: Any) -> None:
        found = self._eligible(ctx, so)
        if found and ctx.take(self.name):
            self._corrupt(ctx, so, found)

    @abc.abstractmethod
    def _eligible(self, ctx: VllmInjector, so: Any) -> Any: ...

    @abc.abstractmethod
    def _corrupt(self, ctx: VllmInjector, so: Any, found: Any) -> None: ...


class OracleTap:
    """Feeds the read oracle from every attention layer of the checked forwards."""

    def __init__(self, ctx: VllmInjector, oracle: ReadOracle) -> None:
        self.ctx = ctx
        self.oracle = oracle
        self.patches = PatchSet(exclusive=False)
        self.active_step: int | None = None
        self._view: tuple[int, HostView] | None = None

    def attach(self) -> None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        self.patches.wrap(CPUAttentionBackendImpl, "forward", self._wrap_attention)
        self.ctx.wrap(self.ctx.runner, "_model_forward", self._wrap_forward)

    def detach(self) -> None:
        self.patches.restore()

    def _wrap_forward(self, original: Any) -> Any:
        def _model_forward(*args: Any, **kwargs: Any) -> Any:
            self.active_step = self.ctx.step if self.ctx.canary._in_step else None
            self._view = None  # one host view per forward (metadata objects' ids are reused across steps)
            try:
                return original(*args, **kwargs)
            finally:
                self.active_step = None

        return _model_forward

    def _wrap_attention(self, original: Any) -> Any:
        tap = self

        def forward(impl: Any, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any, md: Any, *a: Any, **k: Any):  # type: ignore[no-untyped-def]
            if tap.active_step is not None and md is not None and key is not None:
                tap.ctx.guard(tap._observe)(layer, key, value, kv_cache, md)
            return original(impl, layer, query, key, value, kv_cache, md, *a, **k)

        return forward

    def _host(self, md: Any) -> HostView:
        if self._view is not None:
            return self._view[1]
        r = self.ctx.runner
        n = int(r.input_batch.num_reqs)
        ids = list(r.input_batch.req_ids[:n])
        qsl = md.query_start_loc[: n + 1].tolist()
        seq = md.seq_lens[:n].tolist()
        q = [b - a for a, b in itertools.pairwise(qsl)]
        hist = [list(r.requests[i].prompt_token_ids or ()) + list(r.requests[i].output_token_ids) for i in ids]
        view = HostView(ids, [s - x for s, x in zip(seq, q, strict=True)], q, hist)
        self._view = (id(md), view)
        return view

    def _observe(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, md: Any) -> None:
        host = self._host(md)
        oracle, step = self.oracle, self.active_step
        assert step is not None
        checking = oracle.first is None and oracle.check_from is not None and step >= oracle.check_from
        if not oracle.recording and not checking:
            oracle.observe(step, host, 0, 0, key[:0], value[:0], True, key[:0], value[:0])  # later reads only
            return
        _nb, heads, _bs, two_hd = kv_cache.shape
        hd = two_hd // 2
        t = sum(host.query_lens)
        new_k = key[:t].reshape(t, heads, hd)
        new_v = value[:t].reshape(t, heads, hd)
        out_k, out_v = (new_k[:0], new_v[:0]) if oracle.recording else _gather(kv_cache, md.block_table, host)
        index = int(str(layer.layer_name).split(".layers.")[1].split(".")[0])
        oracle.observe(step, host, index, 0, new_k, new_v, True, out_k, out_v)


def _gather(kv_cache: torch.Tensor, table: torch.Tensor, host: HostView) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V attention receives: every row's positions [0, past + query), through its block table row."""
    nb, heads, bs, two_hd = kv_cache.shape
    paged = kv_cache.view(nb, heads, 2 * bs, two_hd // 2)
    k_cache = paged[:, :, :bs].reshape(nb, heads, two_hd // 2, bs)  # K is stored transposed per block
    v_cache = paged[:, :, bs:]
    blocks, offs = [], []
    for r, (past, q) in enumerate(zip(host.past_lens, host.query_lens, strict=True)):
        pos = torch.arange(past + q)
        blocks.append(table[r, pos // bs].long())
        offs.append(pos % bs)
    b = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.long)
    o = torch.cat(offs) if offs else torch.zeros(0, dtype=torch.long)
    return k_cache[b, :, :, o], v_cache[b, :, o]

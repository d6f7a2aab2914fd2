"""What an sglang fault acts through (:class:`SglangInjector`), and the read oracle's tap on sglang's attention.

A fault gets two hook points in :class:`~.scheduler_loop.SchedulerLoop`'s iteration: ``before_forward``
(the ``ScheduleBatch`` is prepared: ``req_to_token`` rows and ``out_cache_loc`` written, the forward not yet
run) and ``after_step`` (``process_batch_result`` done: requests finished, the radix cache updated).

The read oracle (:mod:`kvcanary.selftest.read_oracle`) judges when a corruption first reaches attention.
:class:`AttentionTap` wraps the torch-native backend's ``forward_extend`` / ``forward_decode`` on the loop's
runner: after sglang wrote the step's K/V and attended, it gathers what each request's attention read
(the pool's K/V at ``req_to_token[row, :seq_len]``, the same gather torch-native does) and hands it to the
oracle with the step's fresh K/V.  It never looks at the canary's records.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from kvcanary.adapters.sglang.selftest.scheduler_loop import SchedulerLoop
from kvcanary.selftest.protocol import Fault, InjectMode, Injector
from kvcanary.selftest.read_oracle import HostView, ReadOracle


class SglangInjector(Injector):
    """The loop, its scheduler, and the hooks faults register; ``step`` is the canary step label of the
    forward being prepared (before_forward) or of the next one (after_step)."""

    def __init__(
        self, loop: SchedulerLoop, mode: InjectMode, *, rng: random.Random, target: tuple[str, int] | None
    ) -> None:
        super().__init__(mode, rng=rng, target=target)
        self.loop = loop
        self.scheduler = loop.scheduler
        self.before_forward_hooks: list[Callable[[Any], None]] = []
        self.after_step_hooks: list[Callable[[], None]] = []

    @property
    def step(self) -> int:
        return self.loop.forwards_started - (1 if self.loop.in_forward else 0)

    @property
    def table(self) -> torch.Tensor:
        table: torch.Tensor = self.scheduler.req_to_token_pool.req_to_token
        return table

    def before_forward(self, batch: Any) -> None:
        for hook in self.before_forward_hooks:
            self.guard(hook)(batch)

    def after_step(self, loop: SchedulerLoop, iteration: int) -> None:
        for hook in self.after_step_hooks:
            self.guard(hook)()


SglangFault = Fault[SglangInjector]


def step_view(fb: Any) -> HostView:
    rids = [str(r) for r in fb.rids]
    seq = [int(s) for s in fb.seq_lens_cpu.tolist()][: len(rids)]
    if fb.forward_mode.is_extend():
        past = [int(p) for p in fb.extend_prefix_lens_cpu][: len(rids)]
        query = [int(q) for q in fb.extend_seq_lens_cpu][: len(rids)]
    else:
        past, query = [s - 1 for s in seq], [1] * len(rids)
    lens = fb.req_all_ids_lens.tolist()
    flat = fb.req_all_ids_flat.tolist()
    truth, start = [], 0
    for n in lens:
        truth.append(flat[start : start + n])
        start += n
    return HostView(rids, past, query, truth)


class AttentionTap:
    """Feeds the read oracle from sglang's torch-native attention, layer by layer (see the module doc)."""

    def __init__(self, loop: SchedulerLoop, oracle: ReadOracle, injector: SglangInjector) -> None:
        self.loop = loop
        self.oracle = oracle
        self.injector = injector
        self.backend = loop.runner.attn_backend
        self._view: tuple[Any, HostView] | None = None

    def attach(self) -> None:
        for name in ("forward_extend", "forward_decode"):
            setattr(self.backend, name, self._tapped(getattr(self.backend, name)))

    def detach(self) -> None:
        for name in ("forward_extend", "forward_decode"):
            vars(self.backend).pop(name, None)

    def _tapped(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def tapped(q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
            out = forward(q, k, v, layer, forward_batch, *args, **kwargs)
            self._observe(k, v, layer, forward_batch)
            return out

        return tapped

    def _observe(self, k: torch.Tensor, v: torch.Tensor, layer: Any, fb: Any) -> None:
        if self._view is None or self._view[0] is not fb:
            self._view = (fb, step_view(fb))
        view = self._view[1]
        pool = self.loop.runner.token_to_kv_pool
        table = self.loop.scheduler.req_to_token_pool.req_to_token
        rows = fb.req_pool_indices.tolist()
        slots = torch.cat(
            [table[r, : p + q].long() for r, p, q in zip(rows, view.past_lens, view.query_lens, strict=False)]
        )
        heads, dim = layer.tp_k_head_num, layer.qk_head_dim
        new_k = k.reshape(-1, heads, dim)
        new_v = v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim)
        out_k = pool.get_key_buffer(layer.layer_id)[slots]
        out_v = pool.get_value_buffer(layer.layer_id)[slots]
        step = self.loop.forwards_started - 1
        if self.oracle.check_from is None and self.injector.injection is not None:
            self.oracle.check_from = self.injector.injection.step  # check reads from the injection on
        self.oracle.observe(step, view, layer.layer_id, 0, new_k, new_v, True, out_k, out_v)

"""The read oracle: an independent judge of *when* a corruption first reaches attention (the "first affected
read"), for any engine whose driver can show it each attention layer's fresh and received K/V.

The contract (what every engine's driver must give the runner, see :class:`~kvcanary.selftest.protocol.
AffectedRead`): the first step at which an attention layer received K/V that a correct engine would not have
given it, and the later steps in which an affected request ran.  The canary is judged against this, so it
must not share the canary's logic: it looks only at the K/V tensors each attention layer actually receives
from the paged cache (transformers: the output of ``allocator.update``), and compares them with the K/V a
*clean* run computed for the same token prefix.

Keying by the token prefix -- every token of the request's history up to and including the position --
makes the reference hold across requests (prefix sharing, de-duplication and forks read blocks another
request wrote) and across block moves (offload/restore).  The history is the engine's own belief (prompt
plus generated tokens): a slot whose bytes no longer match the history the engine believes in (a rollback
that kept the old token's KV, say) is affected even though its bytes are unchanged, because the reference
has no entry for that prefix.  Comparison is within a small tolerance: the same prefix computed in
differently composed batches differs in the last bits on CPU.

Modes: *record* (the clean control fills the store from every freshly computed K/V) and *check* (a faulted
run compares every read from the injection step on, until the first mismatch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from kvcanary.selftest.protocol import AffectedRead

_TOLERANCE = 1e-3  # absolute and relative: last-bit batch effects are ~1e-6, corruption is O(1)


class StepView(Protocol):
    """What the oracle needs of a step's batch, from the engine's host-side view (batch row order)."""

    @property
    def request_ids(self) -> Sequence[str]: ...
    @property
    def past_lens(self) -> Sequence[int]: ...
    @property
    def query_lens(self) -> Sequence[int]: ...
    @property
    def truth(self) -> Sequence[Sequence[int]]: ...  # each request's history: prompt plus generated tokens


class _Prefixes:
    """Per request: the prefix key of every position of its history (incremental: histories mostly grow)."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[list[int], list[int]]] = {}

    def keys(self, request_id: str, history: Sequence[int], length: int) -> list[int]:
        tokens, keys = self._cache.get(request_id, ([], []))
        n = min(len(tokens), len(history))
        if list(history[:n]) != tokens[:n]:  # the history was rewritten: recompute from the start
            tokens, keys = [], []
        elif n < len(tokens):
            tokens, keys = tokens[:n], keys[:n]
        for tok in history[len(tokens) : max(length, len(tokens))]:
            keys.append(hash((keys[-1] if keys else 0x5EED, int(tok))))
            tokens.append(int(tok))
        self._cache[request_id] = (tokens, keys)
        return keys


@dataclasses.dataclass(frozen=True)
class HostView:
    """A :class:`StepView` as a plain value, for engines whose host batch does not carry these fields itself."""

    request_ids: Sequence[str]
    past_lens: Sequence[int]
    query_lens: Sequence[int]
    truth: Sequence[Sequence[int]]


GRACE_STEPS = 3  # a faulted run stops this many steps after its verdict is known (see ReadOracle.settled)


class ReadOracle:
    def __init__(self, store: object, num_layers: int) -> None:
        """``store``: None to record (the clean control), else the reference a recording run returned."""
        if store is not None and not isinstance(store, dict):
            raise TypeError(f"store must be the reference a probe run returned, got {type(store).__name__}")
        self.recording = store is None
        self.store: dict[int, torch.Tensor] = {} if store is None else store
        self.num_layers = num_layers
        self.check_from: int | None = None  # check mode: the step checks start at (the injection's)
        self.first: AffectedRead | None = None
        self.later_reads: list[int] = []  # later steps whose batch holds a request of ``first``
        self._prefixes = _Prefixes()

    def observe(
        self,
        step: int,
        host: StepView,
        layer: int,
        window: int,
        new_k: torch.Tensor,
        new_v: torch.Tensor,
        has_reads: bool,
        out_k: torch.Tensor,
        out_v: torch.Tensor,
    ) -> None:
        """One attention layer's cache update: ``new_*`` the fresh K/V of the step's tokens ([tokens, heads,
        dim], batch order), ``out_*`` what the layer's attention receives ([entries, heads, dim])."""
        if self.recording:
            self._record(host, layer, new_k, new_v)
        elif self.first is None and self.check_from is not None and step >= self.check_from:
            self._check(step, host, layer, window, has_reads, out_k, out_v)
        elif self._later_read(step, host):
            self.later_reads.append(step)

    def settled(self, done: int, detected: int | None, grace: int = GRACE_STEPS) -> bool:
        """Whether a faulted run's verdict can no longer change, so that its driver may stop it.

        ``done``: the last step whose forward completed; ``detected``: the step of the canary's first report at
        or after the injection, None while there is none.  Settled: detection and the first affected read both
        known; or detected and ``grace`` more steps done without an affected read; or the affected requests ran
        ``grace`` more forwards after their first affected read, all reported on, without a detection.
        """
        if detected is not None and self.first is not None:
            return True
        if detected is not None:
            return done >= detected + grace
        if self.first is not None:
            return sum(s < done for s in self.later_reads) >= grace
        return False

    def _later_read(self, step: int, host: StepView) -> bool:
        """A new step after the first affected read in which an affected request runs."""
        if self.first is None or step <= self.first.step or (self.later_reads and self.later_reads[-1] >= step):
            return False
        return bool(set(self.first.requests).intersection(host.request_ids))

    # ------------------------------------------------------------------ record

    def _record(self, host: StepView, layer: int, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        t = 0
        for rid, past, q, hist in zip(host.request_ids, host.past_lens, host.query_lens, host.truth, strict=True):
            keys = self._prefixes.keys(rid, hist, past + q)
            for i in range(q):
                if past + i < len(keys):
                    ref = self.store.get(keys[past + i])
                    if ref is None:
                        ref = self.store[keys[past + i]] = torch.zeros(
                            (self.num_layers, 2, *new_k.shape[1:]), dtype=new_k.dtype
                        )
                    ref[layer, 0] = new_k[t]
                    ref[layer, 1] = new_v[t]
                t += 1

    # ------------------------------------------------------------------ check

    def _entries(self, host: StepView, window: int, has_reads: bool) -> tuple[list[int], list[int]]:
        """(batch row, prefix key) of every entry a layer's attention receives, in order."""
        rows: list[int] = []
        keys: list[int] = []
        for r, (rid, past, q, hist) in enumerate(
            zip(host.request_ids, host.past_lens, host.query_lens, host.truth, strict=True)
        ):
            if not has_reads:
                start = past  # no cache read: the fresh K/V of the query only
            elif window:
                start = past - min(past, window - 1)  # the ring's past tokens, then the query (sentinels)
            else:
                start = 0
            pk = self._prefixes.keys(rid, hist, past + q)
            for p in range(start, past + q):
                rows.append(r)
                keys.append(pk[p] if p < len(pk) else -1)
        return rows, keys

    def _check(
        self,
        step: int,
        host: StepView,
        layer: int,
        window: int,
        has_reads: bool,
        out_k: torch.Tensor,
        out_v: torch.Tensor,
    ) -> None:
        rows, keys = self._entries(host, window, has_reads)
        n = min(len(rows), int(out_k.shape[0]))
        if n == 0:
            return
        missing = torch.tensor([k not in self.store for k in keys[:n]])
        blank = torch.zeros((2, *out_k.shape[1:]), dtype=out_k.dtype)
        ref = torch.stack([self.store[k][layer] if k in self.store else blank for k in keys[:n]])
        got = torch.stack([out_k[:n], out_v[:n]], dim=1).to(ref.dtype)
        diff = (got - ref).abs().flatten(1).amax(1)
        scale = 1.0 + ref.abs().flatten(1).amax(1)
        bad = missing | ~(diff <= _TOLERANCE * scale)  # NaN counts as bad
        if bool(bad.any()):
            hit = sorted({rows[i] for i in bad.nonzero().flatten().tolist()})
            self.first = AffectedRead(
                step=step,
                requests=tuple(host.request_ids[r] for r in hit),
                layer=layer,
                entries=int(bad.sum()),
                diverged=bool((bad & missing).any()),
            )

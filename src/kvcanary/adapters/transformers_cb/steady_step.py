"""A steady step: the last step's batch again, every row advanced by its query (a decode step, most of them).

Such a step stages the same arrays at the same offsets as the last one, so its batch tensors are the same views
and its translation launches bind the same addresses: only the values change (the past lengths, the truth's
lengths and newest tokens, the index sizes).  The translator then sends those values and hands out a
:class:`~.translation.Translation` it made before, with its launches, instead of planning the groups, binding the
launches and keying them anew: in a serving loop each of those calls runs with every CPU cache cold.  One is kept
per set of engine buffers the batch has run on (transformers' async batching alternates two).

What makes a step steady is checked on every step, on the host's tuples and the engine's tensors: the same
request ids in the same rows, each row's past equal to the last step's past plus its query, the same query
lengths, token count and padding, every row inside the table, and each engine tensor the launches read at an
address a kept translation binds, with the same dtype (the key offsets with the same length too: the index tensors
grow, and the launch reads their lengths from the staged sizes).  Contiguity is checked when a translation is kept:
a kept launch holds the tensors it was bound to, so their memory stays allocated and a tensor at the same address
is a view into that same memory (and reading as many elements as it has, contiguously, stays inside it).  The rest
is as the full path computes it: the truth store plans the step as always (so a rewritten history is still resent),
and the sizes come from the index tensors.  The values are set and sent by :class:`.steady_region.StagedRegion`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.host_batch import HostBatch
from kvcanary.adapters.transformers_cb.steady_region import StagedRegion
from kvcanary.adapters.transformers_cb.translation import Translation


def engine_tensors(kwargs: Mapping[str, Any], geometries: Sequence[GroupGeometry]) -> tuple[torch.Tensor, ...] | None:
    """The engine's tensors a one-launch step binds: the tokens and positions, then per group the write index,
    read index and key offsets; None for a step that has no such tensors (the full path says what is wrong)."""
    if kwargs.get("block_table") is not None:
        return None
    try:
        out = [kwargs["input_ids"], kwargs["position_ids"]]
        for g in geometries:
            out += (kwargs["write_index"][g.index], kwargs["read_index"][g.index], kwargs["cu_seq_lens_k"][g.name])
    except (KeyError, IndexError, TypeError):
        return None
    return tuple(out)


def _signatures(engine: tuple[torch.Tensor, ...]) -> tuple[object, ...]:
    """What a launch bound to ``engine`` depends on (see the module docstring): each tensor's address and dtype,
    and each group's key offsets' length (the tokens' follows from the token count, checked apart)."""
    return (*[(t.data_ptr(), t.dtype) for t in engine], *[t.numel() for t in engine[4::3]])


def bindable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the launches bind ``tensors`` themselves (contiguous, not empty): no copy or stand-in whose address
    would change from step to step."""
    return all(t.numel() > 0 and t.is_contiguous() for t in tensors)


MAX_BUFFER_SETS = 4  # translations kept per batch: one per set of engine buffers (async batching alternates two)


@dataclasses.dataclass
class SteadyStep:
    """The last full step's batch, its translations by the engine buffers they bind, and what a steady step must
    match to reuse one.  The full step's own translation is keyed (and its staged region laid out) only when a
    step first matches the batch: most full steps in a serving loop are followed by another batch."""

    request_ids: tuple[str, ...]
    query_lens: tuple[int, ...]
    next_past: tuple[int, ...]  # each row's past at a steady next step
    next_fits: bool  # every row of that step inside the table
    n_tok: int
    padded: bool
    views: tuple[torch.Tensor, ...]  # the staged arrays' device views the batches and launches use
    live: tuple[bool, ...]
    translations: dict[tuple[object, ...], Translation]  # by the engine tensors' signatures
    pending: tuple[Translation, tuple[torch.Tensor, ...], Callable[[], StagedRegion]] | None  # not yet keyed
    region: StagedRegion | None = None  # where a steady step sets and sends its values (once keyed)
    last: tuple[tuple[torch.Tensor, ...], tuple[object, ...]] = ((), ())  # held, and its signatures

    @classmethod
    def of(
        cls,
        translation: Translation,
        host: HostBatch,
        engine: tuple[torch.Tensor, ...],
        views: tuple[torch.Tensor, ...],
        region: Callable[[], StagedRegion],
        width: int,
        sizes: tuple[int, bool],
        before: SteadyStep | None = None,
    ) -> SteadyStep:
        """``region``: lays out the full step's staged region (called once a step matches).  ``sizes``: the step's
        token count and whether the engine padded it.  ``before``: the state this step replaces; its translations
        carry over when this step is its batch on other engine buffers."""
        step = cls(
            request_ids=host.request_ids,
            query_lens=host.query_lens,
            next_past=(),
            next_fits=False,
            n_tok=sizes[0],
            padded=sizes[1],
            views=views,
            live=(True,) * host.batch_size,
            translations={},
            pending=(translation, engine, region),
        )
        if (
            before is not None
            and before.same_batch(step)
            and before.settled()
            and len(before.translations) < MAX_BUFFER_SETS
        ):
            step.translations.update(before.translations)
        step.advance(host.past_lens, width)
        return step

    def settled(self) -> bool:
        """Key the full step's translation by its engine tensors and lay out its region, once; False when its
        launches could not bind the engine's tensors themselves (see :func:`bindable`: then no step is steady).
        The tensors are held, so what they are now is what they were at that step."""
        if self.pending is not None:
            translation, engine, region = self.pending
            self.pending = None
            if not bindable(engine):
                self.next_fits = False
                return False
            self.last = (engine, _signatures(engine))
            self.translations[self.last[1]] = translation
            self.region = region()
        return self.region is not None

    def same_batch(self, other: SteadyStep) -> bool:
        """The same rows, lengths and staged views: translations of one serve the other."""
        if (self.request_ids, self.query_lens, self.n_tok, self.padded) != (
            other.request_ids,
            other.query_lens,
            other.n_tok,
            other.padded,
        ):
            return False
        return all(a is b for a, b in zip(self.views, other.views, strict=True))

    def advance(self, past: tuple[int, ...], width: int) -> None:
        """After a step with these past lengths: what the next steady step's must be."""
        query = self.query_lens
        self.next_past = tuple([p + q for p, q in zip(past, query, strict=True)])
        self.next_fits = all(p + q <= width for p, q in zip(self.next_past, query, strict=True))

    def find(self, host: HostBatch, n_tok: int, padded: bool, engine: tuple[torch.Tensor, ...]) -> Translation | None:
        """The translation to reuse when this step is the last one advanced by its queries, on engine buffers a
        kept translation binds; else None."""
        if not self.next_fits or n_tok != self.n_tok or padded != self.padded:
            return None
        if host.request_ids != self.request_ids or host.past_lens != self.next_past:
            return None
        if host.query_lens != self.query_lens or not self.settled():
            return None
        held, signatures = self.last
        if len(held) != len(engine) or not all(t is h for t, h in zip(engine, held, strict=True)):
            signatures = _signatures(engine)
            self.last = (engine, signatures)
        return self.translations.get(signatures)

    def reused(self, translation: Translation) -> None:
        """The translation handed out again, replaced (its ring wraps updated) where it changed."""
        self.translations[self.last[1]] = translation

"""A steady step: a step of the last full step's shape class on the same engine buffers (most steps of a serving loop).

The one-launch translation binds the engine's tensors by address and reads everything that varies from step to step
-- the rows' lengths, the truth's rows, lengths and writes, the index sizes -- from staged arrays whose device views
sit at offsets that depend on the shape class only (the batch's rows and tokens rounded up to a class, see
:mod:`.batch_shapes`).  So any step of that class whose engine tensors sit where a kept translation's were can run
that translation's launches again: a decode step of the same requests, and also one after a request finished or
joined, as long as the padded shapes do not change.  The translator then sets and sends those values and hands out
the kept :class:`~.translation.Translation` (with the step's request ids where they changed) instead of planning
the groups, binding the launches and keying them anew: in a serving loop each of those calls runs with every CPU
cache cold.  One is kept per set of engine buffers the class has run on (transformers' async batching alternates
two).

What makes a step steady is checked on every step, on the host's tuples and the engine's tensors: the same shape
class, every row inside the table, every group's key offsets long enough for the batch, and each engine tensor the
launches read at an address a kept translation binds, with the same dtype. (A sliding group's writes to the write
trash by design are masked by a staged mask of the class's token count, so a prefill chunk is steady too.) The
launches read the index tensors' lengths from the staged sizes, never from the tensors. Contiguity is checked when a
translation is kept: a kept launch holds the tensors it was bound to, so their memory stays allocated and a tensor
at the same address is a view into that same memory (and reading as many elements as the staged sizes say,
contiguously, stays inside it). The rest is as the full path computes it: the truth store plans the step as always
(so a rewritten history is still resent), and the sizes come from the index tensors. The values are set and sent by
:class:`.steady_region.StagedRegion`.
"""

from __future__ import annotations

import array
import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.steady_region import StagedRegion
from kvcanary.adapters.transformers_cb.step_buffers import group_writes
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
    """What a launch bound to ``engine`` depends on (see the module docstring): each tensor's address and dtype, in one
    flat tuple (address, dtype, address, dtype, ...): hashed and compared every step, nested tuples cost more."""
    out: list[object] = []
    for t in engine:  # a loop, not a comprehension: one function less run on every step
        out += (t.data_ptr(), t.dtype)
    return tuple(out)


def engine_reading(
    kwargs: Mapping[str, Any], geometries: Sequence[GroupGeometry], rows: int
) -> tuple[tuple[object, ...], array.array[int], int] | None:
    """For a step of ``rows`` batch rows, in one pass over the engine tensors a one-launch step binds (see
    :func:`engine_tensors`; looked up here directly, not through it: one call and one list fewer on every step): their
    signatures, the step's index sizes (:func:`.step_buffers.index_sizes`) and the forward's token count; None when
    there are no such tensors, a group's read index is empty (the kernel does not cover it) or its key offsets are too
    short for the batch (the full path's torch form reports that)."""
    if kwargs.get("block_table") is not None:
        return None
    try:
        ids, pos = kwargs["input_ids"], kwargs["position_ids"]
        writes, reads, keys_by_name = kwargs["write_index"], kwargs["read_index"], kwargs["cu_seq_lens_k"]
        n_tok = ids.numel()
        signatures: list[object] = [ids.data_ptr(), ids.dtype, pos.data_ptr(), pos.dtype]  # as _signatures, one pass
        sizes: list[int] = []
        for g in geometries:
            write, read, keys = writes[g.index], reads[g.index], keys_by_name[g.name]
            n_read = read.numel()
            if n_read == 0 or keys.numel() < rows + 1:
                return None
            sizes += (group_writes(write.numel(), n_tok), n_read, n_tok)
            signatures += (write.data_ptr(), write.dtype, read.data_ptr(), read.dtype, keys.data_ptr(), keys.dtype)
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    return tuple(signatures), array.array("q", sizes), n_tok


def bindable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the launches bind ``tensors`` themselves (contiguous, not empty): no copy or stand-in whose address
    would change from step to step."""
    return all(t.numel() > 0 and t.is_contiguous() for t in tensors)


MAX_BUFFER_SETS = 4  # translations kept per class: one per set of engine buffers (async batching alternates two)
MAX_CLASSES = 8  # shape classes kept (a serving loop moves between a few: decode batches, prefill chunks)


@dataclasses.dataclass
class SteadyStep:
    """The last full step's shape class, its translations by the engine buffers they bind, and the staged region a
    steady step sets.  The full step's own translation is keyed (and its staged region laid out) only when a step
    first matches it: most full steps in a serving loop are followed by another shape."""

    shape: tuple[int, int]  # the class: the batch tensors' rows and tokens
    views: tuple[torch.Tensor, ...]  # the staged arrays' device views the batches and launches use
    translations: dict[tuple[object, ...], Translation]  # by the engine tensors' signatures
    pending: tuple[Translation, tuple[torch.Tensor, ...], Callable[[], StagedRegion]] | None  # not yet keyed
    region: StagedRegion | None = None  # where a steady step sets and sends its values (once keyed)
    last: tuple[object, ...] = ()  # the signatures of the engine tensors last found

    @classmethod
    def of(
        cls,
        translation: Translation,
        engine: tuple[torch.Tensor, ...],
        views: tuple[torch.Tensor, ...],
        region: Callable[[], StagedRegion],
        shape: tuple[int, int],
        before: SteadyStep | None = None,
    ) -> SteadyStep:
        """``region``: lays out the full step's staged region (called once a step matches).  ``shape``: the step's
        class.  ``before``: the state this step replaces; its translations carry over when this step is of its class
        on other engine buffers."""
        step = cls(shape=shape, views=views, translations={}, pending=(translation, engine, region))
        if (
            before is not None
            and before.same_shape(step)
            and before.settled()
            and len(before.translations) < MAX_BUFFER_SETS
        ):
            step.translations.update(before.translations)
        return step

    def settled(self) -> bool:
        """Key the full step's translation by its engine tensors and lay out its region, once; False when its
        launches could not bind the engine's tensors themselves (see :func:`bindable`: then no step is steady).
        The tensors are held, so what they are now is what they were at that step."""
        if self.pending is not None:
            translation, engine, region = self.pending
            self.pending = None
            if not bindable(engine):
                return False
            self.last = _signatures(engine)
            self.translations[self.last] = translation
            self.region = region()
        return self.region is not None

    def same_shape(self, other: SteadyStep) -> bool:
        """The same class and staged views: translations of one serve the other."""
        return self.shape == other.shape and all(a is b for a, b in zip(self.views, other.views, strict=True))

    def reused(self, translation: Translation) -> None:
        """The translation handed out again, replaced (its request ids or ring wraps updated) where it changed."""
        self.translations[self.last] = translation


class KeptSteps:
    """The steady state of the last full step of each recent shape class, the least recently used dropped past
    :data:`MAX_CLASSES`: a step of any kept class may be steady, not only one of the last step's class (a decode step
    after a prefill chunk of another class).  Each class's translations stay valid while other classes run: a steady
    step sends its whole staged region again, and everything else its launches read is per class or static."""

    def __init__(self) -> None:
        self._by_class: collections.OrderedDict[tuple[int, int], SteadyStep] = collections.OrderedDict()

    def get(self, shape: tuple[int, int]) -> SteadyStep | None:
        return self._by_class.get(shape)

    def find(self, shape: tuple[int, int], signatures: tuple[object, ...]) -> tuple[SteadyStep, Translation] | None:
        """The kept state of class ``shape`` and its translation to reuse for a step whose engine tensors have
        ``signatures`` (see :func:`engine_reading`), marked the most recently used; None when none is kept.  The
        caller has checked the rest of what makes the step steady (see the module docstring).  One call a step."""
        step = self._by_class.get(shape)
        if step is None or (step.pending is not None and not step.settled()) or step.region is None:
            return None
        translation = step.translations.get(signatures)
        if translation is None:
            return None
        step.last = signatures
        self._by_class.move_to_end(shape)
        return step, translation

    def keep(self, step: SteadyStep) -> None:
        self._by_class[step.shape] = step
        self._by_class.move_to_end(step.shape)
        if len(self._by_class) > MAX_CLASSES:
            self._by_class.popitem(last=False)

    def clear(self) -> None:
        self._by_class.clear()

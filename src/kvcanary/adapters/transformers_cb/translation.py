"""One step, translated: what :class:`~.translate.StepTranslator` hands the step tap (and a steady step hands again)."""

from __future__ import annotations

import dataclasses

from kvcanary.adapters.transformers_cb import translate_kernel
from kvcanary.batch import StepBatch


@dataclasses.dataclass(slots=True)  # not frozen (treated as immutable): a sliding model's steady step builds one,
class Translation:  # cold, and a frozen dataclass's initialiser takes a path nothing else on the step touches
    """One step, translated.  The batches' tensors are views of the translator's buffers: valid until
    its next :meth:`StepTranslator.translate` (clone what must outlive the step)."""

    batches: dict[str, StepBatch]  # by group name
    request_ids: tuple[str, ...]  # per batch row
    rows_too_long: int  # rows left out: longer than the table (counted, never verified)
    ring_wraps: int  # sliding-group writes that overwrote an older token of the ring
    padded: bool  # the engine padded the batch (compile / CUDA graphs)
    block_table: bool  # decode fast path
    prelude: translate_kernel.Launches | None = None  # with ``defer``: the group launches still to run

    def again(self, request_ids: tuple[str, ...], ring_wraps: int, padded: bool) -> Translation:
        """This translation handed out again by a steady step, with that step's counts (built directly: a steady step
        runs cold, where :func:`dataclasses.replace` costs several times more)."""
        return Translation(
            self.batches, request_ids, self.rows_too_long, ring_wraps, padded, self.block_table, self.prelude
        )

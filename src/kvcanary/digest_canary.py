"""One group's KV digest: stamp the slots a step wrote, verify a budgeted share of what it reads.

Created beside a :class:`~kvcanary.canary.GroupCanary` (it stores the digests in that group's records,
so they follow every record copy) from the engine's :class:`~kvcanary.digest.DigestLayout` and a
:class:`~kvcanary.config.DigestConfig`.  Per step: :meth:`verify` after the group's plan (it selects
from the plan's verify spans), :meth:`stamp` once the engine has written the step's K/V (it digests
``out_cache_loc``), or both in one call after the forward (:meth:`verify_and_stamp`).
:meth:`verify_slots` checks slots whose bytes were just moved (copied, restored), whatever the budget.
Violations go into the group's log like the others.  :meth:`note_move` remembers where moved bytes came
from, and :meth:`locate` names the layer whose bytes differ in a reported slot
(:mod:`kvcanary.digest_locate`; off the clean path).
"""

from __future__ import annotations

from typing import Any

import torch

from kvcanary.arguments import require_affordable
from kvcanary.batch import StepBatch
from kvcanary.canary import GroupCanary, uses_kernels
from kvcanary.config import DigestConfig
from kvcanary.digest import TILE_TOKENS, DigestLayout, DigestWorkspace
from kvcanary.digest_locate import MoveSource, MoveSources, locate
from kvcanary.ops import digest_reference as dref
from kvcanary.workspace import ViolationLog


def workspace_entries(canary: GroupCanary, period: int) -> int:
    """Entries one call may need: a step's writes (a prefill chunk's) and the budgeted share of a full
    verify, which a fused call (:meth:`GroupDigest.verify_and_stamp`) holds at once.

    A row's verify span of n positions spans at most n / G + 2 runs of G positions, of which every
    ``period``-th is selected (at least one per row).
    """
    caps = canary.caps
    writes = -(-caps.max_tokens // TILE_TOKENS) * TILE_TOKENS
    reads = TILE_TOKENS * (caps.verify_entries // (TILE_TOKENS * period) + caps.max_batch * (1 + 2 // period + 1))
    return writes + reads


class GroupDigest:
    """The digest state of one group (digests in its records, a workspace) and its per-step calls."""

    def __init__(
        self, canary: GroupCanary, layout: DigestLayout, config: DigestConfig, *, tuning: object | None = None
    ) -> None:
        if not isinstance(layout, DigestLayout):
            raise TypeError(f"layout must be a kvcanary.digest.DigestLayout, got {type(layout).__name__}")
        if not isinstance(config, DigestConfig):
            raise TypeError(f"config must be a kvcanary.config.DigestConfig, got {type(config).__name__}")
        if layout.device != canary.device:
            raise ValueError(f"digest layout on {layout.device}, canary on {canary.device}")
        if layout.num_slots < canary.group.num_slots - len(canary.group.reserved_slots):
            # Reserved slots past the layout (a sentinel slot of its own) are never digested; others must be.
            raise ValueError(
                f"group {canary.group.name!r}: the digest layout covers {layout.num_slots} slots, "
                f"the group has {canary.group.num_slots}"
            )
        self.canary = canary
        self.layout = layout
        self.config = config
        self.period = config.period
        entries = workspace_entries(canary, self.period)
        require_affordable(
            f"digest of group {canary.group.name!r}", canary.group.num_slots * 8 + entries * 24, canary.device
        )
        canary.records.enable_digests()
        self.workspace = DigestWorkspace.allocate(entries, canary.device)
        self._kernels = uses_kernels(canary.backend, canary.device)
        self.sources = MoveSources()  # the last few moves' sources, read only by locate()
        # True: after_forward verifies the step's budgeted share and stamps its writes in one call
        # (verify_and_stamp).  False: before_forward verifies and the adapter stamps after its engine's
        # forward itself (CanaryManager.stamp_digests), because its before/after calls both run before the
        # forward (vLLM's passes).
        self.stamp_after_forward = True
        self._device_layout = None
        self._kernel_kw: dict[str, object] = {}
        if self._kernels:
            from kvcanary.ops.digest_launchers import DEFAULT_TUNING, DeviceLayout

            self._device_layout = DeviceLayout.build(layout)
            self._kernel_kw = {"tuning": tuning or DEFAULT_TUNING}

    @property
    def digests(self) -> torch.Tensor:
        d = self.canary.records.digests
        assert d is not None  # allocated in __init__
        return d

    def _ops(self) -> tuple[Any, Any, dict[str, object]]:
        """(module, layout, extra arguments) of the backend: the launchers with the device table, or the reference."""
        if self._kernels:
            from kvcanary.ops import digest_launchers

            return digest_launchers, self._device_layout, self._kernel_kw
        return dref, self.layout, {}

    def stamp(self, batch: StepBatch, log: ViolationLog) -> None:
        """Digest the slots this step wrote (``out_cache_loc``, through the lookup); after the engine wrote them."""
        ops, layout, kw = self._ops()
        ops.stamp_list(self.canary.group, layout, self.digests, self.workspace, log, batch.out_cache_loc,
                       lookup=batch.lookup, **kw)  # fmt: skip

    def verify(self, batch: StepBatch, log: ViolationLog) -> None:
        """Verify the budgeted share of the last plan's verify entries (same batch): what attention reads."""
        ops, layout, kw = self._ops()
        ops.verify_planned(self.canary.group, layout, self.digests, self.workspace, log, batch,
                           self.canary.workspace, period=self.period, **kw)  # fmt: skip

    def verify_and_stamp(self, batch: StepBatch, log: ViolationLog) -> None:
        """:meth:`verify` then :meth:`stamp`, as one device call, once the forward has written the step's K/V:
        the verify reads what attention read (slots written this step are left to the stamp)."""
        ops, layout, kw = self._ops()
        ops.verify_and_stamp(self.canary.group, layout, self.digests, self.workspace, log, batch,
                             self.canary.workspace, period=self.period, **kw)  # fmt: skip

    def verify_slots(self, slots: torch.Tensor, log: ViolationLog) -> None:
        """Verify slots whose bytes were just moved (in chunks of the workspace's entries)."""
        ops, layout, kw = self._ops()
        slots = slots.to(self.canary.device, dtype=torch.int64)
        step = self.workspace.entries
        for c0 in range(0, int(slots.shape[0]), step):
            ops.verify_list(self.canary.group, layout, self.digests, self.workspace, log,
                            slots[c0 : c0 + step].contiguous(), **kw)  # fmt: skip

    def note_move(
        self, dest: torch.Tensor, src: torch.Tensor, layout: DigestLayout | None = None, what: str = "copy source"
    ) -> None:
        """Remember that slots ``dest`` got the bytes of ``src`` (indices into ``layout``: default this group's
        own), so that :meth:`locate` can compare against them.  Keeps the tensors as given: no copy, no sync."""
        self.sources.add(MoveSource(dest, src, self.layout if layout is None else layout, what))

    def locate(self, slot: int) -> str:
        """A note naming the layer(s) whose bytes differ in ``slot`` (reads the slot: off the clean path)."""
        if not 0 <= slot < self.layout.num_slots:
            return ""
        return locate(self.layout, int(self.digests[slot]), slot, self.sources)

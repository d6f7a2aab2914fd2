"""Shared by the runtime tests: a tiny paged-KV workload, a manager on it, one step, a corruption, and the
emulation of a CUDA-graph replay on the CPU (the manager's device work run alone)."""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Iterator

import torch
import torch.distributed as dist

from kvcanary import CanaryConfig, CanaryGroup, Capacities, Mode, StepBatch
from kvcanary.runtime import CanaryManager, StepReport

NUM_SLOTS = 256
WIDTH = 32  # table columns (page_size 1: one slot per position)
CAPS = Capacities(max_batch=8, max_tokens=64, verify_entries=512, max_context=WIDTH)


class Workload:
    """A tiny paged-KV bookkeeping: requests own table rows; slots are handed out in order.

    Tokens are a deterministic function of (row, position) so the expected values are known.
    """

    def __init__(self, rows: int = 6) -> None:
        self.table = torch.zeros(rows, WIDTH, dtype=torch.int32)
        self.lens = [0] * rows
        self.next_slot = 1  # slot 0 is reserved

    @staticmethod
    def token(row: int, pos: int) -> int:
        return 1000 * row + 7 * pos + 3

    def batch(self, plan: list[tuple[int, int]], truth: bool = False) -> StepBatch:
        """One step: ``plan`` lists (table row, tokens written this step); allocates their slots."""
        ids, pos, loc = [], [], []
        for row, n in plan:
            for p in range(self.lens[row], self.lens[row] + n):
                self.table[row, p] = self.next_slot
                self.next_slot += 1
                ids.append(self.token(row, p))
                pos.append(p)
                loc.append(int(self.table[row, p]))
        prefix = [self.lens[row] for row, _ in plan]
        for row, n in plan:
            self.lens[row] += n
        kw = {}
        if truth:
            tr = torch.zeros(self.table.shape[0], WIDTH, dtype=torch.int32)
            for r in range(self.table.shape[0]):
                for p in range(self.lens[r]):
                    tr[r, p] = self.token(r, p)
            kw = {"truth": tr, "truth_lens": torch.tensor([self.lens[r] for r, _ in plan], dtype=torch.int32)}
        return StepBatch(
            rows=torch.tensor([r for r, _ in plan], dtype=torch.int32),
            prefix_lens=torch.tensor(prefix, dtype=torch.int32),
            extend_lens=torch.tensor([n for _, n in plan], dtype=torch.int32),
            table=self.table,
            input_ids=torch.tensor(ids, dtype=torch.int32),
            positions=torch.tensor(pos, dtype=torch.int32),
            out_cache_loc=torch.tensor(loc, dtype=torch.int32),
            **kw,
        )


def make_manager(mode: Mode = Mode.LOG, groups: list[CanaryGroup] | None = None, **kw: object) -> CanaryManager:
    callback = kw.pop("on_fail_request", None)
    config = CanaryConfig(mode=mode, **kw)  # type: ignore[arg-type]
    groups = groups or [CanaryGroup(num_slots=NUM_SLOTS, name="full")]
    return CanaryManager(groups, CAPS, config, on_fail_request=callback)  # type: ignore[arg-type]


def run_step(mgr: CanaryManager, batch: StepBatch, ids: list[object] | None) -> StepReport | None:
    mgr.before_forward({"full": batch})
    mgr.after_forward()
    return mgr.host_step(ids)


def alias_first_slot(wl: Workload, victim: int, owner: int) -> None:
    """Engine-side fault: the victim's position 0 now points at the owner's slot (a shared/aliased page)."""
    wl.table[victim, 0] = wl.table[owner, 0]


def drive(mgr: CanaryManager, steps: int, fault_at: int | None = None) -> list[StepReport | None]:
    """Prefill rows 1 and 2 (4 tokens each), then decode both; batch row 0 = 'req-a', row 1 = 'req-b'."""
    wl = Workload()
    out = []
    for k in range(steps):
        if k == fault_at:
            alias_first_slot(wl, victim=2, owner=1)
        n = 4 if k == 0 else 1
        out.append(run_step(mgr, wl.batch([(1, n), (2, n)]), ["req-a", "req-b"]))
    return out


def emulate_capture(mgr: CanaryManager) -> None:
    mgr._graph_captured = True  # what a before/after pair inside torch.cuda.graph() would leave


def replay(mgr: CanaryManager, batch: StepBatch, before: bool = True, after: bool = True) -> None:
    """What replaying a captured graph does on the device: only the captured work, no host bookkeeping."""
    if before:
        mgr._work.before([batch])
    if after:
        mgr._work.after()


@contextlib.contextmanager
def gloo_world() -> Iterator[dist.ProcessGroup]:
    """A one-rank gloo world on a free local port, destroyed on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=10)
    )
    try:
        yield dist.group.WORLD  # type: ignore[misc]
    finally:
        dist.destroy_process_group()

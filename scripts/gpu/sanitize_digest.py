"""Run the digest kernel on corrupt inputs under ``compute-sanitizer --tool memcheck`` (any bad access is an error).

Every call the runtime makes (stamp and verify lists, the planned verify, the fused verify-and-stamp) over
paged and token-major pools, with the lists, the lookup, the table and the written slots smashed to
negative, out-of-range and huge values, each call compared with the reference (a run that hides an access
error behind a wrong answer still fails); then the plan's spans smashed too, which no plan writes and the
reference does not model: the kernel alone.
Usage (repository root): compute-sanitizer --tool memcheck --error-exitcode 99 \\
    python scripts/gpu/sanitize_digest.py [n_rounds]
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from sanitize_kernels import run_rounds, smash_values  # noqa: E402

import digest_cases as dc  # noqa: E402
from kvcanary import digest as D  # noqa: E402
from kvcanary.ops import digest_launchers as dl  # noqa: E402
from kvcanary.ops import digest_reference as dref  # noqa: E402
from kvcanary.workspace import ViolationLog  # noqa: E402

NASTY = [-(2**31), -7, -1, 2**31 - 1, 2**40]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def one_round(rng: random.Random, page: int) -> list[str]:
    """Every call on one smashed step: the reference and the kernel side by side; the differences found."""
    prefix = [0, 1, 17, 45, rng.randint(2, 60)]
    num_slots = page * (sum(-(-(n + 1) // page) for n in prefix) + 2)
    group, batch, plan_ws = dc.planned_step(num_slots, prefix, page=page, device=DEV)
    bs = 1 if page == 1 else page
    comps = dc.layer_components("paged" if bs > 1 else "token_major", num_slots // bs, bs, 2, 64, torch.bfloat16,
                                torch.Generator().manual_seed(page))  # fmt: skip
    layout = D.DigestLayout(tuple(D.KVComponent(c.view.to(DEV)) for c in comps))
    sides = [(dref, layout), (dl, dl.DeviceLayout.build(layout))]
    state = [(torch.zeros(num_slots, dtype=torch.int64, device=DEV), D.DigestWorkspace.allocate(512, DEV),
              ViolationLog.allocate(4, DEV)) for _ in sides]  # fmt: skip

    def smashed_copy(t: torch.Tensor) -> torch.Tensor:
        return smash_values(t, rng, NASTY)

    lookup = smashed_copy(torch.randperm(num_slots, device=DEV)) if rng.random() < 0.5 else None
    writes = smashed_copy(torch.randint(0, num_slots, (rng.choice([3, 40, 150]),), device=DEV))
    smashed = dataclasses.replace(batch, table=smashed_copy(batch.table), out_cache_loc=writes, lookup=lookup)
    listed = smashed_copy(torch.arange(num_slots, device=DEV))
    calls = [("stamp_list", (torch.arange(num_slots, device=DEV),), {}),
             ("verify_list", (listed,), {"lookup": lookup, "report_range": True}),
             ("verify_planned", (smashed, plan_ws), {"period": rng.choice([1, 3])}),
             ("verify_and_stamp", (smashed, plan_ws), {"period": rng.choice([1, 3])})]  # fmt: skip
    problems = []
    for name, args, kw in calls:
        for (mod, lay), (digests, ws, log) in zip(sides, state, strict=True):
            getattr(mod, name)(group, lay, digests, ws, log, *args, **kw)
        (d0, w0, l0), (d1, w1, l1) = state
        same = torch.equal(d0, d1) and torch.equal(w0.stats, w1.stats) and torch.equal(l0.counters, l1.counters)
        if not (same and torch.equal(l0.rows(), l1.rows())):
            problems.append(f"{name} (page {page}) differs from the reference")
    # Spans no plan would write (the reference assumes the plan's): the kernel alone, for memcheck.
    for t in (plan_ws.window_starts, plan_ws.verify_offsets):
        t.copy_(smashed_copy(t))
    digests, ws, log = state[1]
    dl.verify_planned(group, sides[1][1], digests, ws, log, smashed, plan_ws, period=1)
    dl.verify_and_stamp(group, sides[1][1], digests, ws, log, smashed, plan_ws, period=1)
    return problems


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    rng = random.Random(11)
    return run_rounds(f"sanitize_digest: {n} smashed steps x 4 calls", n, lambda i: one_round(rng, [1, 3, 16][i % 3]))


if __name__ == "__main__":
    sys.exit(main())

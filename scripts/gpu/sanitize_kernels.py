"""Run the kernels on corrupt inputs under ``compute-sanitizer --tool memcheck`` (any bad access is an error).

Random corrupted cases from tests/gen.py, then the same cases smashed further: table, lookup, rows,
lengths, truth lengths and write slots set to negative, out-of-range and huge values.  Each case also
checks the kernels against the reference, so a run that hides an access error behind a wrong answer
still fails.  Usage (repository root): compute-sanitizer --tool memcheck --error-exitcode 99 \\
    python scripts/gpu/sanitize_kernels.py [n_cases]
"""

from __future__ import annotations

import array
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

import gen  # noqa: E402
from kernel_compare import compare_step  # noqa: E402
from kvcanary.ops import launchers  # noqa: E402

FUSING = launchers.KernelTuning(fuse_max_batch=32)
NASTY = [-(2**63), -(2**40), -(2**31), -1, 2**31 - 1, 2**40, 2**62, 2**63 - 1]


def smash_values(t: torch.Tensor, rng: random.Random, nasty: Sequence[int] = NASTY) -> torch.Tensor:
    """An int64 copy of ``t`` with one to three of its values overwritten from ``nasty``."""
    t = t.to(torch.int64).clone()
    flat = t.view(-1)
    for _ in range(rng.randint(1, 3)):
        flat[rng.randrange(flat.numel())] = rng.choice(nasty)
    return t


def smash(case: gen.Case, rng: random.Random) -> gen.Case:
    """Overwrite a few index values of every kind with values from NASTY (int64 so they fit)."""
    b = case.batch
    for name in ("table", "lookup", "rows", "prefix_lens", "extend_lens", "truth_lens", "out_cache_loc"):
        t = getattr(b, name)
        if t is not None and t.numel():
            setattr(b, name, smash_values(t, rng))
    return case


def run_rounds(label: str, n: int, one: Callable[[int], list[str]]) -> int:
    """Rounds 0..n-1 (each returns its differences from the reference), then one line: ``label``, the
    mismatches and the time.  Exit status 1 on any mismatch (memcheck's own errors exit 99)."""
    t0 = time.time()
    failures = 0
    for i in range(n):
        for problem in one(i):
            failures += 1
            print("MISMATCH", i, problem, flush=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"{label}, {failures} mismatches, {time.time() - t0:.1f}s")
    return 1 if failures else 0


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    rng = random.Random(7)

    def one(i: int) -> list[str]:
        case = gen.random_case(90_000 + i, corrupt=True)
        if i % 2:
            case = smash(case, rng)
        # The scalar oracle does not model int64 wrap-around, so it only serves the unsmashed cases.
        # Half the cases run plan and verify as one launch (the fused kernel, off by default), half as two.
        problems = compare_step(case, tuning=FUSING, index_dtype=torch.int64, use_oracle=i % 2 == 0, fused=i % 4 < 2)
        return [f"{case.describe()} {problems[:2]}"] if problems else []

    status = run_rounds(f"sanitize_kernels: {n} corrupt cases ({n // 2} smashed)", n, one)
    return status | run_rounds(f"truth scatter: {n} corrupt metas", n, lambda i: truth_scatter_case(rng))


def truth_scatter_case(rng: random.Random) -> list[str]:
    """The transformers adapter's truth scatter with its count and offsets smashed: it may write only cells of the
    store, and with its meta as staged exactly the store write's cells."""
    from kvcanary.adapters.transformers_cb.staging import Staging
    from kvcanary.adapters.transformers_cb.truth_store import TruthStore

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    staging, store = Staging(dev), TruthStore(4, 32, dev, static_out=True)
    n = rng.randrange(0, 60)
    cells = array.array("q", rng.sample(range(-8, 5 * 32 + 8), n))  # distinct, as a step's are; some outside
    tokens = array.array("i", [rng.randrange(1 << 31) for _ in range(n)])
    meta = array.array("q", [n, 0, 0])
    offsets, _ = staging.layout([meta, cells, tokens])
    meta[1], meta[2] = offsets[1] // 8, offsets[2] // 4
    exact = rng.random() < 0.5
    if not exact:
        meta[rng.randrange(3)] = rng.choice(NASTY)
    staged = staging.send([meta, cells, tokens])
    before = store.table.clone()
    store.scatter(staging.whole(torch.int64), staging.whole(torch.int32), staged[0]).run()
    changed = (store.table != before).view(-1).nonzero().view(-1).tolist()
    if not exact:
        return [] if all(0 <= c < store.table.numel() for c in changed) else [f"meta {list(meta)}: wrote {changed}"]
    want = {c: t for c, t in zip(cells, tokens, strict=True) if 0 <= c < store.table.numel()}
    got = dict(zip(changed, store.table.view(-1)[changed].tolist(), strict=True))
    return [] if got == {c: t for c, t in want.items() if before.view(-1)[c] != t} else [f"wrote {got}, want {want}"]


if __name__ == "__main__":
    sys.exit(main())

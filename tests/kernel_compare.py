"""Kernels against the reference, phase by phase: the comparison the differential, case and sanitizer runs share.

``compare_step`` runs one batch through both implementations and lists every difference (records, workspace
prefixes, the whole log, the kernels' scratch); ``DEVICE`` is where the kernels run.
"""

from __future__ import annotations

import dataclasses

import torch

import gen
import oracle
from kvcanary.batch import StepBatch
from kvcanary.layout import RecordStore
from kvcanary.ops import launchers
from kvcanary.ops import reference as ref
from kvcanary.workspace import GroupState, PlanWorkspace, ViolationLog

# Without CUDA the kernels run under the Triton interpreter on CPU tensors (conftest.py switches it on);
# with CUDA they run compiled.  The reference always runs on the CPU.
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
PHASES = ("plan", "verify", "stamp")
FUSED_PHASES = ("plan_verify", "stamp")  # what GroupCanary.step runs on the kernels


def to_device(case: gen.Case, dev: torch.device, *, index_dtype: torch.dtype | None = None) -> gen.Case:
    """A copy of ``case`` on ``dev``; ``index_dtype`` makes every batch tensor that dtype (int64 keeps values)."""

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return t.to(dev, dtype=index_dtype or t.dtype).clone()

    batch = StepBatch(**{k: move(v) for k, v in case.batch.tensors().items()})
    ws = PlanWorkspace(**{f.name: getattr(case.ws, f.name).to(dev).clone() for f in dataclasses.fields(case.ws)})
    rec = case.records
    records = RecordStore(rec.tokens.to(dev).clone(), rec.positions.to(dev).clone(), rec.links.to(dev).clone())
    log = ViolationLog(case.log.first.to(dev).clone(), case.log.last.to(dev).clone(), case.log.counters.to(dev).clone())
    return dataclasses.replace(case, batch=batch, records=records, log=log, ws=ws)


def run_phase(impl: str, case: gen.Case, phase: str, tuning: launchers.KernelTuning = launchers.DEFAULT_TUNING) -> None:
    """``plan_verify``: the reference's plan then verify, the kernels' one fused launch."""
    args = (case.caps.verify_entries,) if phase in ("verify", "plan_verify") else ()
    state = GroupState(case.group, case.records, case.ws, case.log)
    if impl == "ref" and phase == "plan_verify":
        ref.plan(state, case.batch)
        ref.verify(state, case.batch, *args)
    elif impl == "ref":
        getattr(ref, phase)(state, case.batch, *args)
    else:
        getattr(launchers, phase)(state, case.batch, *args, tuning=tuning)


def rewritten_slots(case: gen.Case, *, use_oracle: bool = True) -> dict[int, list[tuple[int, int, int]]]:
    """Slots the step's stamp writes more than once, with every write (the oracle's account).

    Without the oracle: every slot that two write indices may resolve to, with no writes listed
    (their records are then not compared at all).
    """
    if not use_oracle:
        loc = case.batch.out_cache_loc.long()
        lut = case.batch.lookup
        if lut is not None:
            ok = (loc >= 0) & (loc < lut.numel())
            loc = torch.where(ok, lut.long()[loc.clamp(0, max(lut.numel() - 1, 0))] if lut.numel() else loc, -1)
        values, counts = torch.unique(loc, return_counts=True)
        return {int(v): [] for v in values[counts > 1]}
    o = case.clone()
    oracle.plan(o.group, o.batch, o.records, o.ws, o.log)
    return dict(oracle.stamp(o.group, o.batch, o.records, o.ws, o.log))


def compare_step(
    case: gen.Case,
    *,
    tuning: launchers.KernelTuning = launchers.DEFAULT_TUNING,
    index_dtype: torch.dtype | None = None,
    use_oracle: bool = True,
    fused: bool = False,
) -> list[str]:
    """Run plan, verify, stamp with the reference (CPU) and the kernels (DEVICE); every difference, by phase
    (``fused``: the kernels' plan and verify in one launch)."""
    want = case.clone()
    got = to_device(case, DEVICE, index_dtype=index_dtype)
    twice = rewritten_slots(case, use_oracle=use_oracle)
    problems: list[str] = []
    for phase in FUSED_PHASES if fused else PHASES:
        run_phase("ref", want, phase)
        run_phase("kernels", got, phase, tuning)
        seen = to_device(got, torch.device("cpu"))
        diffs = gen.diff_outputs(want, seen, skip_slots=twice if phase == "stamp" else ())
        if torch.count_nonzero(seen.ws.sync[launchers.SYNC_CLEAR]):
            diffs.append(f"workspace.sync not back to zero: {seen.ws.sync.tolist()}")
        if phase == "stamp":
            diffs += _check_rewrites(seen.records, twice)
        problems += [f"{phase}: {d}" for d in diffs]
        if diffs:
            break
    return problems


def _check_rewrites(records: RecordStore, twice: dict[int, list[tuple[int, int, int]]]) -> list[str]:
    """A slot written twice in one step: each field holds one of the writes (the kernels store fields
    separately, so a record may mix writers; the reference leaves the winner unspecified too)."""
    out = []
    for slot, writes in twice.items():
        if not writes:
            continue
        got = (int(records.tokens[slot]), int(records.positions[slot]), int(records.links[slot]))
        for i, name in enumerate(("token", "position", "link")):
            if got[i] not in {w[i] for w in writes}:
                out.append(f"slot {slot} {name} {got[i]} is none of the step's writes {writes}")
    return out

"""H200 acceptance of the runtime under CUDA graphs (issue 4).

1. The whole per-step device work (before_forward + a stand-in model op + after_forward, both
   groups) is captured in ONE CUDA graph and replayed for 100 decode steps with the inputs refilled
   in place; a fault injected at step k must be reported by host step k + 1, naming exactly the
   victim's request id, and nothing may be reported before.
2. No device memory is allocated during capture or replay: the caching allocator's counters are
   unchanged across the capture and across the 100 replays (inputs refilled, host steps included).
   A model-only graph is captured first, so PyTorch's own first-capture allocation (RNG state) is
   not counted against the canary.
3. The phase check fires on a graph captured without the canary's work (and on one holding only
   before_forward), replayed after a good graph was captured.

Usage: ``PYTHONPATH=src:scripts/gpu python scripts/gpu/runtime_graph_check.py [--cpu-dry-run]``.  With
``--cpu-dry-run`` the same workload runs eagerly on CPU (no graphs) to check the script's logic.
Prints one JSON summary line and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Callable

import torch
from runtime_workload import DecodeWorkload

from kvcanary import CanaryConfig, Mode
from kvcanary.runtime import CanaryHealthError, CanaryManager, StepReport

STEPS = 100
FAULT_AT = 57
VICTIM, OWNER = 2, 0  # requests: the victim's table entry is aliased to the owner's slot


def alloc_counters() -> dict[str, int]:
    s = torch.cuda.memory_stats()
    keys = ("allocation.all.allocated", "segment.all.allocated", "allocated_bytes.all.allocated")
    return {k: int(s.get(k, 0)) for k in keys}


class Stepper:
    """Drives one manager through the workload, eagerly or by replaying a captured graph."""

    def __init__(self, wl: DecodeWorkload, mgr: CanaryManager, use_graphs: bool) -> None:
        self.wl, self.mgr, self.use_graphs = wl, mgr, use_graphs
        self.hidden = torch.ones(1024, device=wl.device)  # stand-in for the model's forward
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}

    def model(self) -> None:
        self.hidden.mul_(1.0001)

    def eager(self, batches: dict, ids: list[object]) -> StepReport | None:  # type: ignore[type-arg]
        self.mgr.before_forward(batches)
        self.model()
        self.mgr.after_forward()
        return self.mgr.host_step(ids)

    def capture(self, name: str, body: Callable[[], None]) -> None:
        g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            body()
        torch.cuda.synchronize()
        self.graphs[name] = g

    def full_step(self) -> None:
        self.mgr.before_forward(self.wl.decode_batches())
        self.model()
        self.mgr.after_forward()

    def replay(self, name: str, ids: list[object]) -> StepReport | None:
        self.graphs[name].replay()
        torch.cuda.synchronize()  # a serving loop syncs on its sampled tokens every step
        return self.mgr.host_step(ids)


def check_fault_run(use_graphs: bool) -> dict[str, object]:
    dev = "cuda" if use_graphs else "cpu"
    wl = DecodeWorkload(n_req=4, prompt=24, steps=STEPS + 2, device=dev)
    failed: list[tuple[list[object], int]] = []
    mgr = CanaryManager(
        wl.groups,
        wl.caps,
        CanaryConfig(mode=Mode.FAIL_REQUEST, health_every=10),
        device=dev,
        on_fail_request=lambda ids, rep: failed.append((ids, rep.step)),
    )
    st = Stepper(wl, mgr, use_graphs)
    reports: list[StepReport | None] = []
    batches, ids = wl.prefill()
    reports.append(st.eager(batches, ids))  # step 0: prefill, eager
    ids = wl.fill_decode(1)
    reports.append(st.eager(wl.decode_batches(), ids))  # step 1: eager decode (compiles the kernels)
    result: dict[str, object] = {}
    alloc_capture: dict[str, int] = {}
    alloc_replay: dict[str, int] = {}
    if use_graphs:
        ids2 = wl.fill_decode(2)  # the capture sees step 2's inputs; it runs nothing
        # PyTorch allocates two 8-byte tensors (RNG seed/offset, 512 B blocks) when a process registers
        # its first graph: capture a model-only graph first so the next capture counts the canary alone.
        before = alloc_counters()
        st.capture("baseline", st.model)
        result["alloc_baseline_capture"] = {k: v - before[k] for k, v in alloc_counters().items()}
        before = alloc_counters()
        st.capture("decode", st.full_step)
        alloc_capture = {k: v - before[k] for k, v in alloc_counters().items()}
        result["alloc_capture"] = alloc_capture
        before = alloc_counters()
    for k in range(2, STEPS + 2):
        if k == FAULT_AT:
            wl.alias(VICTIM, OWNER, pos=3)
        step_ids = (ids2 if k == 2 else wl.fill_decode(k)) if use_graphs else wl.fill_decode(k)
        if use_graphs:
            reports.append(st.replay("decode", step_ids))
        else:
            reports.append(st.eager(wl.decode_batches(), step_ids))
    if use_graphs:
        alloc_replay = {k: v - before[k] for k, v in alloc_counters().items()}
        result["alloc_replay"] = alloc_replay
    reports.append(mgr.flush())
    hits = [i for i, r in enumerate(reports) if r is not None]
    first = reports[hits[0]] if hits else None
    victim_id = f"req-{VICTIM}"
    result.update(
        steps=len(reports) - 1,
        fault_at=FAULT_AT,
        first_report_at=hits[0] if hits else None,
        first_report_step=first.step if first else None,
        first_report_ids=list(first.affected_request_ids) if first else None,
        first_report_counts=first.counts if first else None,
        all_reports_only_victim=all(r is None or r.affected_request_ids == (victim_id,) for r in reports),
        callbacks_first=failed[0] if failed else None,
        stats=mgr.stats(),
    )
    ok = (
        first is not None
        and hits[0] == FAULT_AT + 1
        and first.step == FAULT_AT
        and first.affected_request_ids == (victim_id,)
        and result["all_reports_only_victim"]
        and failed
        and failed[0] == ([victim_id], FAULT_AT)
        and mgr.stats()["health_failures"] == 0
        and mgr.stats()["forwards"] == STEPS + 2
    )
    if use_graphs:
        ok = ok and not any(alloc_capture.values()) and not any(alloc_replay.values())
    result["ok"] = bool(ok)
    return result


def check_phase(partial: bool) -> dict[str, object]:
    """A good graph is captured and replayed, then a graph lacking (part of) the canary work is replayed."""
    wl = DecodeWorkload(n_req=4, prompt=24, steps=8, device="cuda")
    mgr = CanaryManager(wl.groups, wl.caps, CanaryConfig(mode=Mode.RAISE, health_every=0), device="cuda")
    st = Stepper(wl, mgr, True)
    batches, ids = wl.prefill()
    st.eager(batches, ids)
    ids = wl.fill_decode(1)
    st.eager(wl.decode_batches(), ids)

    def bad() -> None:
        if partial:
            mgr.before_forward(wl.decode_batches())
            st.model()
            mgr.abandon_forward()  # the engine's capture path "forgot" after_forward
        else:
            st.model()  # a forward path that bypassed the canary hooks

    ids2 = wl.fill_decode(2)
    st.capture("decode", st.full_step)
    st.capture("bad", bad)
    out: dict[str, object] = {"partial": partial}
    st.replay("decode", ids2)
    st.replay("decode", wl.fill_decode(3))
    try:
        st.replay("bad", wl.fill_decode(4))  # decodes step 3: clean
        st.replay("decode", wl.fill_decode(5))  # decodes step 4: the bad replay
        out["raised"] = None
    except CanaryHealthError as exc:
        out["raised"] = str(exc)[:200]
    out["ok"] = out["raised"] is not None and "phase" in str(out["raised"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    use_graphs = not args.cpu_dry_run
    runs: dict[str, Callable[[], dict[str, object]]] = {"fault_run": lambda: check_fault_run(use_graphs)}
    if use_graphs:
        runs["phase_missing_all"] = lambda: check_phase(partial=False)
        runs["phase_missing_after"] = lambda: check_phase(partial=True)
    checks: dict[str, dict[str, object]] = {}
    for name, run in runs.items():
        try:
            checks[name] = run()
        except Exception:  # report and go on: every check gets its say in one device call
            checks[name] = {"ok": False, "error": traceback.format_exc()[-1500:]}
    ok = all(bool(v["ok"]) for v in checks.values())
    print(json.dumps({**checks, "ok": ok}, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The host-time sections of benchmarks/README.md (``make_readme.py`` calls :func:`demo_section` and
:func:`host_section`): the GPU demo's host time per step by phase, and ``bench_host_step.py``'s records."""

from __future__ import annotations

import datetime
import functools
import json
import re
import subprocess
from pathlib import Path

from demo_notes import DEMO_NOTES

HERE = Path(__file__).resolve().parent


DEMO_LINE = re.compile(
    r"host time in the canary: (?P<total>[\d.]+) ms per step \(median (?P<median>[\d.]+) ms; mean by phase, ms: "
    r"batch capture (?P<capture>[\d.]+), translation (?P<translate>[\d.]+), plan/verify/stamp (?P<launch>[\d.]+), "
    r"host step (?P<host_step>[\d.]+)\)"
)
DEMO_SHARE = re.compile(r"the canary's share of step time: (?P<share>[\d.]+)%")
DEMO_WALL = re.compile(r"of the runs' wall time: (?P<share>[\d.]+)%")  # from ffdb7a5, beside the steps' share
DEMO_FLOOR = re.compile(r"the canary's timed work alone is (?P<share>[\d.]+)%")
DEMO_STEPS = re.compile(r"the engine's steps without the canary")  # from 059ada1 the share compares the steps
DEMO_TIMED = re.compile(r"host time per step of each timed run: [\d., ]+ ms \(median (?P<median>[\d.]+) ms\)")


@functools.cache
def _commit_time(commit: str) -> int:
    """When a stored run's commit was made (rows in history order, the same in every clone); 0 if unknown."""
    out = subprocess.run(["git", "show", "-s", "--format=%ct", commit], cwd=HERE, capture_output=True, text=True)
    return int(out.stdout.strip() or 0) if out.returncode == 0 else 0


def demo_section() -> list[str]:
    """The GPU demo's host time per step by phase (scripts/gpu/demo_gpu.sh), one row per stored run."""
    rows = []
    for f in sorted(HERE.glob("results/gpu-demo/*-demo_*.txt")):
        text = f.read_text()
        m, share, timed = DEMO_LINE.search(text), DEMO_SHARE.search(text), DEMO_TIMED.search(text)
        if m is None:
            continue
        gpu, commit, model = f.stem.rsplit("-", 2)[0], f.stem.split("-")[-2], f.stem.split("demo_")[-1]
        runs = "-" if timed is None else f"{float(timed['median']) * 1000:.0f}"
        shares = _shares(text, share)
        commit, _, build = commit.partition(".")  # "<sha>.mypyc": the compiled build of that commit
        rows.append((model, commit, m, shares, f, gpu, runs, f" ({build})" if build else ""))
    if not rows:
        return []
    lines = ["", "## Host time per step on the GPU demo (`scripts/gpu/demo_gpu.sh`)", ""]
    lines.append(
        "The canary's host (Python) time per verified step of `kvcanary demo --device cuda --baseline` (2-layer "
        "random-weight models, 64 + 8 prompts x 2 sequences), mean by phase in microseconds, and its share of the "
        "step time against the same workload with the canary off. Goals (issue 14): at most 150 us (dense) and "
        "250 us (hybrid) per step, a share of at most 5 % on every model. `total` and the phases are the clean run's "
        "means; `timed runs` the median of the timed canary runs' means (from 229a3f6; each run a new install, so "
        "each captures its own step graphs). The host CPU differs with the machine: compare rows of one GPU and call. "
        "`share %` is the median of the alternating pairs' shares: up to dedbe74 of the runs' wall time (`wall %`), "
        "from 059ada1 of the engine's steps (`steps %`, the set-up, end-of-run collections and waits left out of "
        "both sides). `floor %` is the canary's own timed work (the tap, each cache's set-up, mirroring the engine's "
        "block moves) as a share of the steps with it: timed inside the runs, it is free of the pairs' noise, and "
        "the share of step time cannot be under it. A commit marked `(mypyc)` ran the compiled build (`setup.py`)."
    )
    lines += ["", "| model | gpu | commit | total us | median us | capture | translation | plan/verify/stamp "
              "| host step | timed runs us | steps % | wall % | floor % | source |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    rows.sort(key=lambda r: (r[0], _commit_time(r[1]), r[1], r[7]))
    for model, commit, m, shares, f, gpu, runs, build in rows:
        us = {k: float(v) * 1000 for k, v in m.groupdict().items()}
        lines.append(
            f"| {model} | {gpu} | {commit}{build} | {us['total']:.0f} | {us['median']:.0f} | {us['capture']:.0f} "
            f"| {us['translate']:.0f} | {us['launch']:.0f} | {us['host_step']:.0f} | {runs} | {' | '.join(shares)} "
            f"| `{f.relative_to(HERE)}` |"
        )
    lines += DEMO_NOTES
    return lines


def _shares(text: str, share: re.Match[str] | None) -> tuple[str, str, str]:
    """A demo file's share of the steps, of the wall time and its floor ("-" where the file has none)."""
    wall, floor = DEMO_WALL.search(text), DEMO_FLOOR.search(text)
    if share is None:
        return "-", "-", "-"
    if DEMO_STEPS.search(text) is None:  # before the step clock: the one share is the wall time's
        return "-", share["share"], "-"
    return share["share"], "-" if wall is None else wall["share"], "-" if floor is None else floor["share"]


def host_section() -> list[str]:
    """Host (Python) time per step of the runtime on the GPU path (benchmarks/bench_host_step.py)."""
    hosts = []
    for f in sorted(HERE.glob("results/*.json")):
        d = json.loads(f.read_text())
        hosts += [(d["meta"], f, r) for r in d["records"] if str(r.get("scenario", "")).startswith("host_step")]
    if not hosts:
        return []
    date = max(m["date"] for m, _, _ in hosts)
    dates = {m["date"] for m, _, _ in hosts if _same_call(m["date"], date)}
    lines = ["", f"## Host time per step (`bench_host_step.py`), {date}", ""]
    lines.append(
        "Target: at most 15 us of host (Python) work per step on the GPU path with graphs. Rows: every result "
        "stored within two hours of the newest (the newest session's device calls; one file per call, and a "
        "call may time two commits side by side: compare within a call, machines differ by up to 2x)."
    )
    lines += ["", "| scenario | commit | median us | p20 | p80 | target | source |", "|---|---|---:|---:|---:|---|---|"]
    for m, f, r in hosts:
        if m["date"] not in dates:
            continue
        verdict = "meets" if r["median_us"] <= 15 else "misses"
        lines.append(
            f"| {r['scenario']} | {m['commit']} | {r['median_us']:.1f} | {r['p20_us']:.1f} | {r['p80_us']:.1f} "
            f"| {verdict} <= 15 us | `{f.relative_to(HERE)}` |"
        )
    return lines + _launch_rows(dates)


def _same_call(date: str, newest: str) -> bool:
    """Whether a result stored at ``date`` came from the device call that stored the newest (at ``newest``)."""
    gap = datetime.datetime.fromisoformat(newest) - datetime.datetime.fromisoformat(date)
    return gap <= datetime.timedelta(hours=2)


def _launch_rows(dates: set[str]) -> list[str]:
    """The same run's eager before_forward + after_forward (an engine without CUDA graphs pays it per step)."""
    rows = []
    for f in sorted(HERE.glob("results/*.json")):
        d = json.loads(f.read_text())
        if d["meta"]["date"] in dates:
            rows += [(d["meta"], f, r) for r in d["records"] if str(r.get("scenario", "")).startswith("launch_eager")]
    if not rows:
        return []
    lines = ["", "Eager `before_forward` + `after_forward` of the same run (one validation per group, three Triton "
             "launches per group, the bookkeeping ops; no CUDA graph), and one bare verify launch with no host "
             "checks (Triton's own launch path):", ""]  # fmt: skip
    lines += [
        "| scenario | commit | median us | p20 | p80 | bare launch us | source |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for m, f, r in rows:
        lines.append(
            f"| {r['scenario']} | {m['commit']} | {r['step_median_us']:.1f} | {r['step_p20_us']:.1f} "
            f"| {r['step_p80_us']:.1f} | {r['verify_launch_median_us']:.1f} | `{f.relative_to(HERE)}` |"
        )
    return lines
